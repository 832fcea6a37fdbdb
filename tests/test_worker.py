"""The worker over real gRPC: write then attend, copy-on-write, bad requests, sizing."""

from __future__ import annotations

import math
import random
from typing import Any, Callable

import grpc
import pytest
import torch

from kvservice.v1 import worker_pb2 as pb
from kvservice.v1 import worker_pb2_grpc as pb_grpc
from worker import tensors
from worker.config import WorkerSettings, parse_memory
from worker.pool import PoolShape
from worker.server import build_pool
from worker.transfer import block_checksum

from worker_helpers import WorkerThread, reference

BS, LAYERS, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 8, 2, 2, 64, 32
SHAPE = PoolShape(NUM_BLOCKS, BS, LAYERS, KV_HEADS, HEAD_DIM, torch.float32)
IA, FP = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture(scope="module")
def worker():
    with WorkerThread(SHAPE) as w:
        yield w


@pytest.fixture(scope="module")
def stub(worker):
    with grpc.insecure_channel(worker.target) as channel:
        yield pb_grpc.WorkerStub(channel)


def slots_of(table: list[int], start: int, end: int) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in range(start, end)]


def test_describe_reports_geometry_backend_and_sizes(stub):
    info = stub.Describe(pb.DescribeWorkerRequest())
    assert (info.pool_id, info.epoch, info.backend, info.device) == ("w0", 1, "torch", "cpu")
    g = info.geometry
    assert (g.num_blocks, g.block_size, g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) == \
        (NUM_BLOCKS, BS, LAYERS, KV_HEADS, HEAD_DIM, "float32")
    assert info.bytes_per_block == 2 * LAYERS * BS * KV_HEADS * HEAD_DIM * 4
    assert info.pool_bytes == NUM_BLOCKS * info.bytes_per_block


@pytest.mark.parametrize("group", [1, 4])
def test_write_then_attend_equals_the_reference(stub, group):
    rng = random.Random(group)
    lengths = [5, 17, 30]              # within one block, across blocks, several blocks
    blocks = list(range(NUM_BLOCKS))
    rng.shuffle(blocks)
    tables, kv = [], []
    for n in lengths:
        nb = math.ceil(n / BS)
        tables.append([blocks.pop() for _ in range(nb)])
        kv.append((torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)))
    layer = 1

    def other_layer():
        return stub.ReadKV(pb.ReadKVRequest(epoch=1, layer=0, slots=slots_of(tables[0], 0, 5))).key.data

    untouched = other_layer()
    for table, (k, v) in zip(tables, kv):
        reply = stub.WriteKV(pb.WriteKVRequest(epoch=1, layer=layer, slot_mapping=slots_of(table, 0, len(k)) + [-1],
                                               key=tensors.encode(torch.cat([k, k[:1]])),
                                               value=tensors.encode(torch.cat([v, v[:1]]))))
        assert reply.num_written == len(k)
    heads = KV_HEADS * group
    scale = HEAD_DIM ** -0.5
    for query_lens in ([1, 1, 1], [5, 3, 12]):      # decode, then prefill (causal)
        qs = [torch.randn(q, heads, HEAD_DIM) for q in query_lens]
        out = stub.Attention(pb.AttentionRequest(
            epoch=1, layer=layer, query=tensors.encode(torch.cat(qs)), context_lens=lengths, query_lens=query_lens,
            block_tables=[pb.BlockTable(block_ids=t + [999]) for t in tables]))   # past the end: never read
        got = tensors.decode(out.output, "output", torch.float32, torch.device("cpu"))
        expected = torch.cat([reference(q, k, v, scale) for q, (k, v) in zip(qs, kv)])
        assert got.shape == expected.shape
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # The other layer was not written (whatever the module's other tests left there).
    assert other_layer() == untouched


