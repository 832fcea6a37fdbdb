"""A store worker (a K/V-only worker) under store clients (worker/store.py): whole blocks
written with ``WriteBlocks`` and read back with ``ReadBlocks`` over real gRPC, byte for
byte, in the device layout; refusals (another epoch, a dead lease, a rolled-back
generation, bad block ids, a checksum that does not match, a block left incomplete)
change no block that did not come whole and checked. Then a secure stack: a tenant with a
lease writes the blocks of its sequence into a store worker with a host tier, a worker's
identity is refused, and a revoked lease's writes are refused within a heartbeat."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch

from kvservice import errors
from kvservice.client import Client
from kvservice.tools.launcher import Stack
from kvservice.v1 import worker_pb2 as pb
from kvservice.v1 import worker_pb2_grpc as pb_grpc
from worker.fence import LeaseFence
from worker.pool import PoolShape
from worker.store import CHANNEL_OPTIONS, read_blocks, write_blocks
from worker.tiers import block_bytes
from worker.transfer import block_checksum

from worker_helpers import WorkerThread

pytestmark = pytest.mark.e2e

NUM_BLOCKS = 16
#: 3 layers x 4 KV heads x 16 slots x 64 dims x float32, K and V: 98,304 bytes a block.
SHAPE = PoolShape(NUM_BLOCKS, 16, 3, 4, 64, torch.float32)
BPB = SHAPE.bytes_per_block
DEAD = "deadlease00000000"


@pytest.fixture(scope="module")
def worker():
    with WorkerThread(SHAPE, fence=LeaseFence(), metrics=True) as w:
        yield w


@pytest.fixture(scope="module")
def stub(worker):
    with grpc.insecure_channel(worker.target, options=CHANNEL_OPTIONS) as channel:
        yield pb_grpc.WorkerStub(channel)


@pytest.fixture
def pool_bytes(worker):
    """The pool filled with random bytes; returns a reader of the whole pool's bytes."""
    g = torch.Generator().manual_seed(11)
    for cache in (worker.pool.k_caches, worker.pool.v_caches):
        cache.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, cache.shape, dtype=torch.int32, generator=g))
    return lambda: [bytes(block_bytes(worker.pool, b).numpy()) for b in range(NUM_BLOCKS)]


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n * BPB, dtype=np.uint8)


def _stored(worker: WorkerThread) -> float:
    return worker.metrics.registry.get_sample_value("kvservice_worker_store_blocks_total",
                                                    {"pool": "w0", "direction": "in"})


@pytest.mark.parametrize("chunk", [80 << 10, 1 << 20], ids=["pieces-split-blocks", "several-blocks-a-message"])
def test_written_blocks_come_back_byte_for_byte_in_the_device_layout(worker, stub, pool_bytes, chunk):
    ids = [7, 0, 13, 2, 9]
    data = _random(len(ids), seed=chunk)
    registry = worker.metrics.registry
    written, read = _stored(worker), registry.get_sample_value("kvservice_worker_store_blocks_total",
                                                                {"pool": "w0", "direction": "out"})
    assert write_blocks(stub, epoch=1, lease_id="", generation=0, block_ids=ids, data=data, chunk_bytes=chunk) == 5
    for i, block in enumerate(ids):       # (the layout of a device block: PullBlocks', a lower tier's)
        assert bytes(block_bytes(worker.pool, block).numpy()) == data[i * BPB:(i + 1) * BPB].tobytes()
    assert bytes(read_blocks(stub, epoch=1, block_ids=ids, bytes_per_block=BPB, chunk_bytes=chunk)) == data.tobytes()
    out = torch.zeros(3 * BPB, dtype=torch.uint8)       # (into a tensor; a block named twice)
    assert read_blocks(stub, epoch=1, block_ids=[2, 2, 7], bytes_per_block=BPB, out=out, chunk_bytes=chunk) is out
    assert bytes(out.numpy()) == (data[3 * BPB:4 * BPB].tobytes() * 2 + data[:BPB].tobytes())
    assert _stored(worker) - written == 5
    assert registry.get_sample_value("kvservice_worker_store_blocks_total",
                                     {"pool": "w0", "direction": "out"}) - read == 8


def test_another_epoch_is_refused_and_writes_nothing(stub, pool_bytes):
    before = pool_bytes()
    with pytest.raises(errors.FailedPrecondition) as info:
        write_blocks(stub, epoch=2, lease_id="", generation=0, block_ids=[1], data=_random(1, 1))
    assert info.value.reason == "EPOCH_CHANGED" and "request for epoch 2" in str(info.value)
    with pytest.raises(errors.FailedPrecondition) as info:
        read_blocks(stub, epoch=2, block_ids=[1], bytes_per_block=BPB)
    assert info.value.reason == "EPOCH_CHANGED"
    assert pool_bytes() == before


