"""``kvservice bench-transfer``: blocks moved from one worker to another on one machine
(DESIGN §13), beside raw gRPC streaming of the same bytes and a memory copy, in one run.

A local stack (Redis, an allocator, two SmolLM2 workers, mTLS everywhere) holds a
sequence of ``--batch-mib`` worth of blocks in ``worker-0`` (written with random K/V) and
one as long in ``worker-1``. Each round asks ``worker-1`` to fill its blocks with
``worker-0``'s (``FetchBlocks``: it pulls them over ``PullBlocks``, checks every block's
length and XXH3-64 checksum and writes them into its pool); ``gbps`` is the bytes moved
over the rounds' wall time, as its caller sees it. The workers run as they do by default
on one machine: the blocks go through a staging file in shared memory and the stream
carries their checksums. Each round then streams as many bytes over a plain gRPC stream
from another process, with the same credentials and message size, to an asyncio channel of
this one (``grpc_stream_gbps``: what the transport alone carries; alternated, so that a
slower moment of the machine slows both). A second stack runs the same rounds with
``--shared-memory-dir ''``: the blocks in the stream, as between two machines
(``stream_gbps``, beside its own raw stream, ``stream_grpc_stream_gbps``); last, a copy of
the bytes in memory (``memcpy_gbps``). Gigabits are 10⁹ bits a second. Every round's
blocks are compared (two layers' K/V read back from both workers) before the figures are
printed.

Usage::

    kvservice bench-transfer [--batch-mib 32] [--rounds 64] [--chunk-kib 4096] [--json]
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvservice.common.grpc import MAX_BLOCK_STREAM_MESSAGE

MODEL = "smollm2-135m"
RAW_SERVICE = "/kvservice.bench.RawStream/Pull"


def progress(msg: str) -> None:
    print(f"[bench-transfer] {msg}", file=sys.stderr, flush=True)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes * 8 / seconds / 1e9, 3)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    progress("workers of one machine, as they are by default: the blocks through a staging file in shared memory")
    moved, seconds, raw_seconds, blocks, per_block, staged = _rounds(args, "/dev/shm")
    if not staged:
        raise RuntimeError("no fetch went through a staging file (is /dev/shm a writable directory?)")
    progress("the same with --shared-memory-dir '': the blocks in the stream, as between machines")
    s_moved, s_seconds, s_raw_seconds, _, _, s_staged = _rounds(args, "")
    if s_staged:
        raise RuntimeError(f"{s_staged} fetches went through a staging file with --shared-memory-dir ''")
    data = memoryview(os.urandom(blocks * per_block))
    out = memoryview(bytearray(blocks * per_block))
    start = time.perf_counter()
    for _ in range(args.rounds):
        out[:] = data
    copy_seconds = time.perf_counter() - start
    raw = _gbps(moved, raw_seconds)
    s_raw = _gbps(s_moved, s_raw_seconds)
    return {"gbps": _gbps(moved, seconds), "grpc_stream_gbps": raw, "memcpy_gbps": _gbps(moved, copy_seconds),
            "ratio": round(_gbps(moved, seconds) / raw, 3) if raw else 0.0,
            "stream_gbps": _gbps(s_moved, s_seconds), "stream_grpc_stream_gbps": s_raw,
            "stream_ratio": round(_gbps(s_moved, s_seconds) / s_raw, 3) if s_raw else 0.0,
            "bytes_moved": moved, "batch_bytes": blocks * per_block, "blocks_per_batch": blocks,
            "bytes_per_block": per_block, "rounds": args.rounds, "chunk_bytes": args.chunk_kib << 10,
            "seconds": round(seconds, 3), "stream_seconds": round(s_seconds, 3)}


def _rounds(args: argparse.Namespace, shared_memory_dir: str) -> tuple[int, float, float, int, int, int]:
    """A stack whose workers have ``--shared-memory-dir shared_memory_dir``: (bytes moved,
    seconds of the fetches, seconds of the raw streams, blocks a batch, bytes a block,
    fetches staged)."""
    from kvservice.client import Client
    from kvservice.tools.launcher import Stack
    from kvservice.v1 import worker_pb2 as wpb, worker_pb2_grpc as wpb_grpc

    with Stack(2, model=MODEL, block_size=16, num_blocks=args.num_blocks,
               worker_args=("--shared-memory-dir", shared_memory_dir)) as stack, \
            Client(stack.target, credentials=stack.credentials("engine")) as client:
        client.collect_tier_orders = True       # (the migration's fetch orders: this tool runs them)
        pools = {p.pool_id: p for p in client.pools()}
        src_pool, dst_pool = pools["worker-0"], pools["worker-1"]
        channels = {name: stack.credentials("engine").channel(p.worker_address) for name, p in pools.items()}
        stubs = {name: wpb_grpc.WorkerStub(ch) for name, ch in channels.items()}
        info = stubs["worker-0"].Describe(wpb.DescribeWorkerRequest())
        per_block = info.bytes_per_block
        blocks = max(1, (args.batch_mib << 20) // per_block)
        if blocks > args.num_blocks - 1:
            raise ValueError(f"--batch-mib {args.batch_mib} needs {blocks} blocks of {per_block} bytes; "
                             f"the pools hold {args.num_blocks} (raise --num-blocks)")
        tokens = blocks * 16
        src = client.create(list(range(1, tokens + 1)), pool="worker-0")
        rng = random.Random(0)
        g = info.geometry
        slots = [b * 16 + i for b in src.block_table for i in range(16)]
        shape = [len(slots), g.num_kv_heads, g.head_dim]

        def randn() -> Any:              # (float32 K/V, as the SmolLM2 worker's pool holds)
            data = array.array("f", (rng.gauss(0.0, 1.0) for _ in range(math.prod(shape)))).tobytes()
            return wpb.Tensor(dtype="float32", shape=shape, data=data)

        # (the allocator's grants of the sequence's blocks go with the first call to its worker)
        grants = client.take_grants("worker-0", src_pool.epoch)
        for layer in (0, g.num_layers - 1):          # (random K/V in two layers: what the check compares)
            stubs["worker-0"].WriteKV(wpb.WriteKVRequest(
                epoch=src_pool.epoch, layer=layer, slot_mapping=slots, key=randn(), value=randn(),
                lease_id=client.lease_id, generation=client.generation("worker-0"), grants=grants))
                                                 # (so with its pool's, the sequence goes to worker-1: the
        src_table = list(src.block_table)        # allocator's fetch orders of its blocks, run every round)
        dst = client.migrate(src, "worker-1")
        orders = [o for o in client.take_tier_orders() if o.source_pool_id == "worker-0"]
        request = wpb.FetchBlocksRequest(
            epoch=dst_pool.epoch, lease_id=client.lease_id, generation=client.generation("worker-1"),
            source_pool_id="worker-0", source_epoch=src_pool.epoch, chunk_bytes=args.chunk_kib << 10,
            fetches=[wpb.BlockFetch(src_tier=o.src_tier, src=o.src, dst=o.dst, block_hash=o.block_hash,
                                    order_mac=o.order_mac, pull_serial=o.serial) for o in orders],
            grants=client.take_grants("worker-1", dst_pool.epoch))
        stubs["worker-1"].FetchBlocks(request, timeout=120)         # (a warm-up round: channels, allocations)
        progress(f"{args.rounds} rounds of {blocks} blocks ({blocks * per_block / 2**20:.1f} MiB), each a fetch "
                 f"then a raw stream of as many bytes")
        batch = blocks * per_block
        seconds = raw_seconds = 0.0
        with RawStream(stack, args.chunk_kib << 10) as raw:
            raw.pull(batch)                                          # (its warm-up)
            for _ in range(args.rounds):     # (alternated: a slower moment of the machine slows both)
                start = time.perf_counter()
                reply = stubs["worker-1"].FetchBlocks(request, timeout=120)
                seconds += time.perf_counter() - start
                failed = [r.error for r in reply.results if not r.ok]
                if failed:
                    raise RuntimeError(f"{len(failed)} blocks not moved: {failed[0]}")
                raw_seconds += raw.pull(batch)
        moved = args.rounds * batch
        slots = [b * 16 + i for b in src_table for i in range(16)]
        dst_slots = [b * 16 + i for b in dst.block_table for i in range(16)]
        for layer in (0, g.num_layers - 1):
            a = stubs["worker-0"].ReadKV(wpb.ReadKVRequest(epoch=src_pool.epoch, layer=layer, slots=slots,
                                                           lease_id=client.lease_id))
            b = stubs["worker-1"].ReadKV(wpb.ReadKVRequest(epoch=dst_pool.epoch, layer=layer, slots=dst_slots,
                                                           lease_id=client.lease_id))
            if a.key.data != b.key.data or a.value.data != b.value.data:
                raise RuntimeError(f"layer {layer}: the fetched blocks differ from the source's")
        for ch in channels.values():
            ch.close()
        src.free()
        dst.free()
        staged = _staged_fetches(stack.workers[1].metrics_url)
    return moved, seconds, raw_seconds, blocks, per_block, staged


def _staged_fetches(metrics_url: str) -> int:
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvservice_worker_transfer_staged_fetches_total{")))


class RawStream:
    """A plain gRPC stream server in another process (the stack's server certificate,
    messages of ``chunk`` bytes) and a client of it in this one (worker-1's certificate,
    an asyncio channel as a worker's), on a loop of its own thread."""

    def __init__(self, stack: Any, chunk: int) -> None:
        self.stack, self.chunk = stack, chunk

    def __enter__(self) -> "RawStream":
        import threading

        self._tmp = tempfile.TemporaryDirectory(prefix="kvs-bench-transfer-")
        port_file = Path(self._tmp.name, "port")
        self.server = subprocess.Popen([sys.executable, "-c", "from kvservice.tools.bench_transfer import serve_raw; "
                                        f"serve_raw({str(port_file)!r}, {self.stack.credentials_dir!r}, {self.chunk})"])
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if self.server.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("the raw stream server did not start")
            time.sleep(0.05)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.channel = self._run(self._open(f"localhost:{int(port_file.read_text())}"))
        return self

    async def _open(self, target: str) -> Any:
        return self.stack.credentials("worker-1").aio_channel(target, options=[
            ("grpc.max_receive_message_length", MAX_BLOCK_STREAM_MESSAGE),
            ("grpc.max_send_message_length", MAX_BLOCK_STREAM_MESSAGE)])

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    def pull(self, nbytes: int) -> float:
        """Seconds to stream ``nbytes``."""
        async def pull() -> float:
            start = time.perf_counter()
            got = 0
            async for message in self.channel.unary_stream(RAW_SERVICE)(str(nbytes).encode()):
                got += len(message)
            if got != nbytes:
                raise RuntimeError(f"the raw stream brought {got} bytes of {nbytes}")
            return time.perf_counter() - start
        return self._run(pull())

    def __exit__(self, *exc: Any) -> None:
        if getattr(self, "channel", None) is not None:
            self._run(self.channel.close())
        if getattr(self, "loop", None) is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        self.server.terminate()
        self.server.wait(timeout=10)
        self._tmp.cleanup()


def serve_raw(port_file: str, credentials_dir: str, chunk: int) -> None:
    """The raw stream server (run in its own process): answers a request of N bytes with
    N bytes in messages of ``chunk`` bytes, over mTLS with the stack's certificates."""
    import grpc

    from kvservice.common.security import ServerTls

    payload = os.urandom(chunk)

    async def pull(request: bytes, context: Any):
        left = int(request)
        while left > 0:
            n = min(chunk, left)
            yield payload[:n]
            left -= n

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_BLOCK_STREAM_MESSAGE),
                                          ("grpc.max_send_message_length", MAX_BLOCK_STREAM_MESSAGE)])
        service, method = RAW_SERVICE.strip("/").split("/")
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            service, {method: grpc.unary_stream_rpc_method_handler(pull)})])
        tls = ServerTls(f"{credentials_dir}/server.pem", f"{credentials_dir}/server-key.pem",
                        f"{credentials_dir}/ca.pem")
        port = server.add_secure_port("localhost:0", tls.credentials())
        await server.start()
        Path(port_file).write_text(str(port))
        await server.wait_for_termination()

    asyncio.run(main())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-mib", type=int, default=32,
                   help="MiB of blocks per fetch (default 32; at least 16 for the reference figures)")
    p.add_argument("--rounds", type=int, default=64,
                   help="rounds timed, each a fetch and a raw stream of as many bytes (default 64)")
    p.add_argument("--chunk-kib", type=int, default=4096,
                   help="KiB per stream message (default 4096; 64 to 16384)")
    p.add_argument("--num-blocks", type=int, default=96,
                   help="device blocks per worker (default 96; a batch must fit)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def report(fig: dict[str, Any]) -> str:
    return (f"{fig['rounds']} fetches of {fig['blocks_per_batch']} blocks ({fig['batch_bytes'] / 2**20:.1f} MiB, "
            f"{fig['bytes_per_block']} bytes a block), messages of {fig['chunk_bytes'] >> 10} KiB\n"
            f"blocks moved        {fig['gbps']:8.2f} Gb/s ({fig['ratio']:.2f}x the raw stream; through shared memory)\n"
            f"raw gRPC stream     {fig['grpc_stream_gbps']:8.2f} Gb/s\n"
            f"in the stream       {fig['stream_gbps']:8.2f} Gb/s ({fig['stream_ratio']:.2f}x the raw stream of that "
            f"run, {fig['stream_grpc_stream_gbps']:.2f} Gb/s; --shared-memory-dir '')\n"
            f"memory copy         {fig['memcpy_gbps']:8.2f} Gb/s")


def main(args: argparse.Namespace) -> int:
    if min(args.batch_mib, args.rounds, args.num_blocks) < 1 or not 64 <= args.chunk_kib <= 16384:
        print("kvservice bench-transfer: --batch-mib, --rounds and --num-blocks must be positive, --chunk-kib "
              "64 to 16384", file=sys.stderr)
        return 2
    try:
        fig = measure(args)
    except (ValueError, RuntimeError) as exc:
        print(f"kvservice bench-transfer: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(fig, indent=2) if args.json else report(fig))
    return 0
