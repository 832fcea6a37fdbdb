"""Workers as real processes against a real allocator: registration, epochs, heartbeats."""

from __future__ import annotations

import time

import grpc
import pytest

from kvservice.client import Client
from kvservice.allocator.embedded import free_port
from kvservice.tools.launcher import AllocatorProcess, WorkerProcess
from kvservice.v1 import worker_pb2 as pb
from kvservice.v1 import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

GEOMETRY = ("--num-blocks", "48", "--block-size", "16", "--num-layers", "2", "--num-kv-heads", "2",
            "--head-dim", "64", "--dtype", "float32", "--device", "cpu")


def worker_args(allocator: str, pool_id: str, *extra: str) -> tuple[str, ...]:
    return ("--allocator", allocator, "--pool-id", pool_id, "--heartbeat-interval", "0.2", *GEOMETRY, *extra)


def describe(target: str) -> pb.WorkerInfo:
    with grpc.insecure_channel(target) as ch:
        return pb_grpc.WorkerStub(ch).Describe(pb.DescribeWorkerRequest(), timeout=10)


@pytest.fixture(scope="module")
def allocator():
    with AllocatorProcess() as proc:
        yield proc


def test_a_registered_worker_appears_in_the_pool_list_with_its_geometry(allocator):
    with WorkerProcess(*worker_args(allocator.target, "w1")) as w, Client(allocator.target) as c:
        pools = {p.pool_id: p for p in c.pools()}
        assert "w1" in pools
        p = pools["w1"]
        g = p.geometry
        assert (g.num_blocks, g.block_size, g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) == \
            (48, 16, 2, 2, 64, "float32")
        assert p.worker_address == w.target
        info = describe(w.target)
        assert info.epoch == p.epoch and info.allocator == allocator.target
        # Heartbeats stamp the pool with the allocator's Redis clock.
        deadline = time.monotonic() + 10
        while c.pools() and not {q.pool_id: q for q in c.pools()}["w1"].last_heartbeat_ms:
            assert time.monotonic() < deadline, "no heartbeat reached the allocator"
            time.sleep(0.1)
        # Its blocks are the allocator's to hand out: a sequence gets blocks of this pool.
        seq = c.create(list(range(40)), pool="w1")
        assert len(seq.block_table) == 3 and all(0 <= b < 48 for b in seq.block_table)


def test_a_restarted_worker_gets_a_new_epoch_and_refuses_the_old_one(allocator):
    with WorkerProcess(*worker_args(allocator.target, "w2")) as w:
        first = describe(w.target).epoch
    with WorkerProcess(*worker_args(allocator.target, "w2")) as w, Client(allocator.target) as c:
        second = describe(w.target).epoch
        assert second == first + 1
        assert {p.pool_id: p for p in c.pools()}["w2"].epoch == second
        with grpc.insecure_channel(w.target) as ch:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.WorkerStub(ch).CopyBlocks(pb.CopyBlocksRequest(epoch=first, pairs=[pb.BlockCopy(src=0, dst=1)]))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"request for epoch {first}, but pool w2 is at epoch {second}" in info.value.details()


def test_a_worker_started_before_the_allocator_registers_once_it_is_up():
    port = free_port()
    target = f"127.0.0.1:{port}"
    w = WorkerProcess(*worker_args(target, "w3")).start(wait=False)
    try:
        deadline = time.monotonic() + 60
        while "allocator not reachable yet" not in w.log():
            assert w.proc.poll() is None, w.log()
            assert time.monotonic() < deadline, w.log()
            time.sleep(0.1)
        with AllocatorProcess(port=port) as a, Client(a.target) as c:
            w.wait_ready(30)
            assert "w3" in {p.pool_id for p in c.pools()}
    finally:
        w.stop()


def test_a_worker_whose_pool_is_registered_again_elsewhere_stops(allocator):
    with WorkerProcess(*worker_args(allocator.target, "w4")) as w, Client(allocator.target) as c:
        c.register_pool("w4", num_blocks=8, block_size=16)      # someone else takes the pool id
        assert w.proc.wait(15) == 3
        assert "was registered again elsewhere" in w.log()


def test_bad_worker_flags_exit_2_with_the_reason():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "worker", "--kv-memory", "lots"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "kv_memory 'lots' is neither a size" in out.stderr


@pytest.mark.parametrize("flags, message", [
    (("--head-dim", "96"), "head_dim 96 is not one the CUDA kernels are built for: 64, 128, 256"),
    (("--block-size", "256"), "block_size 256 is not one the CUDA kernels are built for: 8, 16, 32, 64, 128"),
], ids=["head-dim-96", "block-size-256"])
def test_a_cuda_worker_whose_geometry_the_kernels_lack_exits_at_start_up_naming_it(allocator, flags, message):
    """(Checked before the device is touched, so it holds on a machine without a GPU too;
    the pool is never registered.)"""
    import subprocess
    import sys

    args = dict(zip(GEOMETRY[::2], GEOMETRY[1::2])) | {"--device": "cuda"} | dict(zip(flags[::2], flags[1::2]))
    out = subprocess.run([sys.executable, "-m", "worker", "--allocator", allocator.target, "--pool-id", "bad-gpu",
                          *(x for kv in args.items() for x in kv)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and message in out.stderr, out.stderr
    with Client(allocator.target) as c:
        assert "bad-gpu" not in {p.pool_id for p in c.pools()}