def test_a_dead_lease_and_a_rolled_back_generation_are_refused_and_write_nothing(worker, stub, pool_bytes):
    before = pool_bytes()
    worker.fence.learn([DEAD], 0)
    with pytest.raises(errors.LeaseExpired, match="expired or was revoked"):
        write_blocks(stub, epoch=1, lease_id=DEAD, generation=0, block_ids=[1, 2], data=_random(2, 2))
    worker.fence.generation = 4
    try:
        with pytest.raises(errors.RolledBack) as info:
            write_blocks(stub, epoch=1, lease_id="live", generation=3, block_ids=[1], data=_random(1, 3))
        assert info.value.generation == 4
        assert write_blocks(stub, epoch=1, lease_id="live", generation=4, block_ids=[1], data=_random(1, 3)) == 1
    finally:
        worker.fence.generation = None
    assert pool_bytes()[2:] == before[2:]


def test_a_checksum_mismatch_is_refused_and_leaves_its_block_unchanged(stub, pool_bytes):
    before = pool_bytes()
    data = _random(2, 4)
    good, bad = data[:BPB].tobytes(), data[BPB:].tobytes()
    first = pb.WriteBlocksRequest(epoch=1, block_ids=[3, 4])
    first.chunk.pieces.extend([
        pb.BlockPiece(position=0, data=good, last=True, checksum=block_checksum(good)),
        pb.BlockPiece(position=1, data=bad[:1000]),
        pb.BlockPiece(position=1, offset=1000, data=bad[1000:], last=True, checksum=block_checksum(bad) ^ 1)])
    with pytest.raises(grpc.RpcError) as info:
        stub.WriteBlocks(iter([first]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block_ids[1] = 4: checksum" in info.value.details()
    after = pool_bytes()
    assert after[3] == good                         # (a block completed before the error is written)
    assert after[4] == before[4] and after[:3] + after[5:] == before[:3] + before[5:]


@pytest.mark.parametrize("ids,words", [([3, NUM_BLOCKS], f"block_ids[1] = {NUM_BLOCKS} is out of range 0..15"),
                                       ([-1], "block_ids[0] = -1 is out of range"),
                                       ([4, 6, 4], "block_ids[2] = 4 appears twice")])
def test_block_ids_out_of_range_or_named_twice_are_refused(stub, pool_bytes, ids, words):
    before = pool_bytes()
    with pytest.raises(errors.InvalidArgument, match=words.replace("[", r"\[").replace("]", r"\]")):
        write_blocks(stub, epoch=1, lease_id="", generation=0, block_ids=ids, data=_random(len(ids), 5))
    assert pool_bytes() == before
    if ids[-1] != 4:
        with pytest.raises(errors.InvalidArgument, match="out of range"):
            read_blocks(stub, epoch=1, block_ids=ids, bytes_per_block=BPB)


def test_a_block_left_incomplete_or_of_another_length_is_refused(stub, pool_bytes):
    before = pool_bytes()
    data = _random(2, 6).tobytes()
    first = pb.WriteBlocksRequest(epoch=1, block_ids=[8, 10])
    first.chunk.pieces.append(pb.BlockPiece(position=0, data=data[:BPB], last=True,
                                            checksum=block_checksum(data[:BPB])))
    later = pb.WriteBlocksRequest()
    later.chunk.pieces.append(pb.BlockPiece(position=1, data=data[BPB:BPB + 5000]))      # (never its last piece)
    with pytest.raises(grpc.RpcError) as info:
        stub.WriteBlocks(iter([first, later]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block_ids[1] = 10: the stream ended before this block" in info.value.details()
    after = pool_bytes()
    assert after[8] == data[:BPB] and after[10] == before[10]
    short = bytes(2 * (BPB - 4))               # (two blocks of the wrong size: one buffer of 2 x (BPB - 4))
    with pytest.raises(errors.InvalidArgument, match=f"{BPB - 4} bytes, a block has {BPB}"):
        write_blocks(stub, epoch=1, lease_id="", generation=0, block_ids=[11, 12], data=short)
    with pytest.raises(errors.InvalidArgument, match="are not 3 blocks"):
        write_blocks(stub, epoch=1, lease_id="", generation=0, block_ids=[11, 12, 13], data=bytes(BPB + 1))
    assert pool_bytes()[9:] == before[9:]


def test_a_message_that_is_not_a_write_blocks_request_is_refused(worker, pool_bytes):
    before = pool_bytes()
    first = pb.WriteBlocksRequest(epoch=1, block_ids=[1]).SerializeToString()
    with grpc.insecure_channel(worker.target) as channel:
        call = channel.stream_unary("/kvservice.v1.Worker/WriteBlocks", request_serializer=None,
                                    response_deserializer=pb.WriteBlocksResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            call(iter([first, b"\x0a\xff"]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid WriteBlocks request message" in info.value.details()
    assert pool_bytes() == before


# ------------------------------------------------------------------ a secure stack

HEARTBEAT = 0.3
STACK_BS = 16
#: A K/V-only store worker with a host tier, heartbeating every 0.3 s.
STORE_WORKER = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "32", "--dtype", "bfloat16",
                "--host-tier-gb", "0.01", "--heartbeat-interval", str(HEARTBEAT))


@pytest.fixture(scope="module")
def stack():
    with Stack(1, model="", block_size=STACK_BS, num_blocks=32, worker_args=STORE_WORKER) as s:
        yield s


def test_a_tenant_stores_its_blocks_a_worker_may_not_and_a_revoked_lease_is_refused(stack):
    client = Client(stack.target, credentials=stack.credentials("engine"), keepalive=False, lease_ttl=30.0)
    channels = {who: stack.credentials(who).channel(stack.workers[0].target, options=list(CHANNEL_OPTIONS))
                for who in ("engine", "admin", "worker-0")}
    stubs = {who: pb_grpc.WorkerStub(ch) for who, ch in channels.items()}
    admin = stack.credentials("admin").channel(stack.target)
    try:
        info = stubs["engine"].Describe(pb.DescribeWorkerRequest(), timeout=10)
        seq = client.create(list(range(3 * STACK_BS)), pool="worker-0")
        ids = list(seq.block_table)
        data = np.random.default_rng(7).integers(0, 256, len(ids) * info.bytes_per_block, dtype=np.uint8)
        write = dict(epoch=info.epoch, lease_id=client.lease_id, generation=client.generation("worker-0"),
                     block_ids=ids, data=data)
        assert write_blocks(stubs["engine"], **write, grants=client.take_grants("worker-0", info.epoch)) == 3
        got = read_blocks(stubs["engine"], epoch=info.epoch, block_ids=ids, bytes_per_block=info.bytes_per_block,
                          lease_id=client.lease_id)
        assert bytes(got) == data.tobytes()
        with pytest.raises(errors.PermissionDenied, match="not open to the admin role"):  # (operations, not bytes)
            read_blocks(stubs["admin"], epoch=info.epoch, block_ids=ids, bytes_per_block=info.bytes_per_block,
                        lease_id=client.lease_id)
        with pytest.raises(errors.PermissionDenied, match="not open to the worker role"):
            write_blocks(stubs["worker-0"], **{**write, "data": np.zeros_like(data)})
        with pytest.raises(errors.PermissionDenied):
            read_blocks(stubs["worker-0"], epoch=info.epoch, block_ids=ids, bytes_per_block=info.bytes_per_block)
        with pytest.raises(errors.InvalidArgument, match="must name its lease"):
            write_blocks(stubs["engine"], **{**write, "lease_id": ""})
        from kvservice.v1 import allocator_pb2 as apb, allocator_pb2_grpc as apb_grpc

        apb_grpc.AllocatorStub(admin).RevokeLease(apb.RevokeLeaseRequest(lease_id=client.lease_id), timeout=10)
        deadline = time.monotonic() + 10 * HEARTBEAT + 1
        while True:
            try:
                write_blocks(stubs["engine"], **write)
            except errors.LeaseExpired:
                break
            assert time.monotonic() < deadline, "a revoked lease kept writing"
            time.sleep(0.02)
        # Its blocks, cached, are what it wrote before it died: another lease of the tenant that
        # shares them (a prompt hit) reads them; the dead lease may not.
        with pytest.raises(errors.PermissionDenied):
            read_blocks(stubs["engine"], epoch=info.epoch, block_ids=ids, bytes_per_block=info.bytes_per_block,
                        lease_id=client.lease_id)
        with Client(stack.target, credentials=stack.credentials("engine"), keepalive=False) as other:
            hit = other.create(list(range(3 * STACK_BS)) + [7], pool="worker-0")
            assert list(hit.block_table[:3]) == ids
            got = read_blocks(stubs["engine"], epoch=info.epoch, block_ids=ids, bytes_per_block=info.bytes_per_block,
                              lease_id=other.lease_id, grants=other.take_grants("worker-0", info.epoch))
            assert bytes(got) == data.tobytes()
    finally:
        for ch in (*channels.values(), admin):
            ch.close()
        client.close()
