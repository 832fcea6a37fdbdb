"""Workers behind TLS and authentication (docs/security.md), as real processes in a secure
stack: every Worker RPC refuses callers without an identity or of the wrong role, with
the pool's memory unchanged; writes name their lease, and a dead lease's writes are
refused within one heartbeat of its death."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import grpc
import pytest
import torch

from kvservice.client import Client
from kvservice.tools.launcher import Stack
from kvservice.v1 import allocator_pb2 as apb
from kvservice.v1 import allocator_pb2_grpc as apb_grpc
from kvservice.v1 import worker_pb2 as pb
from kvservice.v1 import worker_pb2_grpc as pb_grpc
from worker import tensors

pytestmark = pytest.mark.e2e

HEARTBEAT = 0.3
BS = 16


@pytest.fixture(scope="module")
def stack():
    """One K/V-only worker (pool worker-0), heartbeats every 0.3 s."""
    with Stack(1, model="", block_size=BS, num_blocks=64,
               worker_args=("--num-layers", "1", "--num-kv-heads", "2", "--head-dim", "8", "--dtype", "float32",
                            "--heartbeat-interval", str(HEARTBEAT))) as s:
        yield s


def _worker(stack: Stack, who: str, token: str = "") -> tuple[grpc.Channel, pb_grpc.WorkerStub]:
    channel = stack.credentials(who, token=token).channel(stack.workers[0].target)
    return channel, pb_grpc.WorkerStub(channel)


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)


def _write(stub, epoch: int, slots: list[int], lease: str, seed: int = 1, generation: int = 0, grants=()):
    k, v = _kv(len(slots), seed)
    return stub.WriteKV(pb.WriteKVRequest(epoch=epoch, layer=0, slot_mapping=slots, key=tensors.encode(k),
                                          value=tensors.encode(v), lease_id=lease, generation=generation,
                                          grants=grants), timeout=10)


def _memory(stub, epoch: int, client: Client) -> bytes:
    """The whole pool's K/V, read by ``client``'s lease (which holds every block)."""
    reply = stub.ReadKV(pb.ReadKVRequest(epoch=epoch, layer=0, slots=list(range(64 * BS)), lease_id=client.lease_id,
                                         grants=client.take_grants("worker-0", epoch)), timeout=10)
    return reply.key.data + reply.value.data


def _requests(epoch: int, lease: str) -> dict[str, object]:
    k, v = _kv(2, 3)
    return {
        "Describe": pb.DescribeWorkerRequest(),
        "WriteKV": pb.WriteKVRequest(epoch=epoch, layer=0, slot_mapping=[0, 1], key=tensors.encode(k),
                                     value=tensors.encode(v), lease_id=lease),
        "ReadKV": pb.ReadKVRequest(epoch=epoch, layer=0, slots=[0, 1]),
        "Attention": pb.AttentionRequest(epoch=epoch, layer=0, query=tensors.encode(torch.randn(1, 2, 8)),
                                         block_tables=[pb.BlockTable(block_ids=[0])], context_lens=[2],
                                         query_lens=[1]),
        "CopyBlocks": pb.CopyBlocksRequest(epoch=epoch, pairs=[pb.BlockCopy(src=0, dst=1)], lease_id=lease),
        "Forward": pb.ForwardRequest(epoch=epoch, lease_id=lease,
                                     sequences=[pb.ForwardSequence(token_ids=[1], block_table=[0], slot_mapping=[0])]),
        "MoveBlocks": pb.MoveBlocksRequest(epoch=epoch, lease_id=lease, moves=[pb.BlockMove(
            src_tier=1, src=0, dst_tier=0, dst=0, block_hash=b"h" * 16)]),
        "FetchBlocks": pb.FetchBlocksRequest(epoch=epoch, lease_id=lease, source_pool_id="worker-9", source_epoch=1,
                                             fetches=[pb.BlockFetch(src=0, dst=0)]),
        "PullBlocks": pb.PullBlocksRequest(pool_id="worker-0", epoch=epoch, blocks=[pb.BlockRef(index=0)]),
        "WriteBlocks": pb.WriteBlocksRequest(epoch=epoch, lease_id=lease, block_ids=[0]),
        "ReadBlocks": pb.ReadBlocksRequest(epoch=epoch, block_ids=[0]),
    }


def _call(stub, method: str, request) -> object:
    """One call; a stream (PullBlocks, ReadBlocks) read to its end; WriteBlocks' request
    stream is the one message."""
    reply = getattr(stub, method)(iter([request]) if method == "WriteBlocks" else request, timeout=10)
    return list(reply) if method in ("PullBlocks", "ReadBlocks") else reply


def test_every_worker_method_refuses_callers_without_an_identity_or_of_the_wrong_role(stack):
    methods = [m.name for m in pb.DESCRIPTOR.services_by_name["Worker"].methods]
    with Client(stack.target, credentials=stack.credentials("engine")) as client:
        channel, engine = _worker(stack, "engine")
        try:
            epoch = engine.Describe(pb.DescribeWorkerRequest(), timeout=10).epoch
            whole = client.create(list(range(5000, 5000 + 64 * BS)), pool="worker-0")    # (every block of the pool)
            before = _memory(engine, epoch, client)
            requests = _requests(epoch, client.lease_id)
            assert sorted(requests) == sorted(methods)
            # The server certificate names no role: an authenticated peer, but no identity;
            # a bad token on a good certificate: the token decides. A worker's certificate:
            # the worker role, which only PullBlocks is open to; an engine never pulls; an
            # admin is for operations, not for bytes (Describe only).
            for who, token, code, methods in (
                    ("server", "", grpc.StatusCode.UNAUTHENTICATED, list(requests)),
                    ("engine", "kvs_not-a-token", grpc.StatusCode.UNAUTHENTICATED, list(requests)),
                    ("worker-0", "", grpc.StatusCode.PERMISSION_DENIED, [m for m in requests if m != "PullBlocks"]),
                    ("engine", "", grpc.StatusCode.PERMISSION_DENIED, ["PullBlocks"]),
                    ("admin", "", grpc.StatusCode.PERMISSION_DENIED, [m for m in requests if m != "Describe"])):
                ch, stub = _worker(stack, who, token)
                try:
                    for method in methods:
                        with pytest.raises(grpc.RpcError) as info:
                            _call(stub, method, requests[method])
                        assert info.value.code() == code, (who, method, info.value.details())
                finally:
                    ch.close()
            ch, stub = _worker(stack, "worker-0")     # (the role passes; a pull the allocator never ordered does not)
            try:
                with pytest.raises(grpc.RpcError) as info:
                    _call(stub, "PullBlocks", requests["PullBlocks"])
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "fetch order" in info.value.details()
            finally:
                ch.close()
            plaintext = grpc.insecure_channel(stack.workers[0].target)
            try:
                with pytest.raises(grpc.RpcError) as info:
                    pb_grpc.WorkerStub(plaintext).WriteKV(requests["WriteKV"], timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                plaintext.close()
            assert _memory(engine, epoch, client) == before
            whole.free()
        finally:
            channel.close()


def test_a_write_must_name_its_lease(stack):
    channel, engine = _worker(stack, "engine")
    try:
        epoch = engine.Describe(pb.DescribeWorkerRequest(), timeout=10).epoch
        with pytest.raises(grpc.RpcError) as info:
            _write(engine, epoch, [0, 1], lease="")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must name its lease" in info.value.details()
    finally:
        channel.close()


@pytest.mark.parametrize("death", ["revoked", "expired"])
def test_a_dead_lease_s_writes_are_refused_within_a_heartbeat(stack, death):
    ttl = 1.0 if death == "expired" else 30.0
    client = Client(stack.target, credentials=stack.credentials("engine"), keepalive=False, lease_ttl=ttl)
    # (a prompt of its own: a block cached by an earlier test is shared, and written by nobody)
    seq = client.create(list(range(300 if death == "revoked" else 400, 320 if death == "revoked" else 420)),
                        pool="worker-0")
    slots = [b * BS + i for b in seq.block_table for i in range(BS)][:20]
    channel, engine = _worker(stack, "engine")
    admin_channel = stack.credentials("admin").channel(stack.target)
    try:
        epoch = engine.Describe(pb.DescribeWorkerRequest(), timeout=10).epoch
        gen = client.generation("worker-0")
        assert gen and _write(engine, epoch, slots, client.lease_id, generation=gen,
                              grants=client.take_grants("worker-0", epoch)).num_written == 20
        if death == "revoked":
            apb_grpc.AllocatorStub(admin_channel).RevokeLease(apb.RevokeLeaseRequest(lease_id=client.lease_id),
                                                              timeout=10)
            revoked = time.monotonic()
        else:   # (no keep-alive: the lease dies at its deadline, the allocator's reaper frees it)
            revoked = time.monotonic() + (client.lease.deadline_ms / 1000 - time.time())   # (its deadline)
        while True:
            try:
                _write(engine, epoch, slots, client.lease_id, seed=2, generation=gen)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
                assert "expired or was revoked" in exc.details()
                break
            assert time.monotonic() - revoked < 10 * HEARTBEAT + ttl, f"a {death} lease kept writing"
            time.sleep(0.02)
        took = time.monotonic() - revoked
        print(f"\n{death} lease's writes refused {took * 1000:.0f} ms after its death "
              f"(heartbeat interval {HEARTBEAT * 1000:.0f} ms, reap interval 500 ms)")
        assert took < 3 * HEARTBEAT + 0.5 + 0.5, f"refused only {took:.2f} s after the lease died"
        # Another lease writes on, into blocks of its own.
        with Client(stack.target, credentials=stack.credentials("engine"), keepalive=False) as other:
            mine = other.create(list(range(500 if death == "revoked" else 600, 520 if death == "revoked" else 620)),
                                pool="worker-0")
            slots = [b * BS + i for b in mine.block_table for i in range(BS)][:20]
            assert _write(engine, epoch, slots, other.lease_id, seed=3, generation=gen,
                          grants=other.take_grants("worker-0", epoch)).num_written == 20
    finally:
        channel.close()
        admin_channel.close()
        client.close()


def test_the_stack_s_redis_takes_only_its_acl_users(stack):
    import redis

    from kvservice.allocator.embedded import ALLOCATOR_USER

    plain = redis.Redis(host="127.0.0.1", port=stack.redis.port)
    with pytest.raises(redis.AuthenticationError):
        plain.ping()
    allocator = redis.Redis.from_url(stack.redis.tcp_url)
    assert urlsplit(stack.redis.tcp_url).username == ALLOCATOR_USER and allocator.ping()
    for forbidden in (allocator.flushall, allocator.keys, lambda: allocator.config_get("*"),
                      lambda: allocator.set("not-ours", 1)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    assert redis.Redis.from_url(stack.redis.admin_url).dbsize() > 0
    with open(f"{stack.credentials_dir}/redis-url") as f:
        assert f.read().strip() == stack.redis.tcp_url
