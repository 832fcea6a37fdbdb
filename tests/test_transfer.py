"""Blocks between workers (DESIGN §13, worker/transfer.py): the pieces of a PullBlocks
stream and their reassembly, then two real worker processes in a secure stack: a
worker fills its blocks with another's (device blocks and host-tier entries) over
PullBlocks, byte for byte; a block that fails a check is reported and left unwritten;
a stale epoch, a dead source, an engine pulling directly are refused."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
import torch
from helpers import sync_redis, wait_for

from kvservice import errors
from kvservice.allocator import keys
from kvservice.client import Client
from kvservice.common.grants import move_fields, order_mac, pull_fields
from kvservice.tools.launcher import Stack
from kvservice.v1 import worker_pb2 as pb
from kvservice.v1 import worker_pb2_grpc as pb_grpc
from worker import tensors
from worker.tiers import LoadFailed
from worker.transfer import (STAGING_HEADER, STAGING_PREFIX, Assembler, Piece, Staging, block_checksum, decode, device_messages, encode,
                             from_message, open_staging, pieces, put_blocks, staged_messages, verify)

pytestmark = pytest.mark.e2e

BS = 16
#: 4 layers x 4 KV heads x 64 dims x 16 slots x float32, K and V: 131,072 bytes a block,
#: three pieces of a 64 KiB stream.
GEOMETRY = ("--num-layers", "4", "--num-kv-heads", "4", "--head-dim", "64", "--dtype", "float32")
CHUNK = 64 << 10


# ------------------------------------------------------------------ pieces

def _blocks(n: int, size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _read_from(data: list[torch.Tensor], bad: set[int] = frozenset()):
    def read(tier: int, index: int, tag: bytes) -> torch.Tensor:
        if index in bad:
            raise LoadFailed(f"host entry {index}: checksum mismatch")
        return data[index]
    return read


def _assemble(chunks: list[list[Piece]], n: int, size: int) -> list[tuple[int, bytes | None, str]]:
    """What a destination makes of a stream's messages: per block, its bytes or its error."""
    got = Assembler(n, size)
    out = [x for c in chunks for x in got.feed(c)] + got.missing("the stream ended before this block")
    checked = [(p, d, e or verify(d, digest)) for p, d, e, digest in out]
    return [(p, None if e else bytes(d), e) for p, d, e in checked]


def _wire(chunks: list[list[Piece]]) -> list[list[Piece]]:
    """The messages as a destination reads them: encoded, then decoded in place."""
    return [decode(encode(c)) for c in chunks]


def test_blocks_larger_than_a_message_travel_in_pieces_and_come_back_whole():
    data = _blocks(5, 150_000)
    chunks = list(pieces([(1, i, b"") for i in range(5)], _read_from(data), CHUNK))
    assert all(sum(len(p.data) for p in c) <= CHUNK for c in chunks)
    assert len(chunks) == 12                               # (750,000 bytes in 64 KiB messages)
    out = _assemble(_wire(chunks), 5, 150_000)
    assert [(p, e) for p, _, e in out] == [(i, "") for i in range(5)]
    assert [d for _, d, _ in out] == [bytes(x.numpy()) for x in data]
    small = list(pieces([(1, i, b"") for i in range(5)], _read_from(_blocks(5, 1000)), CHUNK))
    assert len(small) == 1 and len(small[0]) == 5      # (several blocks in one message)


def test_the_wire_format_is_block_chunk_s_both_ways():
    """``encode`` writes what protobuf parses as the BlockChunk built from the same pieces,
    and ``decode`` reads protobuf's own serialization (fields in any order, unknown ones
    skipped)."""
    chunk = [Piece(0, 0, b"abc", True, 7), Piece(1, last=True, error="no such entry"),
             Piece(300, 70_000, bytes(range(256)) * 3, False, 0), Piece(2, 0, b"", True, 2**64 - 1)]
    message = pb.BlockChunk(pieces=[pb.BlockPiece(position=p.position, offset=p.offset, data=bytes(p.data),
                                                  last=p.last, checksum=p.checksum, error=p.error) for p in chunk])
    assert pb.BlockChunk.FromString(encode(chunk)) == message
    assert [p._replace(data=bytes(p.data)) for p in decode(message.SerializeToString())] == \
        [p._replace(data=bytes(p.data)) for p in chunk]
    assert from_message(message)[2].offset == 70_000
    unknown = b"\x10\x05" + message.SerializeToString() + b"\x1a\x02hi"     # (fields 2 and 3 of BlockChunk)
    assert len(decode(unknown)) == 4
    for bad in (b"\x0a\x05ab", b"\x0a\x80"):
        with pytest.raises(ValueError):
            decode(bad)


