"""Blocks that move between workers (DESIGN §13): the data plane.

A block's bytes are what a lower tier stores (``worker.tiers``): every layer's K then V of
its slots, ``PoolShape.bytes_per_block`` bytes. They travel as a stream of pieces:

- the **source** (``PullBlocks``, ``pieces``) reads each block asked for, from its device
  pool or from a host or disk entry (whose stored checksum and hash are checked first),
  and sends it in pieces, each message filled up to ``chunk_bytes`` (a block may span
  messages, a message hold several blocks); a block's last piece carries the checksum of
  the whole block (XXH3-64: twice as fast as CRC-32 here, and the transfer's cost is
  its checksums and copies). A block it cannot read (an entry that fails its checks, an
  index out of range) is one piece with an ``error`` and no bytes. A stream of device
  blocks only is gathered straight into its messages (``device_messages``).
- the **destination** (``FetchBlocks``, ``Assembler``) puts the pieces back together, in
  order and without gaps, checks each block's length and checksum, and writes it into the
  device block named for it. A block that fails any check is reported and its device
  block left as it was: the caller recomputes those tokens; wrong KV is never written.

The messages are written and read without building protobuf objects (``encode``,
``decode``: BlockChunk's wire format), and each is prepared or written in a thread while
the next one travels. The transport is an interface (``Transport``: ``pull`` yields the
pieces of one stream); ``GrpcTransport`` is gRPC streaming between workers (the worker role, mTLS or a
token as every kvservice call). A GPU deployment would plug a GPU-direct transport (NIXL,
Mooncake's transfer engine) in its place: the pieces and their checks stay the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import logging
import mmap
import os
import re
import secrets
import stat
import time
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, NamedTuple, Protocol

import torch
import xxhash

from kvservice import errors
from kvservice.common.grpc import MAX_BLOCK_STREAM_MESSAGE
from kvservice.v1 import worker_pb2 as pb
from worker.pool import KVPool
from worker.tiers import DEVICE, LoadFailed, Tiers, block_bytes, checksum, put_block

log = logging.getLogger(__name__)

#: Bytes per message of a PullBlocks stream unless the request says otherwise.
DEFAULT_CHUNK_BYTES = 4 << 20
#: Bounds of PullBlocksRequest.chunk_bytes.
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 64 << 10, 16 << 20
#: Blocks in one PullBlocks or FetchBlocks call at most.
MAX_BLOCKS = 65_536
#: A pull's deadline: this many seconds, plus its bytes at this many bytes a second (a
#: source that stalls fails the blocks it has not sent, rather than holding the fetch).
PULL_SECONDS, PULL_RATE = 10.0, 20e6
#: The largest gRPC message a transfer sends: a chunk and its framing.
MAX_MESSAGE_BYTES = MAX_BLOCK_STREAM_MESSAGE
assert MAX_MESSAGE_BYTES >= MAX_CHUNK_BYTES + (1 << 20)


def check_chunk_bytes(asked: int) -> int:
    """The bytes per message of a stream that asked for ``asked`` (0: the default).

    Raises:
        InvalidArgument: outside MIN_CHUNK_BYTES..MAX_CHUNK_BYTES.
    """
    if not asked:
        return DEFAULT_CHUNK_BYTES
    if not MIN_CHUNK_BYTES <= asked <= MAX_CHUNK_BYTES:
        raise errors.InvalidArgument(f"chunk_bytes: {MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES} "
                                     f"(0: {DEFAULT_CHUNK_BYTES}), got {asked}")
    return asked


def read_block(pool: KVPool, tiers: Tiers | None, tier: int, index: int, tag: bytes) -> torch.Tensor:
    """A block's bytes (uint8 on the CPU): device block ``index``, or entry ``index`` of the
    host (1) or disk (2) tier once it passes its checksum and holds ``tag``.

    Raises:
        LoadFailed: no such tier, or the entry's bytes are not the block asked for.
        ValueError: an index out of range.
    """
    if tier == DEVICE:
        if not 0 <= index < pool.shape.num_blocks:
            raise ValueError(f"block {index} is out of range 0..{pool.shape.num_blocks - 1}")
        return block_bytes(pool, index)
    if tiers is None:
        raise LoadFailed("this worker has no lower tier")
    return tiers._tier(tier).get(index, tag)


class Piece(NamedTuple):
    """One ``BlockPiece`` of a stream (``data``: bytes or a memoryview into a message)."""

    position: int
    offset: int = 0
    data: Any = b""
    last: bool = False
    checksum: int = 0
    error: str = ""
    staged: bool = False        # (its bytes are in the destination's staging file)


def pieces(blocks: Iterable[tuple[int, int, bytes]], read: Any, chunk_bytes: int) -> Iterator[list[Piece]]:
    """The messages of a PullBlocks stream, each a list of pieces: ``blocks`` (tier, index,
    hash) read with ``read(tier, index, hash)`` and cut so that each message holds
    ``chunk_bytes`` of data (the last one less)."""
    chunk: list[Piece] = []
    size = 0
    for position, (tier, index, tag) in enumerate(blocks):
        try:
            data = read(tier, index, tag).numpy()
        except (LoadFailed, ValueError) as exc:
            chunk.append(Piece(position, last=True, error=str(exc) or "unreadable"))
            continue
        digest = block_checksum(data)
        view = memoryview(data).cast("B")
        offset = 0
        while True:                  # (pieces that fill each message up to chunk_bytes)
            if size >= chunk_bytes:
                yield chunk
                chunk, size = [], 0
            part = view[offset:offset + chunk_bytes - size]
            offset += len(part)
            last = offset >= len(view)
            chunk.append(Piece(position, offset - len(part), part, last, digest if last else 0))
            size += len(part)
            if last:
                break
    if chunk:
        yield chunk


# Whole device blocks, gathered straight into their message (``device_messages``): every
# piece of such a message is one whole block with fields of fixed width (protobuf readers
# take varints written on more bytes than they need), so that the blocks' data lie at a
# fixed stride, 4-byte aligned, and one strided copy per block's K and V fills them, with
# no intermediate buffer. Per piece: the piece's key and length (1 + 5 bytes), position
# (1 + 4), data's key and length (1 + 4), the data, last (1 + 2) and the checksum (1 + 8).
_HEAD, _TAIL = 16, 12


def _fixed_varint(n: int, width: int) -> bytes:
    """``n`` as a varint of exactly ``width`` bytes (continuation bits on all but the last)."""
    out = bytearray()
    for i in range(width):
        byte = (n >> (7 * i)) & 0x7F
        out.append(byte | (0x80 if i < width - 1 else 0))
    if n >> (7 * width):
        raise ValueError(f"{n} does not fit a varint of {width} bytes")
    return bytes(out)


_BYTES = ctypes.pythonapi.PyBytes_FromStringAndSize
_BYTES.restype, _BYTES.argtypes = ctypes.py_object, [ctypes.c_char_p, ctypes.c_ssize_t]


def _unfilled_bytes(n: int) -> bytes:
    """A new ``bytes`` object of ``n`` bytes left as malloc gave them (``bytes(n)`` would
    zero them first): for a caller that writes every byte before anything reads it."""
    return _BYTES(None, n)


def keep_freed_memory() -> bool:
    """Has glibc's malloc keep the memory a process frees for its next allocations (up to
    512 MiB held back; blocks up to 32 MiB from the heap, not mmap): a stream's messages,
    a few MiB each, then reuse pages already mapped. Otherwise each new message touches
    fresh pages, and their faults cost more than the copy into them (measured: 10.4 against
    3.6 ms per 31.6 MiB of blocks here). False where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_TRIM_THRESHOLD, 512 << 20) and libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20))
    except (OSError, AttributeError):
        return False


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3      # (glibc's malloc.h)


