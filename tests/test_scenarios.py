"""The allocator's contract (DESIGN §3), one named scenario per test, against real Redis
servers (every flavour, and a local 3-primary Redis Cluster) through a real gRPC server
and the SDK."""

from __future__ import annotations

import time

import pytest

from kvservice import errors
from kvservice.client import Client
from kvservice.v1 import allocator_pb2 as pb

from helpers import audit, snapshot, stats

pytestmark = pytest.mark.cluster_too

BS = 4


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


@pytest.fixture
def pool(client):
    client.register_pool("p0", num_blocks=16, block_size=BS)
    return "p0"


@pytest.fixture(autouse=True)
def clean_audit(any_redis_url):
    """Every scenario ends (clients closed, leases revoked) with a clean audit."""
    yield
    assert audit(any_redis_url) == []


def test_prefix_miss_then_hit(client, pool):
    a = client.create(prompt(10), pool=pool)
    assert a.num_cached_tokens == 0
    b = client.create(prompt(10), pool=pool)
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    other = client.create(prompt(10, base=100), pool=pool)
    assert other.num_cached_tokens == 0
    assert not set(other.block_table) & set(a.block_table)
    s = client.pool_stats(pool)
    assert (s.prefix_queried_tokens, s.prefix_hit_tokens) == (30, 8)


def test_only_full_blocks_are_cached_and_last_token_is_never_a_hit(client, pool, server):
    a = client.create(prompt(8), pool=pool)          # exactly two full blocks
    b = client.create(prompt(8), pool=pool)
    assert b.num_cached_tokens == 4                  # block 1 holds the last token: no hit
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    c = client.create(prompt(7), pool=pool)          # partial second block is never shared
    assert c.num_cached_tokens == 4 and c.block_table[1] not in (a.block_table[1], b.block_table[1])
    snap = snapshot(server.redis_url, pool)
    assert len(snap["h2b"]) == 2                     # a's two full blocks; b's duplicate is not re-registered
    assert c.block_table[1] not in snap["b2h"]


def test_freed_cached_block_is_revived_by_an_identical_prompt(client, pool, server):
    a = client.create(prompt(9), pool=pool)
    table = a.block_table
    a.free()
    s = client.pool_stats(pool)
    assert s.num_evictable_blocks == 2 and s.num_used_blocks == 0
    b = client.create(prompt(9), pool=pool)
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == table[:2]
    s = client.pool_stats(pool)
    assert s.num_evictable_blocks == 0 and s.num_used_blocks == 3


def test_lru_eviction_takes_least_recently_freed_first_and_a_chains_tail_before_its_head(client, server):
    client.register_pool("tiny", num_blocks=6, block_size=BS)
    a = client.create(prompt(9), pool="tiny")            # blocks a0 a1 + partial
    b = client.create(prompt(9, base=50), pool="tiny")   # blocks b0 b1 + partial
    a_full, b_full = a.block_table[:2], b.block_table[:2]
    a.free()
    b.free()
    snap = snapshot(server.redis_url, "tiny")
    order = [blk for blk, _ in sorted(snap["evict"].items(), key=lambda x: x[1])]
    assert order == [a_full[1], a_full[0], b_full[1], b_full[0]]
    # Free list: the two partial blocks; the third new block must evict a's tail.
    c = client.create(prompt(12, base=900), pool="tiny")
    assert a_full[1] in c.block_table and a_full[0] not in c.block_table
    assert client.pool_stats("tiny").evictions == 1
    # a's head is still cached; its tail is gone.
    d = client.create(prompt(9), pool="tiny")
    assert d.num_cached_tokens == 4 and d.block_table[0] == a_full[0]


def test_allocation_that_cannot_be_covered_changes_nothing(client, pool, server):
    a = client.create(prompt(30), pool=pool)             # 8 blocks
    before = snapshot(server.redis_url, pool)
    with pytest.raises(errors.ResourceExhausted) as info:
        client.create(prompt(40, base=500), pool=pool)   # 10 more, 8 left
    assert (info.value.needed, info.value.available, info.value.pool_id) == (10, 8, pool)
    assert "needed 10 blocks, 8 available" in info.value.message
    with pytest.raises(errors.ResourceExhausted):
        client.step({a: list(range(40))})
    assert snapshot(server.redis_url, pool) == before
    assert a.num_tokens == 30 and len(a.block_table) == 8
    assert client.pool_stats(pool).allocation_failures == 2


def test_fork_shares_everything_and_allocates_nothing(client, pool, server):
    a = client.create(prompt(10), pool=pool)
    before = client.pool_stats(pool)
    child = a.fork()
    after = client.pool_stats(pool)
    assert child.block_table == a.block_table and child.num_tokens == 10
    assert after.num_used_blocks == before.num_used_blocks and after.blocks_allocated == before.blocks_allocated
    refs = snapshot(server.redis_url, pool)["ref"]
    assert all(refs[b] == 2 for b in a.block_table)


