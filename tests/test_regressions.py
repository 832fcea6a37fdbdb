"""Defects found from outside (a client driven only by the .proto, scenarios of another
block manager's tests), one named test each; the audit is clean after each."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
import redis
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvservice import errors
from kvservice.allocator import keys
from kvservice.client import Client
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

from helpers import audit, snapshot

IA = grpc.StatusCode.INVALID_ARGUMENT


def _geometry(num_blocks: int, block_size: int) -> pb.PoolGeometry:
    return pb.PoolGeometry(num_blocks=num_blocks, block_size=block_size, num_layers=1, num_kv_heads=1,
                           head_dim=8, dtype="float16")


@pytest.fixture
def stub(server):
    channel = server.channel()
    yield pb_grpc.AllocatorStub(channel)
    channel.close()


def _lease(stub: Any, tenant: str = "t1") -> str:
    return stub.GrantLease(pb.GrantLeaseRequest(tenant=tenant, ttl_seconds=60)).lease_id


def _error_info(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(exc)
    info = error_details_pb2.ErrorInfo()
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
    return info


# ------------------------------------------------------------------ request fingerprints


def test_a_reused_request_id_with_a_prompt_that_differs_only_in_its_partial_last_block_is_refused(server, stub):
    stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p0", geometry=_geometry(32, 16)))
    lease = _lease(stub)
    first = stub.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, request_id="r-1", pool_id="p0",
                                                         token_ids=list(range(20))))
    again = stub.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, request_id="r-1", pool_id="p0",
                                                         token_ids=list(range(20))))
    assert again.sequence_id == first.sequence_id          # a true retry is replayed
    with pytest.raises(grpc.RpcError) as info:              # same full block, other partial block
        stub.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, request_id="r-1", pool_id="p0",
                                                     token_ids=list(range(16)) + [99, 98, 97, 96]))
    assert info.value.code() == IA and "request_id r-1 was already used with different arguments" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:              # same tokens, another extra key
        stub.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, request_id="r-1", pool_id="p0",
                                                     token_ids=list(range(20)), extra_key=b"lora-2"))
    assert info.value.code() == IA
    assert audit(server.redis_url) == []


# ------------------------------------------------------------------ a hash never disappears


def test_a_create_that_evicts_its_own_cached_block_keeps_the_hash_on_the_new_block(server):
    with Client(server.target, tenant="t1") as c:
        c.register_pool("p0", num_blocks=4, block_size=16)
        holder = c.create([7] * 10, pool="p0")              # one block held elsewhere
        prompt = list(range(100, 148))                       # 48 tokens: 3 full blocks
        c.create(prompt, pool="p0").free()                   # all 3 cached, evictable
        second = c.create(prompt, pool="p0")                 # hits 2 blocks; evicts the 3rd to allocate it
        assert second.num_cached_tokens == 32
        assert audit(server.redis_url) == []
        second.free()
        holder.free()
        third = c.create(prompt + [1], pool="p0")            # 49 tokens: 3 blocks may hit
        assert third.num_cached_tokens == 48
        third.free()
    assert audit(server.redis_url) == []


def test_a_block_that_fills_with_content_cached_elsewhere_takes_the_hash_when_that_block_is_evicted(server):
    with Client(server.target, tenant="t1") as c:
        c.register_pool("p0", num_blocks=2, block_size=4)
        c.create([0, 1, 2, 3], pool="p0").free()            # block X: tokens 0-3, cached, evictable
        s = c.create([0, 1, 2], pool="p0")                   # block Y (never used before)
        s.append([3])                                        # Y now holds 0-3 too (no RPC)
        s.append([9])                                        # commits Y, grows: evicts X
        assert len(snapshot(server.redis_url, "p0")["h2b"]) == 1
        assert audit(server.redis_url) == []
        s.free()
        again = c.create([0, 1, 2, 3, 9], pool="p0")
        assert again.num_cached_tokens == 4
        again.free()
    assert audit(server.redis_url) == []


# ------------------------------------------------------------------ registration


def test_a_registration_refused_by_its_script_leaves_no_pool_in_the_registry(server, stub):
    r = redis.Redis.from_url(server.redis_url)
    try:
        r.hset(keys.request_key("p9", "r-bad"), "x", "1")   # the script's GET of the request key fails
        with pytest.raises(grpc.RpcError):
            stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p9", geometry=_geometry(8, 4), request_id="r-bad"))
        assert not r.sismember(keys.POOLS, "p9")
        assert not r.exists(keys.pool_key("p9", "meta"))
        assert [p.pool_id for p in stub.ListPools(pb.ListPoolsRequest()).pools] == []
    finally:
        r.close()
    assert audit(server.redis_url) == []


def test_a_registration_without_pool_id_retried_with_its_request_id_gets_the_same_pool(server, stub):
    request = pb.RegisterPoolRequest(geometry=_geometry(8, 4), request_id="reg-1")
    first, again = stub.RegisterPool(request), stub.RegisterPool(request)
    assert first.pool_id == again.pool_id and first.epoch == again.epoch
    other = stub.RegisterPool(pb.RegisterPoolRequest(geometry=_geometry(8, 4), request_id="reg-2"))
    assert other.pool_id != first.pool_id
    assert sorted(p.pool_id for p in stub.ListPools(pb.ListPoolsRequest()).pools) == sorted(
        [first.pool_id, other.pool_id])
    assert audit(server.redis_url) == []


# ------------------------------------------------------------------ placement of retries


def test_a_retried_create_without_pool_returns_the_first_outcome_where_placement_would_now_differ(server, stub):
    for pool in ("p0", "p1"):
        stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool, geometry=_geometry(16, 16)))
    lease = _lease(stub)
    prompt = list(range(40))
    request = pb.CreateSequenceRequest(lease_id=lease, request_id="c-1", token_ids=prompt)
    first = stub.CreateSequence(request)                     # nothing cached: the tie goes to p0
    assert first.pool_id == "p0"
    # Now p1 caches the prompt too and has more blocks available: a new placement picks p1.
    other = stub.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, request_id="c-2", pool_id="p1",
                                                         token_ids=prompt))
    stub.FreeSequences(pb.FreeSequencesRequest(lease_id=lease, request_id="f-1", sequence_ids=[other.sequence_id]))
    probe = stub.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, request_id="c-3", token_ids=prompt))
    assert probe.pool_id == "p1"
    stub.FreeSequences(pb.FreeSequencesRequest(lease_id=lease, request_id="f-2", sequence_ids=[probe.sequence_id]))
    again = stub.CreateSequence(request)                     # the lost reply's retry
    assert again == first
    assert audit(server.redis_url) == []


# ------------------------------------------------------------------ error messages and details


def test_a_huge_sequence_id_is_quoted_short_and_the_sdk_raises_a_kvservice_error(server):
    huge = "p0/1/" + "9" * 9000
    with Client(server.target, tenant="t1") as c:
        c.register_pool("p0", num_blocks=8, block_size=4)
        with pytest.raises(errors.InvalidArgument) as info:
            c.get(huge)
        assert len(info.value.message) < 300 and "malformed sequence_id" in info.value.message
        stub = c.stub
        with pytest.raises(grpc.RpcError) as raw:
            stub.Step(pb.StepRequest(lease_id=c.lease_id, updates=[pb.SeqUpdate(sequence_id=huge, num_tokens=1)]))
        assert raw.value.code() == IA and len(raw.value.details()) < 300
        with pytest.raises(grpc.RpcError) as raw:
            stub.GrantLease(pb.GrantLeaseRequest(tenant="t" * 9000, ttl_seconds=10))
        assert raw.value.code() == IA and len(raw.value.details()) < 300
    assert audit(server.redis_url) == []


def test_every_status_becomes_a_kvservice_error_even_without_readable_details(server):
    with Client(server.target, tenant="t1") as c:
        # A method the server does not have: UNIMPLEMENTED, no status details.
        missing = c.channel.unary_unary("/kvservice.v1.Allocator/NoSuchMethod",
                                        request_serializer=None, response_deserializer=None)
        with pytest.raises(errors.KvsError) as info:
            c._call(missing, b"")
        assert info.value.code == grpc.StatusCode.UNIMPLEMENTED and type(info.value) is errors.KvsError


def test_an_undecodable_request_answers_invalid_argument_with_one_log_line(server, caplog):
    channel = server.channel()
    step = channel.unary_unary("/kvservice.v1.Allocator/Step", request_serializer=None,
                               response_deserializer=pb.StepResponse.FromString)
    with caplog.at_level(logging.DEBUG):
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as info:
                step(b"\xff\xff\xff\xff not a protobuf")
            assert info.value.code() == IA, info.value
            assert "not a valid Step request message" in info.value.details()
            assert _error_info(info.value).reason == "INVALID_ARGUMENT"
    channel.close()
    lines = [r for r in caplog.records if "undecodable" in r.getMessage() or "deserializ" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in lines)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_error_info_reasons_are_upper_snake_case(server, stub):
    stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p0", geometry=_geometry(4, 4)))
    lease = _lease(stub)
    cases = [
        (lambda: stub.GetSequence(pb.GetSequenceRequest(sequence_id="p0/1/99")), "NOT_FOUND"),
        (lambda: stub.GetSequence(pb.GetSequenceRequest(sequence_id="bad id")), "INVALID_ARGUMENT"),
        (lambda: stub.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, pool_id="p0", token_ids=[1] * 40)),
         "BLOCKS_EXHAUSTED"),
        (lambda: stub.Heartbeat(pb.HeartbeatRequest(pool_id="p0", epoch=7)), "EPOCH_CHANGED"),
    ]
    seq = stub.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, pool_id="p0", token_ids=[1, 2]))
    revoke = (lambda: stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=lease)), None)
    expired = (lambda: stub.Step(pb.StepRequest(lease_id=lease, updates=[
        pb.SeqUpdate(sequence_id=seq.sequence_id, num_tokens=2, grow_to=9)])), "LEASE_EXPIRED")
    for call, reason in [*cases, revoke, expired]:
        if reason is None:
            call()
            continue
        with pytest.raises(grpc.RpcError) as info:
            call()
        got = _error_info(info.value)
        assert (got.reason, got.domain) == (reason, "kvservice"), info.value.details()
        assert got.reason in errors.REASONS
    assert audit(server.redis_url) == []
