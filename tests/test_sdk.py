"""The SDK's hot path (DESIGN §5): local appends, at most one RPC per engine step."""

from __future__ import annotations

import pytest

from kvservice import errors
from kvservice.client import Client

BS = 16


@pytest.fixture
def pool(client):
    client.register_pool("hot", num_blocks=256, block_size=BS)
    return "hot"


def test_appends_inside_a_private_last_block_make_no_rpc(client, pool):
    seq = client.create(list(range(17)), pool=pool)     # 2 blocks, 1 token in the second
    calls = client.rpc_count
    for t in range(15):                                  # fills the second block exactly
        res = seq.append([t])
        assert not res.rpc
    assert client.rpc_count == calls
    assert seq.num_tokens == 32 and len(seq.block_table) == 2
    seq.append([99])                                     # crosses into a third block
    assert client.rpc_count == calls + 1 and len(seq.block_table) == 3
    # The server saw the crossing, and committed block 1 with it.
    server_view = client.get(seq.id)
    assert server_view.num_tokens == 33 and server_view.num_committed_blocks == 2
    assert list(server_view.block_table) == seq.block_table


def test_one_engine_step_makes_at_most_one_rpc(client, pool):
    lengths = [5 + i % 4 for i in range(20)]
    seqs = [client.create(list(range(100 * i, 100 * i + n)), pool=pool) for i, n in enumerate(lengths)]
    rpc_steps = []
    for step in range(1, 41):
        before = client.rpc_count
        res = client.step({s: [7] for s in seqs})
        assert client.rpc_count - before == (1 if res.rpc else 0)
        if res.rpc:
            rpc_steps.append(step)
    # A step needs the allocator only when some sequence's last block is full.
    expected = [j for j in range(1, 41) if any((n + j - 1) % BS == 0 for n in lengths)]
    assert rpc_steps == expected == [9, 10, 11, 12, 25, 26, 27, 28]
    for s in seqs:
        view = client.get(s.id)
        assert list(view.block_table) == s.block_table
        assert view.num_tokens <= s.num_tokens <= len(s.block_table) * BS


def test_step_mixing_creates_forks_appends_and_frees_is_one_rpc(client, pool):
    a = client.create(list(range(20)), pool=pool)
    b = client.create(list(range(50, 90)), pool=pool)
    calls = client.rpc_count
    res = client.step({a: [1]}, forks={a: [[2], [3]]}, frees=[b], creates=[list(range(300, 310))])
    assert client.rpc_count == calls + 1
    kids = res.children[a.id]
    assert len(kids) == 2 and len(res.created) == 1 and b.freed
    # Two children and the parent write into the shared partial block: two copies.
    assert len(res.copies) == 2
    assert len({a.block_table[-1], kids[0].block_table[-1], kids[1].block_table[-1]}) == 3
    assert [k.num_tokens for k in kids] == [21, 21] and a.num_tokens == 21


def test_slot_mapping_follows_the_block_table(client, pool):
    seq = client.create(list(range(40)), pool=pool)
    table = seq.block_table
    slots = seq.slot_mapping()
    assert len(slots) == 40
    assert slots[0] == table[0] * BS and slots[17] == table[1] * BS + 1 and slots[39] == table[2] * BS + 7
    assert seq.slot_mapping(38, 40) == slots[38:]
    with pytest.raises(ValueError):
        seq.slot_mapping(0, 49)


def test_context_manager_frees_on_exit(client, pool):
    with client.create(list(range(30)), pool=pool) as seq:
        assert client.pool_stats(pool).num_used_blocks == 2
    assert seq.freed
    s = client.pool_stats(pool)
    assert s.num_used_blocks == 0 and s.num_sequences == 0


def test_deferred_commits_reach_the_cache_with_the_free(client, pool):
    seq = client.create(list(range(10)), pool=pool)
    seq.append(list(range(10, 32)))                     # crosses into block 1 and fills it
    seq.append([])
    seq.free()                                          # block 1 is committed with the free
    again = client.create(list(range(33)), pool=pool)
    assert again.num_cached_tokens == 32