def test_device_blocks_gathered_into_their_messages_are_block_chunks_protobuf_reads():
    """``device_messages``: whole device blocks written straight into their messages, with
    fields of fixed width; protobuf and ``decode`` read them as the pieces of those blocks
    (their bytes as ``block_bytes`` reads them, their checksums)."""
    from worker.pool import KVPool, PoolShape
    from worker.tiers import block_bytes

    shape = PoolShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=9, dtype=torch.float32)
    pool = KVPool(shape, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    pool.k_caches.copy_(torch.randn(pool.k_caches.shape, generator=g))
    pool.v_caches.copy_(torch.randn(pool.v_caches.shape, generator=g))
    asked = [7, 0, 3, 3, 8]
    bpb = shape.bytes_per_block
    messages = list(device_messages(pool, list(enumerate(asked)), 2 * bpb + 10))
    assert len(messages) == 3                                # (two whole blocks a message)
    parsed = [p for m in messages for p in pb.BlockChunk.FromString(m).pieces]
    assert [(p.position, p.offset, p.last, p.error) for p in parsed] == [(i, 0, True, "") for i in range(5)]
    for p, block in zip(parsed, asked):
        assert p.data == bytes(block_bytes(pool, block).numpy()) and p.checksum == block_checksum(p.data)
    out = _assemble([decode(m) for m in messages], 5, bpb)
    assert [(p, e) for p, _, e in out] == [(i, "") for i in range(5)]
    assert [d for _, d, _ in out] == [bytes(block_bytes(pool, b).numpy()) for b in asked]


def test_an_unreadable_block_a_flipped_byte_and_a_broken_stream_fail_only_their_blocks():
    data = _blocks(4, 100_000)
    chunks = [[p._replace(data=bytes(p.data)) for p in c]
              for c in pieces([(1, i, b"") for i in range(4)], _read_from(data, bad={1}), CHUNK)]
    out = _assemble(chunks, 4, 100_000)
    assert [e == "" for _, _, e in out] == [True, False, True, True]
    assert "checksum mismatch" in out[1][2] and out[1][1] is None
    # A byte flipped in transit: that block fails its checksum, the others arrive.
    c, k = next((c, k) for c in chunks for k, p in enumerate(c) if p.position == 2)
    c[k] = c[k]._replace(data=bytes([c[k].data[0] ^ 1]) + c[k].data[1:])
    out = _assemble(chunks, 4, 100_000)
    assert [e == "" for _, _, e in out] == [True, False, False, True] and "checksum" in out[2][2]
    # Pieces out of order: the stream is broken from there on; a stream cut short fails the rest.
    # (chunk 0 holds block 0's first 65,536 bytes, chunk 1 the rest of it and block 1's start)
    reordered = [chunks[0], chunks[1], chunks[3], chunks[2], *chunks[4:]]
    out = _assemble(reordered, 4, 100_000)
    assert out[0][2] == "" and all(e for _, _, e in out[1:]) and len(out) == 4
    assert "broke off" in out[1][2] or "broke off" in out[2][2]
    out = _assemble(chunks[:2], 4, 100_000)
    assert [p for p, _, e in out if e] == [1, 2, 3] and "ended" in out[-1][2]
    # Too many bytes for a block, or a wrong checksum sent: that block fails.
    lying = [Piece(0, data=b"x" * 10, last=True, checksum=block_checksum(b"y"))]
    assert "checksum" in _assemble([lying], 1, 10)[0][2]
    assert "bytes, a block has" in _assemble([lying], 1, 5)[0][2]


# ------------------------------------------------------------------ staging files

def _pool_of(seed: int, num_blocks: int = 9):
    from worker.pool import KVPool, PoolShape

    shape = PoolShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=num_blocks,
                      dtype=torch.float32)
    pool = KVPool(shape, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    pool.k_caches.copy_(torch.randn(pool.k_caches.shape, generator=g))
    pool.v_caches.copy_(torch.randn(pool.v_caches.shape, generator=g))
    return pool


def test_staged_blocks_go_through_the_destination_s_file_and_only_checksums_travel(tmp_path):
    """``staged_messages``: each block's bytes in the staging file at its position, the
    messages only staged pieces (and an unreadable block's error); the destination reads
    them from its mapping of the same file, and a byte changed there fails that block."""
    from worker.tiers import block_bytes

    pool = _pool_of(4)
    bpb = pool.shape.bytes_per_block
    staging = Staging(str(tmp_path))
    file = staging.take("w0:1", 5 * bpb)
    assert file is not None and file.size >= 5 * bpb and (tmp_path / file.name).is_file()
    assert oct((tmp_path / file.name).stat().st_mode & 0o777) == "0o600"
    token = file.new_token()
    source_view = open_staging(str(tmp_path), file.name, 5 * bpb, token)       # (the source's own mapping)
    asked = [(0, 7, b""), (0, 0, b""), (1, 4, b""), (0, 3, b""), (0, 99, b"")]
    entries = _blocks(5, bpb)

    def read(tier: int, index: int, tag: bytes) -> torch.Tensor:
        if tier == 0:
            raise ValueError(f"block {index} is out of range")
        return entries[index]

    messages = list(staged_messages(pool, asked, read, source_view, 2 * bpb))
    assert len(messages) == 3 and max(len(m) for m in messages) < 100       # (1 block, then 2 a message)
    parsed = [p for m in messages for p in pb.BlockChunk.FromString(m).pieces]
    assert [(p.position, p.staged, p.data, bool(p.error)) for p in parsed] == \
        [(0, True, b"", False), (1, True, b"", False), (2, True, b"", False), (3, True, b"", False), (4, False, b"", True)]
    got = Assembler(5, bpb, file.view)
    out = [x for m in messages for x in got.feed(decode(m))]
    assert got.staged and not got.inline
    checked = [(p, e or verify(d, digest)) for p, d, e, digest in out]
    assert [e for _, e in checked[:4]] == [""] * 4 and "out of range" in checked[4][1]
    expected = [bytes(block_bytes(pool, 7).numpy()), bytes(block_bytes(pool, 0).numpy()), bytes(entries[4].numpy()),
                bytes(block_bytes(pool, 3).numpy())]
    assert [bytes(d) for _, d, _, _ in out[:4]] == expected
    file.view[bpb + 5] ^= 1                                   # (block 1 changed after its checksum was taken)
    assert "checksum" in verify(out[1][1], out[1][3]) and verify(out[0][1], out[0][3]) == ""
    # The source's checksum is of its own bytes: block 0 changed in the file while it was
    # being staged fails, though the file's bytes and the piece agree on nothing else.
    target = _pool_of(5)
    with_token = file.new_token()
    assert open_staging(str(tmp_path), file.name, 5 * bpb, token) is None     # (the last stream's token: refused)
    view = open_staging(str(tmp_path), file.name, 5 * bpb, with_token)
    staged = staged_messages(pool, [(0, 2, b"")], read, view, bpb)
    message = next(staged)
    file.view[7] ^= 0x40                                      # (a writer of the file, after the source's copy)
    done = Assembler(1, bpb, file.view).feed(decode(message))
    assert put_blocks(target, [6], done) == [(0, f"checksum {block_checksum(file.view[:bpb]):#018x}, "
                                                 f"sent {block_checksum(bytes(block_bytes(pool, 2).numpy())):#018x}")]
    assert torch.equal(block_bytes(target, 6), block_bytes(_pool_of(5), 6))   # (left as it was)
    # A staged piece with no file offered, or beyond it, fails its block only.
    assert "no staging file" in Assembler(1, bpb).feed([Piece(0, last=True, checksum=1, staged=True)])[0][2]
    staging.give("w0:1", file, clean=True, staged=True, inline=False)
    assert staging.take("w0:1", 2 * bpb) is file and staging.staged == 1     # (used again: same name)
    staging.give("w0:1", file, clean=False, staged=True, inline=False)       # (a broken stream: dropped)
    assert not (tmp_path / file.name).exists()
    staging.close()


def test_a_source_that_cannot_open_the_file_streams_the_bytes_and_is_offered_none_again(tmp_path):
    bpb = _pool_of(0).shape.bytes_per_block
    staging = Staging(str(tmp_path))
    file = staging.take("elsewhere:1", bpb)
    (tmp_path / "link").symlink_to(tmp_path / file.name)
    # What a source elsewhere finds: no such file, a file too small, a link; a bad name is refused.
    token = file.new_token()
    assert open_staging(str(tmp_path / "other"), file.name, bpb, token) is None
    assert open_staging(str(tmp_path), file.name, file.size + 1, token) is None
    assert open_staging("", file.name, bpb, token) is None
    with pytest.raises(errors.InvalidArgument, match="staging"):
        open_staging(str(tmp_path), "link", bpb, token)
    # Whoever learned the name (the directory is listable) and not the stream's token: refused.
    assert open_staging(str(tmp_path), file.name, bpb, bytes(16)) is None
    with pytest.raises(errors.InvalidArgument, match="staging_token"):
        open_staging(str(tmp_path), file.name, bpb, b"")
    got = Assembler(1, bpb, file.view)
    got.feed([Piece(0, 0, b"x" * bpb, True, block_checksum(b"x" * bpb))])
    assert got.inline and not got.staged
    staging.give("elsewhere:1", file, clean=True, staged=got.staged, inline=got.inline)
    assert not (tmp_path / file.name).exists()
    assert staging.take("elsewhere:1", bpb) is None                       # (refused: in the stream from now on)
    assert staging.take("other:1", bpb) is not None
    assert staging.take("other:1", staging.max_bytes + 1) is None          # (too big for a file: in the stream)
    assert Staging("").take("other:1", bpb) is None                        # (--shared-memory-dir '')
    staging.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]