def test_append_after_fork_copies_the_partial_last_block_once_and_only_when_shared(client, pool):
    a = client.create(prompt(10), pool=pool)             # last block holds 2 of 4 tokens
    child = a.fork()
    res = client.step({child: [77]})
    assert [(c.src, c.dst) for c in res.copies] == [(a.block_table[2], child.block_table[2])]
    assert child.block_table[:2] == a.block_table[:2] and child.block_table[2] != a.block_table[2]
    res = client.step({a: [78]})                         # a's block is now private: no copy
    assert res.copies == [] and res.rpc
    calls = client.rpc_count
    res = client.step({a: [79], child: [80]})            # both private, inside their blocks
    assert res.copies == [] and not res.rpc and client.rpc_count == calls
    # A fork at a block boundary shares only full blocks: no copy ever.
    full = client.create(prompt(8, base=300), pool=pool)
    kid = full.fork()
    res = client.step({full: [1], kid: [2]})
    assert res.copies == [] and full.block_table[2] != kid.block_table[2]
    assert client.pool_stats(pool).cow_copies == 1


def test_freeing_one_owner_of_a_shared_block_keeps_it_for_the_other(client, pool, server):
    a = client.create(prompt(10), pool=pool)
    child = a.fork()
    table = a.block_table
    a.free()
    refs = snapshot(server.redis_url, pool)["ref"]
    assert all(refs[b] == 1 for b in table)
    assert child.block_table == table
    res = client.step({child: [5]})                      # now private again: no copy
    assert res.copies == []
    assert client.get(child.id).block_table == table


def test_two_tenants_salts_never_share_a_hit(server, pool):
    with Client(server.target, tenant="alpha") as a, Client(server.target, tenant="beta") as b:
        x = a.create(prompt(12), pool="p0")
        y = b.create(prompt(12), pool="p0")
        assert y.num_cached_tokens == 0 and not set(x.block_table) & set(y.block_table)
        assert a.create(prompt(12), pool="p0").num_cached_tokens == 8


def test_reregistered_pool_rejects_its_old_sequences(client, pool, server):
    a = client.create(prompt(10), pool=pool)
    pb_pool = client.register_pool(pool, num_blocks=16, block_size=BS)
    assert pb_pool.epoch == 2 and pb_pool.stats.num_free_blocks == 16
    for op in (lambda: a.append([1, 2, 3]), lambda: a.fork(), lambda: a.free(), lambda: client.get(a.id)):
        with pytest.raises(errors.FailedPrecondition, match="re-registered"):
            op()
    fresh = client.create(prompt(10), pool=pool)
    assert fresh.epoch == 2 and fresh.num_cached_tokens == 0


def test_expired_lease_frees_all_its_sequences(server, pool):
    c = Client(server.target, tenant="t1", lease_ttl=0.5, keepalive=False)
    seqs = [c.create(prompt(9, base=i * 100), pool=pool) for i in range(3)]
    seqs.append(seqs[0].fork())
    assert client_stats(server, pool)["num_used_blocks"] == 9
    deadline = time.monotonic() + 5
    while client_stats(server, pool)["num_sequences"] and time.monotonic() < deadline:
        time.sleep(0.05)
    s = client_stats(server, pool)
    assert s["num_sequences"] == 0 and s["num_used_blocks"] == 0 and s["sequences_reaped"] == 4
    with pytest.raises(errors.FailedPrecondition, match="expired"):
        seqs[1].append([1, 2, 3, 4])
    with pytest.raises(errors.FailedPrecondition, match="expired"):
        c.create(prompt(3), pool=pool)
    c.close(revoke=False)


def test_keepalive_holds_a_short_lease(server, pool):
    with Client(server.target, lease_ttl=0.3) as c:
        s = c.create(prompt(5), pool=pool)
        time.sleep(1.2)
        s.append([1, 2, 3, 4])
        assert c.get(s.id).num_tokens == 9 and c.lease_error is None


def test_retried_request_id_returns_the_first_outcome(client, pool, server):
    req = pb.CreateSequenceRequest(lease_id=client.lease_id, request_id="req-1", token_ids=prompt(10), pool_id=pool)
    first = client.stub.CreateSequence(req)
    before = snapshot(server.redis_url, pool)
    again = client.stub.CreateSequence(req)
    assert again == first
    assert snapshot(server.redis_url, pool) == before
    req.token_ids.append(99)
    with pytest.raises(Exception) as info:
        client.stub.CreateSequence(req)
    assert "request_id req-1 was already used with different arguments" in info.value.details()


def test_revoke_frees_every_sequence_of_the_lease(server, pool):
    c = Client(server.target)
    for i in range(3):
        c.create(prompt(6, base=i * 10), pool=pool)
    c.close()
    s = client_stats(server, pool)
    assert s["num_sequences"] == 0 and s["num_used_blocks"] == 0


def client_stats(server, pool_id: str) -> dict:
    return stats(server.redis_url, pool_id)