def test_cow_copy_then_divergent_writes_leave_the_source_untouched(stub):
    src, dst = 3, 9
    table = [src]
    k = torch.randn(BS, KV_HEADS, HEAD_DIM)
    v = torch.randn(BS, KV_HEADS, HEAD_DIM)
    for layer in range(LAYERS):
        stub.WriteKV(pb.WriteKVRequest(epoch=1, layer=layer, slot_mapping=slots_of(table, 0, BS),
                                       key=tensors.encode(k + layer), value=tensors.encode(v - layer)))
    assert stub.CopyBlocks(pb.CopyBlocksRequest(epoch=1, pairs=[pb.BlockCopy(src=src, dst=dst)])).num_copied == 1
    # The child writes its own token at offset 5 of the copy.
    new_k, new_v = torch.full((1, KV_HEADS, HEAD_DIM), 7.0), torch.full((1, KV_HEADS, HEAD_DIM), -7.0)
    stub.WriteKV(pb.WriteKVRequest(epoch=1, layer=1, slot_mapping=[dst * BS + 5], key=tensors.encode(new_k),
                                   value=tensors.encode(new_v)))

    def read(layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = stub.ReadKV(pb.ReadKVRequest(epoch=1, layer=layer, slots=slots_of([block], 0, BS)))
        cpu = torch.device("cpu")
        return tensors.decode(r.key, "key", torch.float32, cpu), tensors.decode(r.value, "value", torch.float32, cpu)

    for layer in range(LAYERS):
        sk, sv = read(layer, src)
        assert torch.equal(sk, k + layer) and torch.equal(sv, v - layer)      # the source is untouched
        dk, dv = read(layer, dst)
        keep = [i for i in range(BS) if not (layer == 1 and i == 5)]
        assert torch.equal(dk[keep], (k + layer)[keep]) and torch.equal(dv[keep], (v - layer)[keep])
    dk, dv = read(1, dst)
    assert torch.equal(dk[5], new_k[0]) and torch.equal(dv[5], new_v[0])


# ------------------------------------------------------------------ bad requests


def t(shape: tuple[int, ...], dtype: str = "float32", data: bytes | None = None) -> pb.Tensor:
    size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 1)
    return pb.Tensor(dtype=dtype, shape=list(shape), data=bytes(math.prod(shape) * size) if data is None else data)


KV1 = (1, KV_HEADS, HEAD_DIM)


def write(epoch: int = 1, layer: int = 0, slots=(0,), key: pb.Tensor | None = None, value: pb.Tensor | None = None):
    return ("WriteKV", pb.WriteKVRequest(epoch=epoch, layer=layer, slot_mapping=list(slots),
                                         key=key or t((len(slots), KV_HEADS, HEAD_DIM)),
                                         value=value or t((len(slots), KV_HEADS, HEAD_DIM))))


def attend(epoch: int = 1, layer: int = 0, query: pb.Tensor | None = None, tables=((0, 1),), ctx=(9,), qlens=(1,),
           scale: float = 0.0, splits: int = 0):
    return ("Attention", pb.AttentionRequest(
        epoch=epoch, layer=layer, query=query or t((sum(qlens), KV_HEADS, HEAD_DIM)),
        block_tables=[pb.BlockTable(block_ids=list(b)) for b in tables], context_lens=list(ctx),
        query_lens=list(qlens), scale=scale, num_splits=splits))


def copy(*pairs: tuple[int, int], epoch: int = 1):
    return ("CopyBlocks", pb.CopyBlocksRequest(epoch=epoch, pairs=[pb.BlockCopy(src=a, dst=b) for a, b in pairs]))


def move(*moves: tuple[int, int, int, int], epoch: int = 1, block_hash: bytes = b"h" * 16, n: int = 1):
    return ("MoveBlocks", pb.MoveBlocksRequest(epoch=epoch, moves=[
        pb.BlockMove(src_tier=a, src=b, dst_tier=c, dst=d, block_hash=block_hash) for a, b, c, d in moves] * n))


def fetch(*fetches: tuple[int, int, int], epoch: int = 1, source: str = "w1", block_hash: bytes = b"", n: int = 1,
          chunk: int = 0):
    return ("FetchBlocks", pb.FetchBlocksRequest(epoch=epoch, source_pool_id=source, source_epoch=1, chunk_bytes=chunk,
                                                 fetches=[pb.BlockFetch(src_tier=a, src=b, dst=c, block_hash=block_hash)
                                                          for a, b, c in fetches] * n))


