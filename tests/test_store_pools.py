"""A KV store's pools in the allocator (DESIGN §15): pools registered with role "store" take
only creates that ask for them (CreateOp.pool_role), and a create whose blocks another
process writes defers their hashes to the commits that follow the write
(CreateOp.defer_commits), so that no create hits a block before its bytes are there. Over
one Redis and the local Redis Cluster."""

from __future__ import annotations

import dataclasses

import pytest

from kvservice import errors
from kvservice.client import Client, new_request_id
from kvservice.v1 import allocator_pb2 as pb

from helpers import TEST_SETTINGS, ServerThread, audit

BS = 4
PROMPT = list(range(1, 14))            # 13 tokens: 3 full blocks and a partial one

pytestmark = pytest.mark.cluster_too


@pytest.fixture
def store(any_redis_url):
    with ServerThread(any_redis_url, TEST_SETTINGS) as s, Client(s.target, tenant="t1", lease_ttl=30.0) as c:
        c.register_pool("engine", num_blocks=64, block_size=BS)
        c.register_pool("store", num_blocks=64, block_size=BS, role="store")
        yield s, c, any_redis_url


def _create(c: Client, tokens: list[int], *, pool: str = "", role: str = "store", defer: bool = True) -> pb.Sequence:
    reply = c._call(c.stub.Step, pb.StepRequest(lease_id=c.lease_id, request_id=new_request_id(), creates=[
        pb.CreateOp(token_ids=tokens, pool_id=pool, pool_role=role, defer_commits=defer)]))
    return reply.created[0]


def _commit(c: Client, seq: pb.Sequence, first: int, last: int, tokens: list[int], *, free: bool) -> pb.SeqDelta:
    update = pb.SeqUpdate(sequence_id=seq.sequence_id, num_tokens=seq.num_tokens, parent_hash=seq.last_hash,
                          free=free, commits=[pb.BlockCommit(index=i, token_ids=tokens[i * BS:(i + 1) * BS])
                                              for i in range(first, last)])
    return c._call(c.stub.Step, pb.StepRequest(lease_id=c.lease_id, request_id=new_request_id(),
                                               updates=[update])).updates[0]


def test_a_deferred_create_is_hit_only_once_its_blocks_are_committed(store):
    _, c, url = store
    writer = _create(c, PROMPT)
    assert writer.pool_id == "store" and writer.num_cached_tokens == 0
    assert writer.num_committed_blocks == 0 and len(writer.block_table) == 4
    with Client(store[0].target, tenant="t1") as reader:
        early = _create(reader, PROMPT)
        assert early.num_cached_tokens == 0          # (written or not, nothing is promised yet)
        reader._call(reader.stub.FreeSequences, pb.FreeSequencesRequest(
            lease_id=reader.lease_id, sequence_ids=[early.sequence_id]))
        delta = _commit(c, writer, 0, 3, PROMPT, free=True)
        assert delta.num_committed_blocks == 3 and delta.freed
        later = _create(reader, PROMPT)
        assert later.num_cached_tokens == 12 and later.num_committed_blocks == 3
        assert list(later.block_table[:3]) == list(writer.block_table[:3])
    assert audit(url, "store") == []


def test_a_deferred_create_commits_its_cached_prefix_and_the_rest_follows_it(store):
    _, c, url = store
    first = _create(c, PROMPT[:9])                    # 2 full blocks, written then committed
    _commit(c, first, 0, 2, PROMPT, free=True)
    longer = PROMPT + [50, 51, 52]                    # 16 tokens: 4 full blocks
    seq = _create(c, longer)
    assert seq.num_cached_tokens == 8 and seq.num_committed_blocks == 2
    with pytest.raises(errors.InvalidArgument, match="commit starts at block 0"):
        _commit(c, seq, 0, 4, longer, free=False)
    delta = _commit(c, seq, 2, 4, longer, free=True)
    assert delta.num_committed_blocks == 4
    again = _create(c, longer + [60])
    assert again.num_cached_tokens == 16
    assert audit(url, "store") == []


def test_a_create_that_does_not_defer_commits_its_whole_prompt_in_a_store_pool_too(store):
    _, c, _ = store
    seq = _create(c, PROMPT, defer=False)
    assert seq.pool_id == "store" and seq.num_committed_blocks == 3
    assert _create(c, PROMPT).num_cached_tokens == 12


def test_a_create_staged_in_bounded_calls_defers_its_commits_too(any_redis_url):
    # (4 blocks, 2 a call: the create is a run of parts; deferred, no part registers a hash)
    settings = dataclasses.replace(TEST_SETTINGS, max_blocks_per_call=2)
    with ServerThread(any_redis_url, settings) as s, Client(s.target, tenant="t1") as c:
        c.register_pool("store", num_blocks=64, block_size=BS, role="store")
        writer = _create(c, PROMPT)
        assert writer.num_committed_blocks == 0 and len(writer.block_table) == 4
        early = _create(c, PROMPT, defer=False)
        assert early.num_cached_tokens == 0 and early.num_committed_blocks == 3
        assert set(early.block_table).isdisjoint(writer.block_table)
        reused = _create(c, PROMPT)          # (the committed one's blocks; the writer's stay unhashed)
        assert reused.num_cached_tokens == 12 and list(reused.block_table[:3]) == list(early.block_table[:3])
        assert c.pool_stats("store").num_free_blocks == 64 - 4 - 4 - 1
        assert audit(any_redis_url, "store") == []


def test_store_pools_take_only_the_stores_creates(store):
    server, c, url = store
    for _ in range(3):
        assert _create(c, PROMPT, role="", defer=False).pool_id == "engine"
        assert _create(c, PROMPT).pool_id == "store"
    assert c.create(PROMPT).pool == "engine"          # (the SDK's creates: the engine's pools)
    with pytest.raises(errors.InvalidArgument, match='pool engine .* pool_role "store"'):
        _create(c, PROMPT, pool="engine")
    assert _create(c, PROMPT, pool="store", role="").pool_id == "store"     # (named: any create)
    with pytest.raises(errors.InvalidArgument, match='pool_role must be empty or "store", got'):
        _create(c, PROMPT, role="decode")
    c.unregister_pool("store", force=True)
    with pytest.raises(errors.FailedPrecondition, match="no store pool is registered"):
        _create(c, PROMPT)
    c.register_pool("store", num_blocks=64, block_size=BS, role="store")
    c.unregister_pool("engine", force=True)
    with pytest.raises(errors.FailedPrecondition, match="no pool is registered .store pools take only a store's"):
        _create(c, PROMPT, role="", defer=False)
    assert audit(url) == []
