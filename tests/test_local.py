"""The SDK's local ownership changes (``Client(local=True)``, DESIGN §5): growth, copy-on-
write, commits, forks and frees change local state at once, reach the allocator through
the journal in the background, and agree with it after ``flush()``."""

from __future__ import annotations

import random
import time

import pytest

from kvservice import errors
from kvservice.client import Client

from helpers import TEST_SETTINGS, ServerThread, audit, stats

BS = 4


@pytest.fixture
def server(any_redis_url):
    with ServerThread(any_redis_url, TEST_SETTINGS.replace(reserve_share=0.05, reserve_min_blocks=4)) as s:
        yield s


def _agree(client: Client, seqs) -> None:
    """After a flush, the allocator's view of each sequence is the client's."""
    client.flush()
    for s in seqs:
        view = client.get(s.id)
        assert list(view.block_table) == s.block_table, s.id
        assert (view.num_tokens, view.num_committed_blocks, view.last_hash) == (
            s.num_tokens, s._committed, s._last_hash), s.id


def test_local_steps_make_no_rpc_and_agree_with_the_allocator_after_a_flush(server):
    rng = random.Random(7)
    with Client(server.target, tenant="t1", local=True) as c:
        c.register_pool("p0", num_blocks=400, block_size=BS)
        live = c.step(creates=[([rng.randrange(100) for _ in range(n)], "p0", b"") for n in (1, 3, 4, 5, 9, 12)]).created
        c.flush()
        rpcs = c.rpc_count
        copies = 0
        for step in range(60):
            forks, frees = {}, []
            if step % 7 == 3:
                forks = {live[step % len(live)]: [[rng.randrange(100)]]}
            if step % 11 == 5 and len(live) > 3:
                frees = [live.pop(0)]
            appends = {s: [rng.randrange(100)] for s in live if s not in frees and s not in forks}
            res = c.step(appends, forks=forks, frees=frees)
            time.sleep(0.002)                               # the model's step on the workers
            copies += len(res.copies)
            for kids in res.children.values():
                live.extend(kids)
        assert c.rpc_count == rpcs, "a decode step called the allocator synchronously"
        assert copies > 0
        _agree(c, live)
        st = stats(server.redis_url, "p0")
        assert st["num_free_blocks"] + st["num_evictable_blocks"] + st["num_used_blocks"] + \
            st["num_reserved_blocks"] == 400
        assert st["num_sequences"] == len(live) and st["cow_copies"] == copies
        assert audit(server.redis_url) == []
        c.step(frees=live)
        c.flush()
        assert stats(server.redis_url, "p0")["num_used_blocks"] == 0
    st = stats(server.redis_url, "p0")
    assert (st["num_reserved_blocks"], st["num_sequences"]) == (0, 0)   # the revoke took the reserve back
    assert audit(server.redis_url) == []


def test_a_block_committed_locally_is_a_prefix_hit_for_another_client_after_the_flush(server):
    with Client(server.target, tenant="t1", local=True) as a, Client(server.target, tenant="t1") as b:
        a.register_pool("p0", num_blocks=100, block_size=BS)
        tokens = [5, 6, 7, 8, 9, 10]
        s = a.create(tokens)
        s.append([11, 12, 13, 14, 15, 16])          # blocks 1 and 2 fill locally
        a.flush()
        hit = b.create(tokens + [11, 12, 13, 14, 15, 16, 99])
        assert hit.num_cached_tokens == 12
        assert hit.block_table[:3] == s.block_table
    assert audit(server.redis_url) == []


def test_a_create_carries_the_pending_journal_first_and_hits_the_blocks_it_commits(server):
    # No flush and no flusher Sync in between (a long flush interval): the create's one RPC
    # applies the journal (the blocks that filled, committed), then looks the prompt up.
    with Client(server.target, tenant="t1", local=True, flush_interval=3600.0) as c:
        c.register_pool("p0", num_blocks=100, block_size=BS)
        tokens = [5, 6, 7, 8, 9, 10]
        s = c.create(tokens)
        c.flush()
        s.append([11, 12, 13, 14, 15, 16])          # blocks 1 and 2 fill: one commit pending
        s.append([17])                              # (its next block: the GROW entry commits them)
        pending_before = sum(j.pending for j in c._journals.values())
        rpcs = c.rpc_count
        hit = c.create(tokens + [11, 12, 13, 14, 15, 16, 99])
        assert pending_before > 0 and c.rpc_count == rpcs + 1
        assert sum(j.pending for j in c._journals.values()) == 0     # acknowledged by the create's reply
        assert hit.num_cached_tokens == 12
        assert hit.block_table[:3] == s.block_table[:3]
        _agree(c, [s, hit])
    assert audit(server.redis_url) == []