def pull(*blocks: int, pool: str = "w0", epoch: int = 1, n: int = 1, chunk: int = 0, staging: str = ""):
    return ("PullBlocks", pb.PullBlocksRequest(pool_id=pool, epoch=epoch, chunk_bytes=chunk, staging=staging,
                                               blocks=[pb.BlockRef(index=b) for b in blocks] * n))


def write_blocks(*ids: int, epoch: int = 1, n: int = 1, piece: pb.BlockPiece | None = None, later=()):
    """A WriteBlocks stream: its first message (with ``piece``), then ``later`` ones."""
    first = pb.WriteBlocksRequest(epoch=epoch, block_ids=list(ids) * n)
    if piece is not None:
        first.chunk.pieces.append(piece)
    return ("WriteBlocks", iter([first, *later]))


def read_blocks(*ids: int, epoch: int = 1, n: int = 1, chunk: int = 0):
    return ("ReadBlocks", pb.ReadBlocksRequest(epoch=epoch, block_ids=list(ids) * n, chunk_bytes=chunk))


def read(slots=(0,), layer: int = 0, epoch: int = 1):
    return ("ReadKV", pb.ReadKVRequest(epoch=epoch, layer=layer, slots=list(slots)))


LAST = NUM_BLOCKS * BS - 1
BAD: list[tuple[str, Callable[[], tuple[str, Any]], grpc.StatusCode, str]] = [
    # (name, request, code, message fragment)
    ("write-stale-epoch", lambda: write(epoch=2), FP, "request for epoch 2, but pool w0 is at epoch 1"),
    ("write-epoch-0", lambda: write(epoch=0), FP, "request for epoch 0"),
    ("write-layer-negative", lambda: write(layer=-1), IA, "layer -1 is out of range 0..1"),
    ("write-layer-too-big", lambda: write(layer=2), IA, "layer 2 is out of range 0..1"),
    ("write-slot-out-of-range", lambda: write(slots=(0, LAST + 1)), IA,
     f"slot_mapping[1] = {LAST + 1} is out of range 0..{LAST}"),
    ("write-slot-twice", lambda: write(slots=(4, 4)), IA, "slot_mapping[1] = 4 appears twice"),
    ("write-key-dtype", lambda: write(key=t(KV1, "float16")), IA, "key: dtype float16, the pool holds float32"),
    ("write-unknown-dtype", lambda: write(value=t(KV1, "int8")), IA, "value: unknown dtype 'int8'"),
    ("write-key-shape", lambda: write(key=t((1, KV_HEADS, 32))), IA, "key: shape [1, 2, 32], expected [1, 2, 64]"),
    ("write-count-mismatch", lambda: write(slots=(0, 1), key=t(KV1)), IA, "key: shape [1, 2, 64], expected [2, 2, 64]"),
    ("write-data-length", lambda: write(key=t(KV1, data=b"\0" * 12)), IA,
     "key: 12 bytes of data, shape [1, 2, 64] of float32 takes 512"),
    ("write-negative-dim", lambda: write(value=t((-1, KV_HEADS, HEAD_DIM), data=b"")), IA,
     "value: negative dimension in shape [-1, 2, 64]"),
    ("read-stale-epoch", lambda: read(epoch=5), FP, "request for epoch 5"),
    ("read-slot-out-of-range", lambda: read(slots=(LAST + 1,)), IA, f"slots[0] = {LAST + 1} is out of range"),
    ("read-negative-slot", lambda: read(slots=(3, -1)), IA, "slots[1] = -1 is out of range"),
    ("read-bad-layer", lambda: read(layer=7), IA, "layer 7 is out of range 0..1"),
    ("attend-stale-epoch", lambda: attend(epoch=3), FP, "request for epoch 3"),
    ("attend-no-sequence", lambda: attend(tables=(), ctx=(), qlens=(), query=t((0, KV_HEADS, HEAD_DIM))), IA,
     "attention needs at least one sequence"),
    ("attend-list-lengths", lambda: attend(ctx=(9, 4)), IA, "1 block tables, 2 context_lens and 1 query_lens"),
    ("attend-zero-queries", lambda: attend(qlens=(0,), query=t((0, KV_HEADS, HEAD_DIM))), IA,
     "query_lens[0] = 0: each sequence needs at least one query"),
    ("attend-context-below-queries", lambda: attend(ctx=(2,), qlens=(3,)), IA,
     "context_lens[0] = 2 is below its query_lens 3"),
    ("attend-context-beyond-table", lambda: attend(ctx=(17,)), IA,
     "context_lens[0] = 17 is beyond its block table of 2 blocks (16 slots)"),
    ("attend-block-out-of-range", lambda: attend(tables=((0, NUM_BLOCKS),)), IA,
     f"block_tables[0][1] = {NUM_BLOCKS} is out of range 0..{NUM_BLOCKS - 1}"),
    ("attend-negative-block", lambda: attend(tables=((-1, 2),)), IA, "block_tables[0][0] = -1 is out of range"),
    ("attend-query-rows", lambda: attend(query=t((2, KV_HEADS, HEAD_DIM))), IA,
     "query: shape [2, 2, 64], expected [1, num_heads, 64]"),
    ("attend-query-head-dim", lambda: attend(query=t((1, KV_HEADS, 128))), IA, "query: shape [1, 2, 128]"),
    ("attend-query-heads", lambda: attend(query=t((1, 3, HEAD_DIM))), IA,
     "query: 3 heads is not a multiple of the pool's 2 KV heads"),
    ("attend-query-dtype", lambda: attend(query=t((1, KV_HEADS, HEAD_DIM), "bfloat16")), IA,
     "query: dtype bfloat16, the pool holds float32"),
    ("attend-negative-scale", lambda: attend(scale=-1.0), IA, "scale must be finite and >= 0"),
    ("attend-nan-scale", lambda: attend(scale=float("nan")), IA, "scale must be finite and >= 0"),
    ("attend-negative-splits", lambda: attend(splits=-1), IA, "num_splits must be in 0..1024"),
    ("attend-too-many-splits", lambda: attend(splits=5000), IA, "got 5000"),
    ("copy-stale-epoch", lambda: copy((0, 1), epoch=9), FP, "request for epoch 9"),
    ("copy-src-out-of-range", lambda: copy((NUM_BLOCKS, 1)), IA, f"pairs[0].src = {NUM_BLOCKS} is out of range"),
    ("copy-dst-out-of-range", lambda: copy((0, 1), (2, -3)), IA, "pairs[1].dst = -3 is out of range"),
    ("copy-dst-twice", lambda: copy((0, 5), (1, 5)), IA, "pairs[1].dst = 5 is the destination of two copies"),
    ("copy-dst-is-a-source", lambda: copy((0, 5), (5, 6)), IA, "pairs[0].dst = 5 is also a source in this call"),
    ("copy-onto-itself", lambda: copy((4, 4)), IA, "pairs[0].dst = 4 is also a source"),
    ("move-stale-epoch", lambda: move((1, 0, 0, 1), epoch=4), FP, "request for epoch 4"),
    ("move-tier-3", lambda: move((0, 1, 3, 0)), IA, "moves[0]: tiers are 0 (device), 1 (host), 2 (disk); got 0 -> 3"),
    ("move-negative-tier", lambda: move((1, 0, 0, 1), (-1, 0, 0, 2)), IA, "moves[1]: tiers are"),
    ("move-hash-too-long", lambda: move((1, 0, 0, 1), block_hash=b"h" * 17), IA,
     "moves[0].block_hash has 17 bytes, at most 16"),
    ("move-too-many", lambda: move((1, 0, 0, 1), n=65_537), IA, "at most 65536 moves per call, got 65537"),
    ("move-no-tier", lambda: move((1, 0, 0, 1)), FP, "this worker has no lower tier (start it with --host-tier-gb)"),
    ("fetch-stale-epoch", lambda: fetch((0, 0, 1), epoch=4), FP, "request for epoch 4"),
    ("fetch-no-source", lambda: fetch((0, 0, 1), source=""), IA, "source_pool_id is empty"),
    ("fetch-own-pool", lambda: fetch((0, 0, 1), source="w0"), IA, "pool w0 is this worker's own"),
    ("fetch-tier-3", lambda: fetch((0, 0, 1), (3, 0, 2)), IA, "fetches[1].src_tier: 0 (device), 1 (host), 2 (disk)"),
    ("fetch-hash-too-long", lambda: fetch((1, 0, 1), block_hash=b"h" * 17), IA,
     "fetches[0].block_hash has 17 bytes, at most 16"),
    ("fetch-dst-out-of-range", lambda: fetch((0, 0, NUM_BLOCKS)), IA,
     f"fetches[0].dst: block {NUM_BLOCKS} is out of range 0..{NUM_BLOCKS - 1}"),
    ("fetch-chunk-too-small", lambda: fetch((0, 0, 1), chunk=1000), IA, "chunk_bytes: 65536 to 16777216"),
    ("fetch-too-many", lambda: fetch((0, 0, 1), n=65_537), IA, "at most 65536 fetches per call, got 65537"),
    ("fetch-no-allocator", lambda: fetch((0, 0, 1)), FP, "this worker fetches from no other worker"),
    ("pull-another-pool", lambda: pull(0, pool="w1"), grpc.StatusCode.NOT_FOUND, "this worker serves pool w0, not 'w1'"),
    ("pull-stale-epoch", lambda: pull(0, epoch=2), FP, "request for epoch 2"),
    ("pull-chunk-too-big", lambda: pull(0, chunk=1 << 30), IA, "chunk_bytes: 65536 to 16777216"),
    ("pull-too-many", lambda: pull(0, n=65_537), IA, "at most 65536 blocks per call, got 65537"),
    ("pull-staging-a-path", lambda: pull(0, staging="../etc/passwd"), IA, "staging: 'kvs-staging-', a process id"),
    ("pull-staging-short", lambda: pull(0, staging="kvs-staging-1-" + "0" * 31), IA, "staging: 'kvs-staging-'"),
    ("pull-staging-not-hex", lambda: pull(0, staging="kvs-staging-1-" + "g" * 32), IA, "staging: 'kvs-staging-'"),
    ("write-blocks-stale-epoch", lambda: write_blocks(0, epoch=3), FP, "request for epoch 3"),
    ("write-blocks-empty-stream", lambda: ("WriteBlocks", iter([])), IA, "WriteBlocks: an empty stream"),
    ("write-blocks-out-of-range", lambda: write_blocks(0, NUM_BLOCKS), IA,
     f"block_ids[1] = {NUM_BLOCKS} is out of range 0..{NUM_BLOCKS - 1}"),
    ("write-blocks-twice", lambda: write_blocks(4, 4), IA, "block_ids[1] = 4 appears twice"),
    ("write-blocks-too-many", lambda: write_blocks(0, n=65_537), IA, "at most 65536 block_ids per call, got 65537"),
    ("write-blocks-later-header", lambda: write_blocks(0, later=[pb.WriteBlocksRequest(epoch=1)]), IA,
     "WriteBlocks message 1 sets epoch: only the first message names"),
    ("write-blocks-piece-error", lambda: write_blocks(0, piece=pb.BlockPiece(last=True, error="gone")), IA,
     "block_ids[0]: a piece carries an error ('gone')"),
    ("write-blocks-piece-past-the-end", lambda: write_blocks(0, piece=pb.BlockPiece(position=1, data=b"x")), IA,
     "a piece of position 1: block_ids has 1"),
    ("write-blocks-no-bytes", lambda: write_blocks(5), IA, "block_ids[0] = 5: the stream ended before this block"),
    ("read-blocks-stale-epoch", lambda: read_blocks(0, epoch=2), FP, "request for epoch 2"),
    ("read-blocks-out-of-range", lambda: read_blocks(1, -1), IA, "block_ids[1] = -1 is out of range"),
    ("read-blocks-chunk-too-small", lambda: read_blocks(0, chunk=4096), IA, "chunk_bytes: 65536 to 16777216"),
    ("read-blocks-too-many", lambda: read_blocks(0, n=65_537), IA, "at most 65536 block_ids per call, got 65537"),
]


