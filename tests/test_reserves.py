"""Lease reserves (DESIGN §5): blocks granted to a lease in bulk by Sync, owned by it and
by no table, taken back on return, on revoke and on expiry; against a real server."""

from __future__ import annotations

import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

from helpers import TEST_SETTINGS, ServerThread, audit, snapshot, stats


def _geometry(num_blocks: int, block_size: int = 4) -> pb.PoolGeometry:
    return pb.PoolGeometry(num_blocks=num_blocks, block_size=block_size, num_layers=1, num_kv_heads=1,
                           head_dim=8, dtype="float16")


@pytest.fixture
def served(any_redis_url):
    settings = TEST_SETTINGS.replace(reserve_share=0.1, reserve_min_blocks=2, reserve_pressure_share=0.05)
    with ServerThread(any_redis_url, settings) as server:
        channel = server.channel()
        stub = pb_grpc.AllocatorStub(channel)
        stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p0", geometry=_geometry(100)))
        yield server, stub
        channel.close()


def _lease(stub, ttl: float = 60.0, tenant: str = "t1") -> str:
    return stub.GrantLease(pb.GrantLeaseRequest(tenant=tenant, ttl_seconds=ttl)).lease_id


def _sync(stub, lease: str, want: int = 0, returned=(), request_id: str = "", epoch: int = 1,
          need: int = 0) -> pb.SyncResponse:
    return stub.Sync(pb.SyncRequest(lease_id=lease, request_id=request_id, pools=[
        pb.PoolSync(pool_id="p0", epoch=epoch, want_blocks=want, returned_blocks=list(returned), need_blocks=need)]))


def _reason(exc: grpc.RpcError) -> str:
    info = error_details_pb2.ErrorInfo()
    for detail in rpc_status.from_call(exc).details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
    return info.reason


def test_a_sync_fills_the_reserve_up_to_the_cap_and_no_further(served):
    server, stub = served
    lease = _lease(stub)
    first = _sync(stub, lease, want=50).pools[0]
    assert first.reserve_cap == 10 and first.num_reserved_blocks == 10
    assert len(set(first.granted_blocks)) == 10
    again = _sync(stub, lease, want=50).pools[0]
    assert list(again.granted_blocks) == [] and again.num_reserved_blocks == 10
    st = stats(server.redis_url, "p0")
    assert (st["num_reserved_blocks"], st["num_free_blocks"], st["num_used_blocks"]) == (10, 90, 0)
    assert sorted(b for _, b in snapshot(server.redis_url, "p0")["reserve"]) == sorted(first.granted_blocks)
    assert audit(server.redis_url) == []


def test_reserved_blocks_are_not_available_to_another_lease(served):
    server, stub = served
    a, b = _lease(stub), _lease(stub, tenant="t2")
    for _ in range(9):   # nine leases of 10 blocks each: 90 reserved
        _sync(stub, _lease(stub), want=10)
    with pytest.raises(grpc.RpcError) as info:   # 11 blocks of 4 tokens: only 10 are free
        stub.CreateSequence(pb.CreateSequenceRequest(lease_id=b, pool_id="p0", token_ids=list(range(44))))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needed 11 blocks, 10 available" in info.value.details()
    stub.CreateSequence(pb.CreateSequenceRequest(lease_id=b, pool_id="p0", token_ids=list(range(32))))
    grant = _sync(stub, a, want=10).pools[0]     # 2 of 100 left (< 5%): the cap drops
    assert grant.reserve_cap == 2 and grant.num_reserved_blocks == 2
    assert audit(server.redis_url) == []


def test_returned_blocks_go_back_and_a_block_the_lease_does_not_hold_is_refused(served):
    server, stub = served
    a, b = _lease(stub), _lease(stub, tenant="t2")
    mine = list(_sync(stub, a, want=4).pools[0].granted_blocks)
    theirs = list(_sync(stub, b, want=4).pools[0].granted_blocks)
    before = snapshot(server.redis_url, "p0")
    for returned in ([theirs[0]], [mine[0], mine[0]], [100], [mine[0], theirs[0]]):
        with pytest.raises(grpc.RpcError) as info:
            _sync(stub, a, returned=returned)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, returned
    after = snapshot(server.redis_url, "p0")
    assert after.pop("leases").keys() == before.pop("leases").keys()   # (the keep-alive moved a deadline)
    assert after == before
    kept = _sync(stub, a, returned=mine[:3]).pools[0]
    assert kept.num_reserved_blocks == 1 and list(kept.granted_blocks) == []
    assert stats(server.redis_url, "p0")["num_reserved_blocks"] == 5
    assert audit(server.redis_url) == []