def test_sequences_of_another_client_are_refused_locally(server, client, pool):
    with Client(server.target) as other:
        seq = other.create([1, 2, 3], pool=pool)
        with pytest.raises(ValueError, match="not a sequence of this client"):
            client.step({seq: [4]})
        with pytest.raises(ValueError, match="freed and appended"):
            other.step({seq: [4]}, frees=[seq])


def test_server_refuses_a_foreign_lease(server, client, pool):
    with Client(server.target) as other:
        seq = other.create([1, 2, 3], pool=pool)
        from kvservice.v1 import allocator_pb2 as pb
        # The id's tag is the other lease's: to this lease, no such sequence.
        with pytest.raises(errors.NotFound, match=f"sequence {seq.id} not found"):
            client._call(client.stub.FreeSequences,
                         pb.FreeSequencesRequest(lease_id=client.lease_id, sequence_ids=[seq.id]))
        # Untagged (taken on a server without authentication), the pool itself refuses it.
        with pytest.raises(errors.PermissionDenied, match="belongs to another lease"):
            client._call(client.stub.FreeSequences,
                         pb.FreeSequencesRequest(lease_id=client.lease_id, sequence_ids=[seq.id.partition("-")[0]]))


def test_create_without_a_pool_goes_where_its_cached_prefix_saves_most_then_to_free_blocks(client):
    client.register_pool("big", num_blocks=128, block_size=BS)
    client.register_pool("small", num_blocks=32, block_size=BS)
    first = client.create(list(range(50)))
    assert first.pool == "big"                           # no hit anywhere: most free blocks
    warm = client.create(list(range(1000, 1040)), pool="small")
    again = client.create(list(range(1000, 1050)))
    assert again.pool == "small" and again.num_cached_tokens == 32
    warm.free()


def test_creates_without_a_pool_sharing_a_prefix_spread_over_the_pools_by_their_load(client):
    """Placement's cost (docs/allocator.md, "Placement"): the tokens a pool would compute
    plus a block's worth per sequence it serves. Twelve prompts sharing a 3-block prefix
    cached in one pool do not all land there: each pool takes six, and the second pool
    caches the prefix for its own from its first."""
    client.register_pool("p0", num_blocks=256, block_size=BS)
    client.register_pool("p1", num_blocks=256, block_size=BS)
    shared = list(range(5000, 5000 + 3 * BS))
    warm = client.create(shared + [1], pool="p0")
    made = [client.create(shared + [100 + i, 200 + i]) for i in range(12)]
    counts = {p: sum(s.pool == p for s in made) for p in ("p0", "p1")}
    assert counts == {"p0": 6, "p1": 6}, counts
    assert all(s.num_cached_tokens == 3 * BS for s in made if s.pool == "p0")
    assert sorted(s.num_cached_tokens for s in made if s.pool == "p1") == [0] + [3 * BS] * 5
    for s in [warm, *made]:
        s.free()