def test_a_step_whose_sync_belongs_to_another_lease_is_refused_and_changes_nothing(server):
    import grpc
    from kvservice.v1 import allocator_pb2 as pb

    with Client(server.target, tenant="t1", local=True) as a, Client(server.target, tenant="t2") as b:
        a.register_pool("p0", num_blocks=100, block_size=BS)
        request = pb.StepRequest(lease_id=b.lease_id, request_id="r1",
                                 creates=[pb.CreateOp(token_ids=[1, 2, 3], pool_id="p0")])
        request.sync.lease_id = a.lease_id
        request.sync.request_id = "r2"
        with pytest.raises(grpc.RpcError) as err:
            b.stub.Step(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sync must be of the step's own lease" in err.value.details()
        assert stats(server.redis_url, "p0").get("sequences_created", 0) == 0
        b.create([1, 2, 3], pool="p0")               # (the counter counts what a step creates)
        assert stats(server.redis_url, "p0")["sequences_created"] == 1
    assert audit(server.redis_url) == []


def test_fork_then_writes_copy_the_shared_block_once_and_at_once(server):
    with Client(server.target, tenant="t1", local=True) as c:
        c.register_pool("p0", num_blocks=100, block_size=BS)
        parent = c.create([1, 2, 3, 4, 5, 6])             # [full, partial (5, 6)]
        res = c.step(forks={parent: [[7]]})                # the child writes into the shared block
        child = res.children[parent.id][0]
        assert [(p.src, p.dst) for p in res.copies] == [(parent.block_table[1], child.block_table[1])]
        assert c.step({parent: [8]}).copies == []          # the parent's block is its own again
        assert (parent.num_tokens, child.num_tokens) == (7, 7)
        _agree(c, [parent, child])
        assert stats(server.redis_url, "p0")["cow_copies"] == 1
        child.free()
        parent.free()
        c.flush()
        assert stats(server.redis_url, "p0")["num_used_blocks"] == 0
    assert audit(server.redis_url) == []


def test_a_step_beyond_the_reserve_refills_it_synchronously(server):
    with Client(server.target, tenant="t1", local=True) as c:
        c.register_pool("p0", num_blocks=400, block_size=BS)
        s = c.create([1])
        rpcs = c.rpc_count
        s.append(list(range(200)))                          # 50 blocks at once: more than any reserve
        assert c.rpc_count == rpcs + 1
        _agree(c, [s])
        with pytest.raises(errors.ResourceExhausted):
            s.append(list(range(4000)))                     # more than the pool has
        assert s.num_tokens == 201
        _agree(c, [s])
    assert audit(server.redis_url) == []


def test_a_client_whose_keep_alives_fail_refuses_local_changes_once_its_lease_may_have_expired(any_redis_url):
    server = ServerThread(any_redis_url, TEST_SETTINGS).start()
    c = Client(server.target, tenant="t1", local=True, lease_ttl=0.6, timeout=0.2)
    try:
        c.register_pool("p0", num_blocks=100, block_size=BS)
        s = c.create([1, 2])
        s.append([3])
        server.stop()                                       # keep-alives fail from now on
        time.sleep(0.8)
        with pytest.raises(errors.LeaseExpired):
            s.append([4])                                   # a local append: refused all the same
        assert s.num_tokens == 3
    finally:
        c._stop.set()
        c.channel.close()
        server.stop()


def test_a_step_that_frees_and_grows_in_a_full_pool_gets_the_freed_blocks(server):
    """The Sync that covers the step applies its frees first and sizes the refill after."""
    with Client(server.target, tenant="t1", local=True, flush_interval=3600) as c:
        c.register_pool("p0", num_blocks=16, block_size=BS)
        c.flush()
        seqs = [c.create([i] * (2 * BS) + [i], pool="p0") for i in range(4)]    # 12 blocks, partial last ones
        c.flush()
        with Client(server.target, tenant="t2") as other:
            free = stats(server.redis_url, "p0")["num_free_blocks"]       # (beside the client's reserve)
            filler = other.create(list(range(100, 100 + free * BS)), pool="p0") if free else None
            assert stats(server.redis_url, "p0")["num_free_blocks"] == 0
            keep, drop = seqs[:2], seqs[2:]
            c.step(frees=drop)                        # 6 blocks: 4 full (hashed) and 2 partial
            c.step({s: [7] * (4 * BS) for s in keep})     # 4 new blocks each: more than the reserve holds
            assert all(len(s.block_table) == 7 for s in keep)
            _agree(c, keep)
            if filler is not None:
                filler.free()
        assert audit(server.redis_url) == []


def test_a_create_refused_in_one_pool_keeps_the_sequences_made_in_another(server):
    with Client(server.target, tenant="t1", local=True) as c:
        c.register_pool("small", num_blocks=4, block_size=BS)
        c.register_pool("big", num_blocks=64, block_size=BS)
        with pytest.raises(errors.ResourceExhausted) as info:
            c.step(creates=[([1] * (2 * BS), "big", b""), ([2] * (9 * BS), "small", b"")])
        made = info.value.result.created
        assert [s.pool for s in made] == ["big"]
        made[0].append([3] * (2 * BS))            # journaled like any sequence of this client
        child = made[0].fork([4])
        _agree(c, [made[0], child])
        child.free()
        made[0].free()
        c.flush()
        assert stats(server.redis_url, "big")["num_sequences"] == 0
    assert audit(server.redis_url) == []


def test_one_step_that_frees_and_grows_uses_the_blocks_it_frees(server):
    with Client(server.target, tenant="t1", local=True) as c:
        c.register_pool("p0", num_blocks=8, block_size=16)
        a = c.create(list(range(48)), pool="p0")            # 3 full blocks
        b = c.create(list(range(100, 116)), pool="p0")      # 1 full block
        c.flush()                                           # the reserve holds the other 4
        assert stats(server.redis_url, "p0")["num_free_blocks"] == 0
        c.step({b: list(range(200, 280))}, frees=[a])       # 5 new blocks: the reserve's 4 and one of a's
        assert a.freed and len(b.block_table) == 6
        _agree(c, [b])
    assert audit(server.redis_url) == []


def test_a_create_gets_the_blocks_of_the_lease_reserve(server):
    """A create cannot take reserved blocks: refused, the lease gives its reserve back in
    that pool and tries once more."""
    with Client(server.target, tenant="t1", local=True) as c:
        c.register_pool("p0", num_blocks=10, block_size=BS)
        c.create([1, 2], pool="p0").free()               # the lease's first sequence in the pool
        c.flush()
        assert c.reserved_blocks() == 4 and stats(server.redis_url, "p0")["num_used_blocks"] == 0
        seq = c.create(list(range(7 * BS)), pool="p0")       # 7 blocks of 10, 4 of them reserved
        assert len(seq.block_table) == 7
        seq.append([1])                                      # the reserve comes back for growth
        _agree(c, [seq])
    assert audit(server.redis_url) == []


def test_blocks_a_step_fetched_beyond_the_cap_are_not_returned_before_it_takes_them(server):
    """The flusher returns a reserve's surplus above the cap, but never the blocks that a
    step in progress fetched for itself (frequent thread switches widen the window)."""
    import sys

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with Client(server.target, tenant="t1", local=True, flush_interval=0.0005) as c:
            c.register_pool("p0", num_blocks=2048, block_size=BS)     # cap: 5% of it
            cap = 0
            for rnd in range(12):
                seqs = c.step(creates=[(list(range(1000 * rnd + 10 * i, 1000 * rnd + 10 * i + BS)), "p0",
                                        b"%d" % i) for i in range(120)]).created
                cap = c._journals["p0"].cap
                c.step({s: [7] for s in seqs})                        # 120 blocks, beyond the cap
                assert all(len(s.block_table) == 2 for s in seqs)
                c.step(frees=seqs)
                c.flush()
            assert 0 < cap < 120
    finally:
        sys.setswitchinterval(switch)
    assert audit(server.redis_url) == []