def test_a_retried_sync_returns_the_same_grant_and_other_arguments_are_refused(served):
    server, stub = served
    lease = _lease(stub)
    first = _sync(stub, lease, want=6, request_id="s-1")
    again = _sync(stub, lease, want=6, request_id="s-1")
    assert list(again.pools[0].granted_blocks) == list(first.pools[0].granted_blocks)
    assert stats(server.redis_url, "p0")["num_reserved_blocks"] == 6
    with pytest.raises(grpc.RpcError) as info:
        _sync(stub, lease, want=7, request_id="s-1")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert audit(server.redis_url) == []


def test_revoke_and_expiry_give_the_reserve_back(served):
    server, stub = served
    revoked, short = _lease(stub), _lease(stub, ttl=0.3)
    _sync(stub, revoked, want=10)
    _sync(stub, short, want=10)
    assert stats(server.redis_url, "p0")["num_reserved_blocks"] == 20
    stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=revoked))
    assert stats(server.redis_url, "p0")["num_reserved_blocks"] == 10
    deadline = time.monotonic() + 10
    while stats(server.redis_url, "p0")["num_reserved_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    st = stats(server.redis_url, "p0")
    assert (st["num_reserved_blocks"], st["num_free_blocks"]) == (0, 100)
    with pytest.raises(grpc.RpcError) as info:
        _sync(stub, short, want=1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and _reason(info.value) == "LEASE_EXPIRED"
    assert audit(server.redis_url) == []


def test_sync_keeps_the_lease_alive(served):
    server, stub = served
    lease = stub.GrantLease(pb.GrantLeaseRequest(tenant="t1", ttl_seconds=0.6))
    for _ in range(8):     # 1.6 s in all, a keep-alive every 0.2 s
        time.sleep(0.2)
        reply = _sync(stub, lease.lease_id, want=2)
    assert reply.lease.deadline_ms > lease.deadline_ms
    assert stats(server.redis_url, "p0")["num_reserved_blocks"] == 2
    assert audit(server.redis_url) == []


def test_a_refill_keeps_the_prefix_cache_and_a_step_that_needs_blocks_evicts(any_redis_url):
    settings = TEST_SETTINGS.replace(reserve_share=1.0, reserve_min_blocks=2, reserve_pressure_share=0.0)
    with ServerThread(any_redis_url, settings) as server, server.channel() as channel:
        stub = pb_grpc.AllocatorStub(channel)
        stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p0", geometry=_geometry(8)))
        lease = _lease(stub)
        seq = stub.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, pool_id="p0", token_ids=list(range(32))))
        stub.FreeSequences(pb.FreeSequencesRequest(lease_id=lease, sequence_ids=[seq.sequence_id]))
        assert stats(server.redis_url, "p0")["num_evictable_blocks"] == 8
        grant = _sync(stub, lease, want=3).pools[0]      # a refill: free blocks only, there are none
        assert not grant.granted_blocks and stats(server.redis_url, "p0").get("evictions", 0) == 0
        grant = _sync(stub, lease, need=3).pools[0]      # a step's need: evicts, LRU first
        st = stats(server.redis_url, "p0")
        assert (len(grant.granted_blocks), st["num_evictable_blocks"], st["evictions"]) == (3, 5, 3)
        assert len(snapshot(server.redis_url, "p0")["h2b"]) == 5
        assert audit(server.redis_url) == []


def test_sync_refuses_bad_input_and_stale_epochs(served):
    server, stub = served
    lease = _lease(stub)
    cases = [
        (pb.SyncRequest(lease_id=lease, pools=[pb.PoolSync(pool_id="nope", epoch=1)]), grpc.StatusCode.NOT_FOUND),
        (pb.SyncRequest(lease_id=lease, pools=[pb.PoolSync(pool_id="p0", epoch=0)]), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.SyncRequest(lease_id=lease, pools=[pb.PoolSync(pool_id="p0", epoch=1, want_blocks=-1)]),
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.SyncRequest(lease_id=lease, pools=[pb.PoolSync(pool_id="p0", epoch=1)] * 2),
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.SyncRequest(lease_id="feedfacefeedface", pools=[]), grpc.StatusCode.NOT_FOUND),
    ]
    before = snapshot(server.redis_url, "p0")
    for request, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.Sync(request)
        assert info.value.code() == code, (request, info.value.details())
    stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p0", geometry=_geometry(100)))   # epoch 2
    with pytest.raises(grpc.RpcError) as info:
        _sync(stub, lease, want=2, epoch=1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and _reason(info.value) == "EPOCH_CHANGED"
    assert before["reserve"] == []
    assert audit(server.redis_url) == []