def test_a_worker_that_starts_removes_the_staging_files_of_workers_gone(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{STAGING_PREFIX}{int(gone.stdout)}-{'a' * 32}"
    alive = tmp_path / f"{STAGING_PREFIX}1-{'b' * 32}"                    # (pid 1: alive)
    other = tmp_path / "kvs-staging-notes.txt"
    for path in (dead, alive, other):
        path.write_bytes(b"x")
    Staging(str(tmp_path)).close()
    assert not dead.exists() and alive.exists() and other.exists()


# ------------------------------------------------------------------ two workers

@pytest.fixture(scope="module")
def stack():
    with Stack(2, model="", block_size=BS, num_blocks=32,
               worker_args=(*GEOMETRY, "--host-tier-gb", "0.002")) as s:
        yield s


def _stub(stack: Stack, pool: str, who: str = "engine") -> tuple[grpc.Channel, pb_grpc.WorkerStub]:
    i = int(pool.rsplit("-", 1)[1])
    channel = stack.credentials(who).channel(stack.workers[i].target)
    return channel, pb_grpc.WorkerStub(channel)


def ordered(stack: Stack, items: list, source: str = "worker-0", dst: str = "worker-1", serial: int | None = None):
    """``items`` (``BlockFetch``es or ``BlockRef``s of pool ``source``) with fetch orders to
    pool ``dst`` signed as the allocator signs them (its grant key of ``source``, read from
    Redis; the pool's serial now, or ``serial``): the tests here name blocks directly, where
    the engine runs the allocator's orders (tests/test_engine_fetch.py)."""
    with sync_redis(stack.redis.admin_url) as r:
        epoch, key = r.hmget(keys.pool_key(source, "meta"), ["epoch", "grant_key"])
        now = int(r.hget(keys.pool_key(source, "state"), "version") or 0)
    for item in items:
        tier, index = (item.src_tier, item.src) if isinstance(item, pb.BlockFetch) else (item.tier, item.index)
        item.pull_serial = now if serial is None else serial
        item.order_mac = order_mac(bytes.fromhex(key.decode()), "pull", pull_fields(
            source, int(epoch), dst, item.pull_serial, tier, index, item.block_hash))
    return items


def moves_ordered(stack: Stack, pool: str, moves: list) -> list:
    """``moves`` (``BlockMove``s of ``pool``) with tier orders signed as the allocator signs
    them (its grant key of the pool, read from Redis; as of the pool's serial now, plus one:
    after every write so far)."""
    with sync_redis(stack.redis.admin_url) as r:
        epoch, key = r.hmget(keys.pool_key(pool, "meta"), ["epoch", "grant_key"])
        now = int(r.hget(keys.pool_key(pool, "state"), "version") or 0)
    for m in moves:
        m.serial = now + 1
        m.order_mac = order_mac(bytes.fromhex(key.decode()), "move", move_fields(
            pool, int(epoch), m.serial, m.src_tier, m.src, m.dst_tier, m.dst, m.block_hash))
    return moves


class Pair:
    """A client, and a stub of each worker with each pool's epoch."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.client = Client(stack.target, credentials=stack.credentials("engine"))
        self.channels, self.stubs, self.epochs = [], {}, {}
        for pool in ("worker-0", "worker-1"):
            ch, stub = _stub(stack, pool)
            self.channels.append(ch)
            self.stubs[pool] = stub
            self.epochs[pool] = stub.Describe(pb.DescribeWorkerRequest(), timeout=10).epoch
        #: (what every write carries: the pool's generation, from its registration)
        self.generations = {p.pool_id: p.generation for p in self.client.pools()}

    def grants(self, pool: str) -> list:
        """The client's grants of its blocks of ``pool`` not sent to its worker yet."""
        return self.client.take_grants(pool, self.epochs[pool])

    def write(self, pool: str, blocks: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        slots = [b * BS + i for b in blocks for i in range(BS)]
        for layer in range(4):
            k, v = torch.randn(len(slots), 4, 64, generator=g), torch.randn(len(slots), 4, 64, generator=g)
            self.stubs[pool].WriteKV(pb.WriteKVRequest(
                epoch=self.epochs[pool], layer=layer, slot_mapping=slots, key=tensors.encode(k),
                value=tensors.encode(v), lease_id=self.client.lease_id, generation=self.generations[pool],
                grants=self.grants(pool)))

    def read(self, pool: str, block: int) -> bytes:
        slots = list(range(block * BS, (block + 1) * BS))
        out = b""
        for layer in range(4):
            r = self.stubs[pool].ReadKV(pb.ReadKVRequest(epoch=self.epochs[pool], layer=layer, slots=slots,
                                                         lease_id=self.client.lease_id, grants=self.grants(pool)))
            out += r.key.data + r.value.data
        return out

    def fetch(self, fetches: list[pb.BlockFetch], **kw) -> pb.FetchBlocksResponse:
        """Worker-1 fetches from worker-0, each block with its order (``ordered``)."""
        request = pb.FetchBlocksRequest(epoch=self.epochs["worker-1"], lease_id=self.client.lease_id,
                                        generation=self.generations["worker-1"], source_pool_id="worker-0",
                                        source_epoch=self.epochs["worker-0"], chunk_bytes=CHUNK,
                                        fetches=ordered(self.stack, fetches), grants=self.grants("worker-1"))
        for k, v in kw.items():
            setattr(request, k, v)
        return self.stubs["worker-1"].FetchBlocks(request, timeout=30)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.client.close()


@pytest.fixture
def pair(stack):
    p = Pair(stack)
    yield p
    p.close()


def test_a_worker_fills_its_blocks_with_another_worker_s_byte_for_byte(stack, pair):
    src = pair.client.create(list(range(1, 4 * BS + 1)), pool="worker-0")
    dst = pair.client.create(list(range(1000, 1000 + 4 * BS)), pool="worker-1")
    pair.write("worker-0", list(src.block_table), seed=1)
    pair.write("worker-1", list(dst.block_table), seed=2)
    reply = pair.fetch([pb.BlockFetch(src_tier=0, src=s, dst=d) for s, d in zip(src.block_table, dst.block_table)])
    assert [r.ok for r in reply.results] == [True] * 4, [r.error for r in reply.results]
    assert reply.bytes_moved == 4 * 131_072
    for s, d in zip(src.block_table, dst.block_table):
        assert pair.read("worker-1", d) == pair.read("worker-0", s)
    src.free()
    dst.free()
    w0, w1 = stack.workers
    assert _metric(w1.metrics_url, "kvservice_worker_transfer_blocks_total", direction="in") >= 4
    assert _metric(w0.metrics_url, "kvservice_worker_transfer_bytes_total", direction="out") >= 4 * 131_072
    # (two workers of one machine: the bytes went through worker-1's staging file)
    assert _metric(w1.metrics_url, "kvservice_worker_transfer_staged_fetches_total") >= 1


def test_workers_without_shared_memory_move_the_blocks_in_the_stream():
    with Stack(2, model="", block_size=BS, num_blocks=32,
               worker_args=(*GEOMETRY, "--shared-memory-dir", "")) as stack:
        pair = Pair(stack)
        src = pair.client.create(list(range(1, 3 * BS + 1)), pool="worker-0")
        dst = pair.client.create(list(range(1000, 1000 + 3 * BS)), pool="worker-1")
        pair.write("worker-0", list(src.block_table), seed=5)
        reply = pair.fetch([pb.BlockFetch(src_tier=0, src=s, dst=d) for s, d in zip(src.block_table, dst.block_table)])
        assert [r.ok for r in reply.results] == [True] * 3, [r.error for r in reply.results]
        for s, d in zip(src.block_table, dst.block_table):
            assert pair.read("worker-1", d) == pair.read("worker-0", s)
        w0, w1 = stack.workers
        assert _metric(w1.metrics_url, "kvservice_worker_transfer_staged_fetches_total") == 0
        assert _metric(w0.metrics_url, "kvservice_worker_transfer_bytes_total", direction="out") >= 3 * 131_072
        pair.close()


def _metric(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_a_host_entry_is_fetched_once_its_hash_matches_and_a_mismatch_leaves_the_block_unwritten(pair):
    # (a prompt no other test caches: a cached block is shared, and written by nobody)
    src = pair.client.create(list(range(9001, 9001 + 2 * BS)), pool="worker-0")
    dst = pair.client.create(list(range(2000, 2000 + 2 * BS)), pool="worker-1")
    pair.write("worker-0", list(src.block_table), seed=3)
    moved = pair.stubs["worker-0"].MoveBlocks(pb.MoveBlocksRequest(
        epoch=pair.epochs["worker-0"], lease_id=pair.client.lease_id, generation=pair.generations["worker-0"],
        moves=moves_ordered(pair.stack, "worker-0", [
            pb.BlockMove(src_tier=0, src=b, dst_tier=1, dst=i, block_hash=bytes([i + 1]) * 16)
            for i, b in enumerate(src.block_table)])))
    assert all(r.ok for r in moved.results)
    before = pair.read("worker-1", dst.block_table[1])
    reply = pair.fetch([pb.BlockFetch(src_tier=1, src=0, block_hash=b"\x01" * 16, dst=dst.block_table[0]),
                        pb.BlockFetch(src_tier=1, src=1, block_hash=b"\x07" * 16, dst=dst.block_table[1])])
    assert reply.results[0].ok and not reply.results[1].ok
    assert "holds another block" in reply.results[1].error
    assert pair.read("worker-1", dst.block_table[0]) == pair.read("worker-0", src.block_table[0])
    assert pair.read("worker-1", dst.block_table[1]) == before
    src.free()
    dst.free()


def test_a_stale_source_epoch_a_bad_request_and_an_engine_pulling_directly_are_refused(stack, pair):
    dst = pair.client.create(list(range(30001, 30001 + BS)), pool="worker-1")
    fetches = [pb.BlockFetch(src_tier=0, src=0, dst=dst.block_table[0])]
    reply = pair.fetch(fetches * 2, source_epoch=pair.epochs["worker-0"] + 1)    # (every block refused)
    assert [r.ok for r in reply.results] == [False, False] and reply.bytes_moved == 0
    assert f"is at epoch {pair.epochs['worker-0']}, not" in reply.results[0].error, reply.results[0].error
    for kw, words in (({"source_pool_id": "worker-1"}, "own"), ({"source_pool_id": ""}, "source_pool_id"),
                      ({"chunk_bytes": 10}, "chunk_bytes")):
        with pytest.raises(grpc.RpcError) as info:
            pair.fetch(fetches, **kw)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        pair.fetch([pb.BlockFetch(src_tier=0, src=0, dst=32)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in info.value.details()
    pull = pb.PullBlocksRequest(pool_id="worker-0", epoch=pair.epochs["worker-0"], dst_pool_id="worker-1",
                                blocks=ordered(stack, [pb.BlockRef(index=0)]))
    for who in ("engine", "admin"):
        ch, stub = _stub(stack, "worker-0", who)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.PullBlocks(pull, timeout=10))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, who
        ch.close()
    ch, stub = _stub(stack, "worker-0", "worker-1")          # (the order's pool's worker: served)
    chunks = list(stub.PullBlocks(pull, timeout=10))
    assert sum(len(p.data) for c in chunks for p in c.pieces) == 131_072
    # Refused: no order, a forged one, another block's, an order for another pool, another
    # pool's worker presenting it, an order older than the block's last writer.
    forged = pb.BlockRef(index=0, order_mac=bytes(16), pull_serial=pull.blocks[0].pull_serial)
    other_block = pb.BlockRef(index=1, order_mac=pull.blocks[0].order_mac, pull_serial=pull.blocks[0].pull_serial)
    with sync_redis(stack.redis.admin_url) as r:                    # (the pool's serial before the block's grant)
        before = int(r.hget(keys.pool_key("worker-0", "state"), "version") or 0)
    written = pair.client.create(list(range(31001, 31001 + BS)), pool="worker-0")
    pair.write("worker-0", list(written.block_table), seed=17)      # (its grant: a newer serial)
    old_order = ordered(stack, [pb.BlockRef(index=written.block_table[0])], serial=before)
    for blocks, dst, words in (([pb.BlockRef(index=0)], "worker-1", "no fetch order"),
                               ([forged], "worker-1", "no fetch order"), ([other_block], "worker-1", "no fetch order"),
                               (ordered(stack, [pb.BlockRef(index=0)], dst="worker-9"), "worker-9", "may not pull"),
                               (pull.blocks, "worker-9", "may not pull"), (old_order, "worker-1", "older than")):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.PullBlocks(pb.PullBlocksRequest(pool_id="worker-0", epoch=pair.epochs["worker-0"],
                                                      dst_pool_id=dst, blocks=blocks), timeout=10))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and words in info.value.details(), \
            (words, info.value.details())
    written.free()
    stale = pb.PullBlocksRequest(pool_id="worker-0", epoch=pair.epochs["worker-0"] + 1, blocks=[pb.BlockRef()])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.PullBlocks(stale, timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    ch.close()


def test_a_dead_source_fails_every_block_and_writes_none(stack, pair):
    dst = pair.client.create(list(range(3000, 3000 + 2 * BS)), pool="worker-1")
    before = [pair.read("worker-1", b) for b in dst.block_table]
    stack.workers[0].kill()
    try:
        reply = pair.fetch([pb.BlockFetch(src_tier=0, src=i, dst=b) for i, b in enumerate(dst.block_table)])
        assert [r.ok for r in reply.results] == [False, False]
        assert all("transfer failed" in r.error for r in reply.results), reply.results[0].error
        assert [pair.read("worker-1", b) for b in dst.block_table] == before
        dst.free()
    finally:
        # (the module's other tests, in any order, use both workers: worker 0 starts again
        # and registers its pool with a new epoch)
        stack.workers[0].start()
        epoch = _stub(stack, "worker-0")[1].Describe(pb.DescribeWorkerRequest(), timeout=10).epoch
        assert wait_for(lambda: any(p.pool_id == "worker-0" and p.epoch == epoch for p in pair.client.pools()))
        _until_worker_1_fetches_from_worker_0(stack)


def _until_worker_1_fetches_from_worker_0(stack: Stack) -> None:
    """Waits until worker-1 reaches the restarted worker-0 (its channel's reconnect backoff
    over), so that the module's next test finds both as a fresh stack would."""
    p = Pair(stack)
    try:
        src = p.client.create(list(range(40001, 40001 + BS)), pool="worker-0")
        dst = p.client.create(list(range(41001, 41001 + BS)), pool="worker-1")
        p.write("worker-0", list(src.block_table), seed=13)
        one = [pb.BlockFetch(src_tier=0, src=src.block_table[0], dst=dst.block_table[0])]
        assert wait_for(lambda: p.fetch(one).results[0].ok, timeout=30)
        src.free()
        dst.free()
    finally:
        p.close()


def test_fetches_complete_with_the_source_s_bytes_while_others_write_the_staging_file(stack, pair):
    """A process of the workers' user writes other bytes into worker-1's staging files all
    along, and a caller with a worker's credentials pulls other blocks naming them: every
    fetch that completes holds the source's bytes, one that does not leaves its blocks as
    they were (the engine recomputes them), and the foreign pull is not written there."""
    src = pair.client.create(list(range(20001, 20001 + 8 * BS)), pool="worker-0")
    dst = pair.client.create(list(range(5000, 5000 + 8 * BS)), pool="worker-1")
    pair.write("worker-0", list(src.block_table), seed=11)
    expected = {s: pair.read("worker-0", s) for s in src.block_table}
    directory = "/dev/shm"
    pattern = f"{directory}/{STAGING_PREFIX}{stack.workers[1].proc.pid}-*"
    stop, scribbles = threading.Event(), [0]

    def scribble() -> None:             # (the whole block region of each file, over and over)
        noise = os.urandom(1 << 20)
        while not stop.is_set():
            for path in glob.glob(pattern):
                try:
                    with open(path, "r+b") as f:
                        size = os.fstat(f.fileno()).st_size
                        f.seek(STAGING_HEADER)
                        for at in range(STAGING_HEADER, size, len(noise)):
                            f.write(noise[:size - at])
                    scribbles[0] += 1
                except OSError:
                    pass

    ch, worker_stub = _stub(stack, "worker-0", "worker-1")      # (a worker's credentials)
    thread = threading.Thread(target=scribble, daemon=True)
    thread.start()
    ok = failed = foreign_staged = 0
    try:
        for round_ in range(12):
            pair.write("worker-1", list(dst.block_table), seed=100 + round_)
            before = {d: pair.read("worker-1", d) for d in dst.block_table}
            files = [os.path.basename(p) for p in glob.glob(pattern)]
            for name in files:            # (the foreign pull: the name, not the stream's token)
                pull = pb.PullBlocksRequest(pool_id="worker-0", epoch=pair.epochs["worker-0"], staging=name,
                                            staging_token=os.urandom(16), dst_pool_id="worker-1",
                                            blocks=ordered(stack, [pb.BlockRef(index=0)]))
                foreign_staged += sum(p.staged for c in worker_stub.PullBlocks(pull, timeout=10) for p in c.pieces)
            reply = pair.fetch([pb.BlockFetch(src_tier=0, src=s, dst=d)
                                for s, d in zip(src.block_table, dst.block_table)])
            for r, s, d in zip(reply.results, src.block_table, dst.block_table):
                got = pair.read("worker-1", d)
                if r.ok:
                    assert got == expected[s], f"round {round_}: block {d} completed with other bytes"
                    ok += 1
                else:
                    assert "checksum" in r.error and got == before[d], (round_, r.error)
                    failed += 1
    finally:
        stop.set()
        thread.join(10)
        ch.close()
    print(f"{ok} blocks fetched with the source's bytes, {failed} failed their check; {scribbles[0]} scribbles")
    assert scribbles[0] > 0 and ok + failed == 12 * 8 and foreign_staged == 0
    assert _metric(stack.workers[1].metrics_url, "kvservice_worker_transfer_staged_fetches_total") >= 1
    src.free()
    dst.free()