def test_the_suites_allocator_takes_tls_and_a_token_only(server):
    """The suite's in-process allocators (``helpers.ServerThread``) run with TLS and
    authentication: plaintext fails the handshake, TLS without a token is UNAUTHENTICATED."""
    import grpc

    from helpers import suite_credentials
    from kvservice.common.security import ClientCredentials
    from kvservice.v1 import allocator_pb2 as pb
    from kvservice.v1 import allocator_pb2_grpc as pb_grpc
    with grpc.insecure_channel(server.target) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.AllocatorStub(ch).ListPools(pb.ListPoolsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with ClientCredentials(ca=suite_credentials().ca).channel(server.target) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.AllocatorStub(ch).ListPools(pb.ListPoolsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_step_whose_creates_hold_more_blocks_than_one_call_is_one_step(client):
    """The allocator takes 512 blocks of creates per script call (max_blocks_per_call): a
    step whose creates hold more is one Step all the same, staged over several calls in
    the pool and all-or-nothing there."""
    client.register_pool("big", num_blocks=4096, block_size=BS)
    prompts = [list(range(i * 1000, i * 1000 + 100 * BS)) for i in range(12)]     # 100 blocks each
    before = client.rpc_count
    made = client.step(creates=[(p, "big", b"") for p in prompts]).created
    assert client.rpc_count - before == 1
    assert [s.num_tokens for s in made] == [100 * BS] * 12
    assert [client.get(s.id).num_tokens for s in made] == [100 * BS] * 12
    # Refused for want of blocks: nothing of the step is made.
    client.register_pool("small", num_blocks=700, block_size=BS)
    with pytest.raises(errors.ResourceExhausted) as info:
        client.step(creates=[(p, "small", b"") for p in prompts[:8]])   # 800 blocks of 700
    assert info.value.needed == 100 and info.value.result is None
    assert client.pool_stats("small").num_used_blocks == 0
    assert client.audit("small").ok
    client.step(frees=made)


def test_a_step_with_more_items_than_one_call_takes_goes_in_several(client):
    """A Step carries 128 items at most (max_items_per_call): the SDK sends a larger step
    in several, frees first, then forks, appends and creates; a refused one leaves the
    ones before it applied, and the error's result holds what they made."""
    from kvservice import batches as sdk
    client.register_pool("many", num_blocks=4096, block_size=BS)
    seqs = client.step(creates=[[i, i + 1] for i in range(300)]).created
    assert len(seqs) == 300 and len({s.id for s in seqs}) == 300
    before = client.rpc_count
    res = client.step({s: [7] * BS for s in seqs[:200]}, forks={s: [[5, 6, 7]] for s in seqs[200:250]},
                      frees=seqs[250:])
    # (frees: 50 -> 1 call; forks of 50 -> 1; 200 appends -> 2)
    assert client.rpc_count - before == 1 + 1 + -(-200 // sdk.MAX_ITEMS)
    assert all(s.num_tokens == 2 + BS for s in seqs[:200]) and all(s.freed for s in seqs[250:])
    kids = [k for s in seqs[200:250] for k in res.children[s.id]]
    assert len(kids) == 50 and all(k.num_tokens == 5 for k in kids)
    assert client.audit("many").ok
    client.step(frees=seqs[:250] + kids)
    assert client.pool_stats("many").num_sequences == 0


def test_an_unexpected_keep_alive_error_is_reported_not_swallowed(redis_url, caplog):
    """A keep-alive answered with a status that is neither 'the allocator is away' nor
    'the lease is gone' is logged and kept in ``keep_alive_error`` (until one succeeds);
    the keep-alives go on, and the lease lives."""
    import logging
    import time

    import grpc

    from fault_server import FaultyServer
    from helpers import TEST_SETTINGS

    with FaultyServer(redis_url, TEST_SETTINGS) as server, caplog.at_level(logging.WARNING, "kvservice.client"):
        with Client(server.target, tenant="t1", lease_ttl=1.5) as c:
            server.faults.fail("KeepAlive", c.lease_id, 2, grpc.StatusCode.INTERNAL)
            deadline = time.monotonic() + 10
            while c.keep_alive_error is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert isinstance(c.keep_alive_error, errors.KvsError), c.keep_alive_error
            assert "an unexpected failure (test)" in str(c.keep_alive_error)
            assert any("keep-alive of lease" in r.getMessage() and "INTERNAL" in r.getMessage()
                       for r in caplog.records)
            while (c.keep_alive_error is not None or server.faults.pending_fails("KeepAlive", c.lease_id)) \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            assert c.keep_alive_error is None and c.lease_error is None
            time.sleep(2.0)                                  # past the TTL: still alive
            c.register_pool("ka", num_blocks=8)
            assert c.create([1, 2, 3], pool="ka").num_tokens == 3