def device_messages(pool: KVPool, blocks: list[tuple[int, int]], chunk_bytes: int) -> Iterator[bytes]:
    """The serialized BlockChunks of a stream of whole device blocks ((position, block)),
    each message as many blocks as fit ``chunk_bytes`` (one at least). Each block's K and V
    are copied once, from the pool into the message (a ``bytes`` object written in place
    right after it is made, every byte of it, before anything else can see it: gRPC sends
    only ``bytes``, and a copy into a bytearray then into bytes would copy every block
    twice)."""
    s = pool.shape
    bpb = s.bytes_per_block
    row = _HEAD + bpb + _TAIL
    assert bpb % 4 == 0 and row % 4 == 0     # (aligned for any element size up to 4 bytes)
    per = max(1, chunk_bytes // bpb)
    # (the first message holds one block: the destination starts writing while the
    # source gathers the next)
    starts = [0] + list(range(1, len(blocks), per))
    for start, end in zip(starts, starts[1:] + [len(blocks)]):
        group = blocks[start:end]
        message = _unfilled_bytes(row * len(group))
        with warnings.catch_warnings():      # (torch warns that the buffer is read-only: see above)
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(message, dtype=torch.uint8)
        raw = flat.numpy()
        size_of = s.dtype.itemsize
        rows = flat.view(s.dtype).view(len(group), row // size_of)
        data = rows[:, _HEAD // size_of:(_HEAD + bpb) // size_of].view(
            len(group), 2, s.num_layers, s.num_kv_heads, s.block_size, s.head_dim)
        body = _fixed_varint(row - 6, 5)
        size = b"\x1a" + _fixed_varint(bpb, 4)
        for j, (position, block) in enumerate(group):
            data[j, 0].copy_(pool.k_caches[:, block])
            data[j, 1].copy_(pool.v_caches[:, block])
            at = j * row
            raw[at:at + _HEAD] = memoryview(b"\x0a" + body + b"\x08" + _fixed_varint(position, 4) + size)
            digest = block_checksum(memoryview(message)[at + _HEAD:at + _HEAD + bpb])
            raw[at + _HEAD + bpb:at + row] = memoryview(b"\x20\x81\x00\x29" + digest.to_bytes(8, "little"))
        yield message


# The wire format of BlockChunk (kvservice.v1.worker.proto), written and read here without
# building messages: a block's bytes are copied once into the message on the source, and
# read in place on the destination. Any protobuf library reads what ``encode`` writes.

def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode(chunk: list[Piece]) -> bytes:
    """A BlockChunk's serialized bytes."""
    parts: list[Any] = []
    for p in chunk:
        head = bytearray()
        if p.position:
            head += b"\x08" + _varint(p.position)
        if p.offset:
            head += b"\x10" + _varint(p.offset)
        tail = bytearray()
        if p.last:
            tail += b"\x20\x01"
        if p.checksum:
            tail += b"\x29" + p.checksum.to_bytes(8, "little")
        if p.error:
            err = p.error.encode()
            tail += b"\x32" + _varint(len(err)) + err
        if p.staged:
            tail += b"\x38\x01"
        data_head = b"\x1a" + _varint(len(p.data)) if len(p.data) else b""
        body = len(head) + len(data_head) + len(p.data) + len(tail)
        parts += [b"\x0a" + _varint(body), head, data_head, p.data, tail]
    return b"".join(parts)


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("a truncated or overlong varint")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7


def _skip(buf: memoryview, i: int, wire: int) -> int:
    if wire == 0:
        return _read_varint(buf, i)[1]
    if wire == 2:
        n, i = _read_varint(buf, i)
        return i + n
    if wire == 1:
        return i + 8
    if wire == 5:
        return i + 4
    raise ValueError(f"wire type {wire}")


def decode(message: bytes) -> list[Piece]:
    """The pieces of a serialized BlockChunk; ``data`` are views into ``message``.

    Raises:
        ValueError: not a BlockChunk's bytes.
    """
    buf = memoryview(message)
    out = []
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        if key != 0x0A:
            i = _skip(buf, i, key & 7)
            continue
        n, i = _read_varint(buf, i)
        end = i + n
        if end > len(buf):
            raise ValueError("a piece runs past the message")
        f = {1: 0, 2: 0, 3: b"", 4: 0, 5: 0, 6: b"", 7: 0}
        while i < end:
            key, i = _read_varint(buf, i)
            field, wire = key >> 3, key & 7
            if wire == 0 and field in (1, 2, 4, 7):
                f[field], i = _read_varint(buf, i)
            elif wire == 1 and field == 5:
                f[5] = int.from_bytes(buf[i:i + 8], "little")
                i += 8
            elif wire == 2 and field in (3, 6):
                size, i = _read_varint(buf, i)
                f[field] = buf[i:i + size]
                i += size
            else:
                i = _skip(buf, i, wire)
        if i != end:
            raise ValueError("a piece's fields run past it")
        out.append(Piece(f[1], f[2], f[3], bool(f[4]), f[5], bytes(f[6]).decode(errors="replace"), bool(f[7])))
    return out


def from_message(chunk: pb.BlockChunk) -> list[Piece]:
    """The pieces of a parsed BlockChunk."""
    return [Piece(p.position, p.offset, p.data, p.last, p.checksum, p.error, p.staged) for p in chunk.pieces]


class Assembler:
    """Puts a PullBlocks stream's pieces back into blocks of ``bytes_per_block`` bytes, for
    ``count`` blocks asked for in order; ``feed`` returns the blocks a message completes:
    (position, its bytes (a buffer; None: failed), error, the checksum sent), the bytes'
    checksum still to be compared (``verify``: off the receiving loop)."""

    def __init__(self, count: int, bytes_per_block: int, staging: memoryview | None = None) -> None:
        self.count = count
        self.bytes_per_block = bytes_per_block
        self.staging = staging       # (the staging file offered to the source: staged pieces' bytes)
        self.position = 0           # the block being received
        self.buffer = bytearray()
        self.failed = False          # (the stream broke its order: every block after is failed)
        self.inline = False          # (a block came in the stream: the source did not take the staging file)
        self.staged = False          # (a block came through the staging file)

    def feed(self, chunk: list[Piece]) -> list[tuple[int, Any, str, int]]:
        out: list[tuple[int, Any, str, int]] = []
        for piece in chunk:
            if self.failed:
                return out
            if piece.position != self.position or piece.offset != len(self.buffer) or self.position >= self.count:
                self.failed = True
                out.append((self.position, None, f"the stream broke off: piece of block {piece.position} at "
                                                  f"offset {piece.offset}, expected block {self.position} at "
                                                  f"{len(self.buffer)}", 0))
                return out
            if piece.error:
                out.append((self.position, None, f"the source could not read it: {piece.error}", 0))
                self._next()
                continue
            if piece.staged:
                at = self.position * self.bytes_per_block
                if self.staging is None or len(piece.data) or not piece.last or at + self.bytes_per_block > len(
                        self.staging):
                    out.append((self.position, None, "a staged piece, and no staging file holds it", 0))
                else:
                    out.append((self.position, self.staging[at:at + self.bytes_per_block], "", piece.checksum))
                    self.staged = True
                self._next()
                continue
            self.inline = True
            if piece.last and not self.buffer:
                data = piece.data           # (a block in one piece: read in place)
            else:
                self.buffer += piece.data
                data = self.buffer          # (handed over: the next block gets a new buffer)
            if len(data) > self.bytes_per_block or (piece.last and len(data) != self.bytes_per_block):
                out.append((self.position, None, f"{len(data)} bytes, a block has {self.bytes_per_block}", 0))
                if not piece.last:
                    self.failed = True
                    return out
                self._next()
                continue
            if piece.last:
                out.append((self.position, data, "", piece.checksum))      # (checked by ``verify``)
                self._next()
        return out

    def missing(self, why: str) -> list[tuple[int, Any, str, int]]:
        """The blocks the stream never completed (it ended, or broke off), each failed."""
        return [(p, None, why, 0) for p in range(self.position + (1 if self.failed else 0), self.count)]

    def _next(self) -> None:
        self.position += 1
        self.buffer = bytearray()


def block_checksum(data: Any) -> int:
    """A block's checksum in transit: XXH3-64 of its bytes (any buffer). (A lower tier's
    entries keep a CRC-32: worker.tiers.)"""
    return xxhash.xxh3_64_intdigest(data)


def verify(data: Any, checksum: int) -> str:
    """"" when ``data`` has the checksum ``checksum``, else why not."""
    actual = block_checksum(data)
    return "" if actual == checksum else f"checksum {actual:#018x}, sent {checksum:#018x}"


class Transport(Protocol):
    """How a destination worker reads blocks of another worker's pool."""

    def pull(self, address: str, request: pb.PullBlocksRequest, timeout: float) -> AsyncIterator[list[Piece]]:
        """The pieces of the source's PullBlocks stream for ``request``, message by
        message, within ``timeout`` seconds."""
        ...


PULL_METHOD = "/kvservice.v1.Worker/PullBlocks"


class GrpcTransport:
    """PullBlocks over gRPC: one channel per source address, with this worker's client
    credentials (its worker identity) and messages up to ``MAX_MESSAGE_BYTES``, read in
    place (``decode``)."""

    def __init__(self, credentials: Any = None) -> None:
        from kvservice.common.security import ClientCredentials

        self.credentials = credentials or ClientCredentials()
        self.channels: dict[str, Any] = {}

    async def pull(self, address: str, request: pb.PullBlocksRequest, timeout: float) -> AsyncIterator[list[Piece]]:
        channel = self.channels.get(address)
        if channel is None:
            channel = self.channels[address] = self.credentials.aio_channel(address, options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        call = channel.unary_stream(PULL_METHOD, request_serializer=pb.PullBlocksRequest.SerializeToString,
                                    response_deserializer=None)
        async for message in call(request, timeout=timeout):
            yield decode(message)

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        self.channels.clear()


async def serve(blocks: list[tuple[int, int, bytes]], read: Any, chunk_bytes: int,
                pool: KVPool | None = None, staging: memoryview | None = None) -> AsyncIterator[bytes]:
    """The source's side of PullBlocks: the stream's messages, serialized. Each message is
    read, checksummed and encoded in a thread while the one before it is sent. With
    ``staging`` (the destination's staging file, mapped): the blocks' bytes go there
    (``staged_messages``). With ``pool`` and only device blocks in range, no larger than
    ``chunk_bytes``: gathered straight into their messages (``device_messages``)."""
    loop = asyncio.get_running_loop()
    if staging is not None and pool is not None:
        staged = staged_messages(pool, blocks, read, staging, chunk_bytes)

        def build() -> bytes | None:
            return next(staged, None)
    elif pool is not None and pool.shape.bytes_per_block <= chunk_bytes and all(
            tier == DEVICE and 0 <= index < pool.shape.num_blocks for tier, index, _ in blocks):
        direct = device_messages(pool, [(i, index) for i, (_, index, _) in enumerate(blocks)], chunk_bytes)

        def build() -> bytes | None:
            return next(direct, None)
    else:
        messages = pieces(blocks, read, chunk_bytes)

        def build() -> bytes | None:
            chunk = next(messages, None)
            return None if chunk is None else encode(chunk)

    ahead = loop.run_in_executor(_EXECUTOR, build)
    while True:
        message = await ahead
        if message is None:
            return
        ahead = loop.run_in_executor(_EXECUTOR, build)
        yield message


def staged_messages(pool: KVPool, blocks: list[tuple[int, int, bytes]], read: Any, staging: memoryview,
                    chunk_bytes: int) -> Iterator[bytes]:
    """The messages of a stream whose blocks go to the destination's staging file: block
    i's bytes (as ``read`` gives them; a device block gathered from the pool) at
    i x bytes_per_block of ``staging``, and in the stream only a staged piece with the
    checksum of those bytes (or an error piece), as many blocks a message as ``chunk_bytes`` of data would
    hold (the first message one block: the destination starts while the rest is copied)."""
    s = pool.shape
    bpb = s.bytes_per_block
    per = max(1, chunk_bytes // bpb)
    starts = [0] + list(range(1, len(blocks), per))
    for start, end in zip(starts, starts[1:] + [len(blocks)]):
        chunk = []
        for position in range(start, end):
            tier, index, tag = blocks[position]
            at = position * bpb
            try:
                data = block_bytes(pool, index) if tier == DEVICE and 0 <= index < s.num_blocks else read(tier, index, tag)
            except (LoadFailed, ValueError) as exc:
                chunk.append(Piece(position, last=True, error=str(exc) or "unreadable"))
                continue
            # (the checksum of the block's own bytes, not of the file: a file that another
            # process writes meanwhile fails the destination's check)
            torch.frombuffer(staging[at:at + bpb], dtype=torch.uint8).copy_(data)
            chunk.append(Piece(position, last=True, checksum=block_checksum(data.numpy()), staged=True))
        yield encode(chunk)


# Staging files: a fetch between two workers of one machine goes through shared memory
# instead of through the stream. The destination makes the file (``Staging``) and names it
# in its PullBlocksRequest; a source that can open it (``open_staging``: same machine, same
# user, same shared-memory directory) writes the blocks there and streams only their
# checksums; a source that cannot (another machine, another container) streams the bytes,
# and is not offered a file again. Each file serves one source address, and it is used
# again only after a stream that ended cleanly (a source that broke off might still write
# into it). A file's name can be listed by anyone: its header holds a secret that the
# destination draws anew for each stream and sends only in its PullBlocksRequest
# (``staging_token``); a source writes into the file only when the header holds the token
# it was sent, so that nobody else's pull is written there. The destination checks a
# private copy of each block it took from the file (a process of the same user could still
# write the file), against the checksum of the source's own bytes.

#: A staging file's name: the prefix, its maker's process id and 32 hex digits (128
#: random bits). A worker that starts removes the files of processes gone (``Staging``).
STAGING_PREFIX = "kvs-staging-"
_STAGING_NAME = re.compile(r"kvs-staging-([0-9]{1,10})-[0-9a-f]{32}")
#: The largest staging file: a fetch of more bytes goes in the stream.
STAGING_MAX_BYTES = 512 << 20
#: A staging file's header: the stream's token (``STAGING_TOKEN_BYTES``) at its start, the
#: blocks after it.
STAGING_HEADER = 4096
STAGING_TOKEN_BYTES = 16


def check_staging_name(name: str) -> None:
    """Raises InvalidArgument unless ``name`` is a staging file's name."""
    if not _STAGING_NAME.fullmatch(name):
        raise errors.InvalidArgument(f"staging: {STAGING_PREFIX!r}, a process id, '-' and 32 hex digits, "
                                     f"got {name[:80]!r}")


class _Mapped(NamedTuple):
    fd: int
    mapping: mmap.mmap


#: The staging files a source has open, by path (the most recently used last).
_OPEN_STAGING: OrderedDict[str, _Mapped] = OrderedDict()
_OPEN_STAGING_MAX = 8


def open_staging(directory: str, name: str, nbytes: int, token: bytes) -> memoryview | None:
    """The blocks' part of the destination's staging file ``name`` in ``directory``,
    mapped (kept open for the next stream to the same file), once it is a regular file of
    this process's user with room for ``nbytes`` bytes of blocks whose header holds
    ``token``; None where it cannot be opened (another machine or container), is not such a
    file, or holds another token (the stream's bytes then go in the stream).

    Raises:
        InvalidArgument: not a staging file's name, or a token of the wrong length.
    """
    check_staging_name(name)
    if len(token) != STAGING_TOKEN_BYTES:
        raise errors.InvalidArgument(f"staging_token: {STAGING_TOKEN_BYTES} bytes with a staging file, got "
                                     f"{len(token)}")
    view = _map_staging(directory, name, STAGING_HEADER + nbytes)
    if view is None or not hmac.compare_digest(bytes(view[:STAGING_TOKEN_BYTES]), token):
        return None
    return view[STAGING_HEADER:]


def _map_staging(directory: str, name: str, nbytes: int) -> memoryview | None:
    """The whole staging file, mapped, if it is a regular file of this user of at least
    ``nbytes`` bytes (None otherwise)."""
    if not directory:
        return None
    path = os.path.join(directory, name)
    for other, known in list(_OPEN_STAGING.items()):     # (files their destination removed: let go)
        with contextlib.suppress(OSError):
            if os.fstat(known.fd).st_nlink:
                continue
        _close_staging(other)
    known = _OPEN_STAGING.get(path)
    if known is not None:
        if os.fstat(known.fd).st_size >= nbytes:
            _OPEN_STAGING.move_to_end(path)
            return memoryview(known.mapping)
        _close_staging(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < nbytes or not st.st_size:
            os.close(fd)
            return None
        mapping = mmap.mmap(fd, st.st_size)
    except OSError:
        os.close(fd)
        return None
    _OPEN_STAGING[path] = _Mapped(fd, mapping)
    while len(_OPEN_STAGING) > _OPEN_STAGING_MAX:
        _close_staging(next(iter(_OPEN_STAGING)))
    return memoryview(mapping)


def _close_staging(path: str) -> None:
    known = _OPEN_STAGING.pop(path)
    with contextlib.suppress(BufferError):     # (a view still in use: unmapped with its last reference)
        known.mapping.close()
    os.close(known.fd)


class StagingFile:
    """One staging file of the destination's, mapped: ``size`` bytes in ``directory``."""

    def __init__(self, directory: str, size: int) -> None:
        self.name = f"{STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        self.path = os.path.join(directory, self.name)
        self.size = size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, STAGING_HEADER + size)   # (its memory reserved: no SIGBUS on a full tmpfs later)
            self.mapping = mmap.mmap(fd, STAGING_HEADER + size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        os.close(fd)
        self._whole = memoryview(self.mapping)
        #: The blocks' part (``size`` bytes, after the header).
        self.view = self._whole[STAGING_HEADER:]

    def new_token(self) -> bytes:
        """Draws the next stream's token and writes it into the header (a source that is
        still writing for an earlier stream, or anyone else's pull, no longer matches)."""
        token = secrets.token_bytes(STAGING_TOKEN_BYTES)
        self._whole[:STAGING_TOKEN_BYTES] = token
        return token

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(BufferError):     # (views still in use: unmapped with the last of them)
            self.view.release()
            self._whole.release()
            self.mapping.close()


def remove_orphan_staging(directory: str) -> list[str]:
    """Removes the staging files in ``directory`` whose maker is gone (a worker killed
    before it could remove them); returns their names."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            m = _STAGING_NAME.fullmatch(name)
            if m is None or int(m.group(1)) == os.getpid():
                continue
            try:
                os.kill(int(m.group(1)), 0)
                continue
            except ProcessLookupError:
                pass
            except OSError:                # (alive, another user's)
                continue
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    if removed:
        log.info("removed %d staging file(s) of workers gone from %s", len(removed), directory)
    return removed


class Staging:
    """A destination's staging files, per source address: ``take`` one for a stream (None:
    the bytes go in the stream), ``give`` it back after. A source that streamed the bytes
    instead is not offered a file again (``refused``)."""

    def __init__(self, directory: str = "/dev/shm", max_bytes: int = STAGING_MAX_BYTES) -> None:
        self.directory = directory if directory and os.path.isdir(directory) else ""
        self.max_bytes = max_bytes
        if self.directory:
            remove_orphan_staging(self.directory)
        self._free: dict[str, list[StagingFile]] = {}
        self._taken: set[StagingFile] = set()
        self._refused: set[str] = set()
        self._closed = False
        #: Files made, and fetches whose blocks came through one.
        self.made = self.staged = 0

    def take(self, address: str, nbytes: int) -> StagingFile | None:
        if not self.directory or self._closed or address in self._refused or not 0 < nbytes <= self.max_bytes:
            return None
        free = self._free.setdefault(address, [])
        for i, f in enumerate(free):
            if f.size >= nbytes:
                self._taken.add(f)
                return free.pop(i)
        try:       # (32 MiB at least, so that the next, larger fetch may use it again)
            made = StagingFile(self.directory, min(max(nbytes, 32 << 20), self.max_bytes))
        except OSError as exc:            # (a full or missing shared-memory directory: in the stream)
            log.warning("no staging file of %d bytes in %s (%s): fetches from %s go in the stream",
                        nbytes, self.directory, exc, address)
            self._refused.add(address)
            return None
        self.made += 1
        while free and sum(f.size for f in free) + made.size > self.max_bytes:
            free.pop(0).close()
        self._taken.add(made)
        return made

    def give(self, address: str, file: StagingFile, clean: bool, staged: bool, inline: bool) -> None:
        """Back after a stream: kept for the next one if the stream ended ``clean``ly; a
        source that sent the bytes ``inline`` and none ``staged`` is offered none again."""
        refused = inline and not staged
        self._taken.discard(file)
        if staged:
            self.staged += 1
        if refused:
            self._refused.add(address)
        if clean and not refused and not self._closed:
            self._free.setdefault(address, []).append(file)
        else:
            file.close()

    def close(self) -> None:
        """Removes every file, those of streams still running too (their blocks fail)."""
        self._closed = True
        for f in [*self._taken, *(f for files in self._free.values() for f in files)]:
            f.close()
        self._free.clear()
        self._taken.clear()


def serialize_chunk(message: Any) -> bytes:
    """PullBlocks' response serializer: a message ``serve`` encoded already, or a BlockChunk."""
    return message if isinstance(message, bytes) else message.SerializeToString()


#: The threads that read, checksum and write blocks beside the event loop (xxhash
#: and torch's copies let go of the GIL).
_EXECUTOR = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvs-transfer")


class Sources:
    """Where other pools' workers are, and how to reach them: the allocator's registry
    (``describe(pool_id)`` -> (worker address, epoch): DescribePool as this worker), read
    again after ``ttl`` seconds or when an epoch differs; counts what this worker fetched
    and served.

    The address comes from the registry, never from the caller: a fetch cannot make the
    worker present its identity to an address a client chose.
    """

    def __init__(self, transport: Transport, describe: Callable[[str], Awaitable[tuple[str, int]]] | None = None,
                 ttl: float = 5.0, staging: Staging | None = None) -> None:
        self.transport = transport
        #: The staging files offered to sources on this machine (None: every fetch in the stream).
        self.staging = staging
        self.describe = describe
        self.ttl = ttl
        self._known: dict[str, tuple[str, int, float]] = {}
        #: Blocks fetched into this pool, failed fetches, bytes fetched; blocks and bytes served.
        self.fetched = self.failed = self.fetched_bytes = self.served_blocks = self.served_bytes = 0

    async def locate(self, pool_id: str, epoch: int) -> str:
        """The address of ``pool_id``'s worker, once the pool is at ``epoch``.

        Raises:
            NotFound: no such pool. FailedPrecondition (EPOCH_CHANGED): another epoch.
            Unavailable: the registry cannot be read.
        """
        known = self._known.get(pool_id)
        if known is None or known[1] != epoch or time.monotonic() - known[2] > self.ttl:
            if self.describe is None:
                raise errors.FailedPrecondition("this worker has no allocator to find other pools' workers")
            address, current = await self.describe(pool_id)
            known = self._known[pool_id] = (address, current, time.monotonic())
        if known[1] != epoch:
            raise errors.FailedPrecondition(
                f"pool {pool_id} is at epoch {known[1]}, not {epoch}: its worker restarted or re-registered, "
                f"and the blocks asked for are gone", reason="EPOCH_CHANGED")
        return known[0]

    def count(self, fetched: int, failed: int, nbytes: int) -> None:
        self.fetched += fetched
        self.failed += failed
        self.fetched_bytes += nbytes

    def served(self, blocks: int, nbytes: int) -> None:
        self.served_blocks += blocks
        self.served_bytes += nbytes


async def fetch(transport: Transport, address: str, request: pb.PullBlocksRequest, pool: KVPool,
                destinations: list[int], staging: Staging | None = None) -> list[str]:
    """Pulls ``request``'s blocks from the worker at ``address`` and writes block i into
    device block ``destinations[i]``; returns one error per block ("" where written). A
    block that fails a check, or that the stream never brought, is left as it was. Each
    message's blocks are checked and written in a thread while the next one arrives. With
    ``staging``: a staging file is offered to the source (``Staging``)."""
    loop = asyncio.get_running_loop()
    failures = [""] * len(destinations)
    bpb = pool.shape.bytes_per_block
    file = staging.take(address, len(destinations) * bpb) if staging is not None else None
    if file is not None:
        request.staging = file.name
        request.staging_token = file.new_token()
    got = Assembler(len(destinations), bpb, file.view if file is not None else None)
    writes: list[asyncio.Future] = []
    clean = False

    def write(done: list[tuple[int, Any, str, int]]) -> None:
        for position, error in put_blocks(pool, destinations, done):
            failures[position] = error

    timeout = PULL_SECONDS + len(destinations) * bpb / PULL_RATE
    try:
        try:
            async for chunk in transport.pull(address, request, timeout):
                writes.append(loop.run_in_executor(_EXECUTOR, write, got.feed(chunk)))
                if got.failed:
                    break
            else:
                clean = True
            tail = "the stream ended before this block"
        except Exception as exc:           # (the source died or refused: what did not come is failed)
            tail = f"the transfer failed: {_reason(exc)}"
        await asyncio.gather(*writes)
        write(got.missing(tail))
    finally:
        if file is not None:
            staging.give(address, file, clean, got.staged, got.inline)
    return failures


def put_blocks(pool: KVPool, destinations: list[int], done: list[tuple[int, Any, str, int]]) -> list[tuple[int, str]]:
    """Writes each block an ``Assembler`` completed (``done``) into device block
    ``destinations[position]`` once it passes its checksum; returns (position, why) of
    those it did not write (left as they were)."""
    failed = []
    for position, data, error, digest in done:
        if isinstance(data, memoryview) and isinstance(data.obj, mmap.mmap):
            # A block in the staging file, which its source (or a process of the same user)
            # may still write: the bytes checked are the bytes written, a private copy of them.
            data = bytes(data)
        error = error or verify(data, digest)
        if error:
            failed.append((position, error))
            continue
        with warnings.catch_warnings():     # (a block read in place from its message: read-only)
            warnings.simplefilter("ignore", UserWarning)
            block = torch.frombuffer(data, dtype=torch.uint8)
        put_block(pool, destinations[position], block)
    return failed


def _reason(exc: Exception) -> str:
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return str(exc) or type(exc).__name__


__all__ = ["Assembler", "GrpcTransport", "LoadFailed", "Piece", "Sources", "Transport", "check_chunk_bytes", "decode",
           "device_messages", "keep_freed_memory", "encode", "fetch", "from_message", "pieces", "put_blocks",
           "read_block", "serve", "serialize_chunk", "verify", "checksum", "Staging", "StagingFile", "open_staging",
           "staged_messages", "check_staging_name"]