@pytest.mark.parametrize("name,build,code,message", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_status_and_leaves_the_pool_unchanged(worker, stub, name, build, code, message):
    # Fill the pool with recognisable values so that any write would show.
    worker.pool.k_caches.copy_(torch.arange(worker.pool.k_caches.numel(), dtype=torch.float32).view_as(worker.pool.k_caches))
    worker.pool.v_caches.copy_(-worker.pool.k_caches)
    before = (worker.pool.k_caches.clone(), worker.pool.v_caches.clone())
    rpc, request = build()
    with pytest.raises(grpc.RpcError) as info:
        reply = getattr(stub, rpc)(request, timeout=10)
        if rpc in ("PullBlocks", "ReadBlocks"):
            list(reply)                  # (a stream's status comes with its end)
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()
    assert torch.equal(worker.pool.k_caches, before[0]) and torch.equal(worker.pool.v_caches, before[1])


def test_a_pull_streams_device_blocks_as_they_are_and_fails_only_a_block_out_of_range(worker, stub):
    worker.pool.k_caches.copy_(torch.randn_like(worker.pool.k_caches))
    worker.pool.v_caches.copy_(torch.randn_like(worker.pool.v_caches))
    _, request = pull(3, NUM_BLOCKS, 5)
    pieces = [p for c in stub.PullBlocks(request, timeout=10) for p in c.pieces]
    assert [(p.position, p.last) for p in pieces] == [(0, True), (1, True), (2, True)]
    assert "block 32 is out of range" in pieces[1].error and not pieces[1].data
    for p, block in ((pieces[0], 3), (pieces[2], 5)):
        kv = torch.stack([worker.pool.k_caches[:, block], worker.pool.v_caches[:, block]])
        assert p.data == kv.contiguous().numpy().tobytes() and p.checksum == block_checksum(p.data)


def test_every_worker_rpc_with_input_has_bad_requests():
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Worker"].methods}
    covered = {build()[0] for _, build, _, _ in BAD}
    # Forward's bad requests are in test_model_runner.py (they need a worker with a model).
    assert covered | {"Describe", "Forward"} == methods, methods - covered


# ------------------------------------------------------------------ sizing


@pytest.mark.parametrize("text,expected", [("2GiB", (2 << 30, 0.0)), ("512MB", (512 * 10**6, 0.0)),
                                           ("1048576", (1 << 20, 0.0)), ("0.9", (0, 0.9)), ("1", (0, 1.0)),
                                           ("1.5 KiB", (1536, 0.0))])
def test_memory_budgets_parse(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "0", "2 parsecs", "0.0"])
def test_bad_memory_budgets_are_refused(text):
    with pytest.raises(ValueError, match="kv_memory"):
        parse_memory(text)


def test_pool_is_sized_from_the_memory_budget_and_logged(caplog):
    caplog.set_level("INFO", logger="worker.server")
    settings = WorkerSettings(kv_memory="1MiB", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64,
                              dtype="float32", device="cpu")
    pool = build_pool(settings)
    per_block = 2 * 2 * 16 * 2 * 64 * 4
    assert pool.shape.bytes_per_block == per_block == 32768
    assert pool.shape.num_blocks == (1 << 20) // per_block == 32
    assert tuple(pool.k_caches.shape) == (2, 32, 2, 16, 64) and pool.k_caches.dtype == torch.float32
    assert "KV blocks: 32 (512 tokens)" in caplog.text
    odd = build_pool(WorkerSettings(kv_memory="100000", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64,
                                    dtype="float16", device="cpu"))
    assert odd.shape.num_blocks == 100000 // (per_block // 2) == 6


def test_a_budget_below_one_block_is_refused():
    with pytest.raises(ValueError, match="holds no block"):
        build_pool(WorkerSettings(kv_memory="1KiB", device="cpu", dtype="float32"))
