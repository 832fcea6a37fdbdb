"""Store clients: whole blocks written into a worker's pool and read back (``WriteBlocks``,
``ReadBlocks``).

A store client is the KV connector of another engine (vLLM's, say), authenticated as a
tenant, that keeps its KV cache in a K/V-only worker's pool: it holds block ids of the
pool (from the allocator, under its lease) and moves whole blocks in and out. To the
worker a block is opaque: ``PoolShape.bytes_per_block`` bytes, every layer's K then V of
its slots, the layout of a lower tier's entry and of a PullBlocks stream
(``worker.tiers.block_bytes``, ``put_block``). Both directions travel as PullBlocks'
pieces (``worker.transfer``): each block in order of offset, its last piece with the
XXH3-64 of the whole block.

- **The worker's side** (``receive``): the pieces of a WriteBlocks stream are put back
  together by ``transfer.Assembler``; a block is written (``transfer.put_blocks``) only
  once whole and checked. The first block that fails a check ends the call
  (INVALID_ARGUMENT): the blocks completed before it are written, the others keep their
  bytes. ReadBlocks is PullBlocks' serving path (``transfer.serve``) over device blocks.
- **The client's side** (``write_blocks``, ``read_blocks``): a process with only a gRPC
  channel to the worker (opened with ``CHANNEL_OPTIONS``: messages up to 17 MiB) sends
  one buffer of blocks and reads blocks back into one, checking every checksum; failures
  are ``kvservice.errors`` exceptions.
"""

from __future__ import annotations

import asyncio
import warnings
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable

import grpc
import torch

from kvservice import errors
from kvservice.rpc import to_domain_error
from kvservice.v1 import worker_pb2 as pb
from worker.pool import KVPool
from worker.tiers import DEVICE
from worker.transfer import (DEFAULT_CHUNK_BYTES, MAX_BLOCKS, MAX_MESSAGE_BYTES, PULL_RATE, PULL_SECONDS, Assembler,
                             Piece, check_chunk_bytes, from_message, pieces, put_blocks, verify)

#: Options of a client's channel to a worker: the messages of a block stream (a chunk and
#: its framing) are larger than gRPC's default limit of 4 MiB.
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES))
ENDED = "the stream ended before this block"


@dataclass(slots=True)
class StoreCounts:
    """Blocks a worker wrote for store clients (WriteBlocks) and read for them (ReadBlocks)."""

    written_blocks: int = 0
    read_blocks: int = 0


def check_block_ids(block_ids: Iterable[int], num_blocks: int, distinct: bool) -> list[int]:
    """``block_ids`` once each is a device block of a pool of ``num_blocks`` (and, with
    ``distinct``, named once), at most MAX_BLOCKS of them.

    Raises:
        InvalidArgument: what is wrong, with the offending id.
    """
    ids = list(block_ids)
    if len(ids) > MAX_BLOCKS:
        raise errors.InvalidArgument(f"at most {MAX_BLOCKS} block_ids per call, got {len(ids)}")
    seen: set[int] = set()
    for i, block in enumerate(ids):
        if not 0 <= block < num_blocks:
            raise errors.InvalidArgument(f"block_ids[{i}] = {block} is out of range 0..{num_blocks - 1}")
        if distinct and block in seen:
            raise errors.InvalidArgument(f"block_ids[{i}] = {block} appears twice")
        seen.add(block)
    return ids


async def receive(pool: KVPool, block_ids: list[int], chunks: AsyncIterator[list[Piece]], counts: StoreCounts) -> int:
    """The worker's side of WriteBlocks: writes the blocks that ``chunks`` (the stream's
    pieces, message by message) bring into device blocks ``block_ids``, each once whole
    and checked; returns how many (all of them).

    Raises:
        InvalidArgument: a piece out of place or with an error, a block of another
            length or checksum, a block the stream never completed. The blocks completed
            before it are written (and counted).
    """
    loop = asyncio.get_running_loop()
    got = Assembler(len(block_ids), pool.shape.bytes_per_block)
    written = 0
    async for chunk in chunks:
        for piece in chunk:
            if not 0 <= piece.position < len(block_ids):
                raise errors.InvalidArgument(f"a piece of position {piece.position}: block_ids has {len(block_ids)}")
            if piece.error:
                raise errors.InvalidArgument(f"block_ids[{piece.position}]: a piece carries an error "
                                             f"({piece.error!r}); a written block has none")
        done = got.feed(chunk)
        failed = await loop.run_in_executor(None, put_blocks, pool, block_ids, done)
        written += len(done) - len(failed)
        counts.written_blocks += len(done) - len(failed)
        if failed:
            raise _bad_block(block_ids, *failed[0])
    missing = got.missing(ENDED)
    if missing:
        raise _bad_block(block_ids, missing[0][0], missing[0][2])
    return written


def _bad_block(block_ids: list[int], position: int, why: str) -> errors.InvalidArgument:
    if position >= len(block_ids):        # (a piece after every block was complete)
        return errors.InvalidArgument(f"a piece after the last block: {why}")
    return errors.InvalidArgument(f"block_ids[{position}] = {block_ids[position]}: {why}")


def device_refs(block_ids: list[int]) -> list[tuple[int, int, bytes]]:
    """The (tier, index, hash) of device blocks, as ``transfer.serve`` reads them."""
    return [(DEVICE, block, b"") for block in block_ids]


# ------------------------------------------------------------------ the client's side


def write_blocks(stub: Any, *, epoch: int, lease_id: str, generation: int, block_ids: Iterable[int], data: Any,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: float | None = None, grants: Iterable = ()) -> int:
    """Writes whole blocks into a worker's pool (``WriteBlocks``).

    Args:
        stub: a ``WorkerStub`` over a channel opened with ``CHANNEL_OPTIONS``.
        epoch, lease_id, generation: the pool's epoch, the lease the blocks are held
            under, the pool's generation as the allocator last said.
        block_ids: distinct device blocks of the pool.
        data: the blocks in order, ``len(block_ids) * bytes_per_block`` bytes: any object
            with the buffer protocol (bytes, memoryview, a numpy array) or a contiguous CPU
            tensor.
        chunk_bytes: bytes per message (64 KiB to 16 MiB).
        timeout: seconds (None: 10 s plus the bytes at 20 MB/s).

    Returns:
        The blocks written (all of them).

    Raises:
        kvservice.errors.KvsError: the worker's refusal (InvalidArgument,
            FailedPrecondition with reason EPOCH_CHANGED, LEASE_EXPIRED or ROLLED_BACK,
            PermissionDenied...). The blocks named may then hold partial content: commit
            none of them.
    """
    ids = list(block_ids)
    chunk = check_chunk_bytes(chunk_bytes)
    view = _bytes_of(data, writable=False)
    if (len(view) % len(ids) if ids else len(view)):
        raise errors.InvalidArgument(f"{len(view)} bytes of data are not {len(ids)} blocks of one size")
    size = len(view) // len(ids) if ids else 0
    first = pb.WriteBlocksRequest(epoch=epoch, lease_id=lease_id, generation=generation, block_ids=ids,
                                  grants=list(grants))

    def requests():
        message = first
        if size:
            with warnings.catch_warnings():     # (a read-only buffer: only read)
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(view, dtype=torch.uint8)

            def read(tier: int, position: int, tag: bytes) -> torch.Tensor:
                return flat[position * size:(position + 1) * size]

            for part in pieces(device_refs(list(range(len(ids)))), read, chunk):
                message.chunk.pieces.extend(pb.BlockPiece(position=p.position, offset=p.offset, data=bytes(p.data),
                                                          last=p.last, checksum=p.checksum) for p in part)
                yield message
                message = pb.WriteBlocksRequest()
        if message is first:
            yield first

    try:
        return stub.WriteBlocks(requests(), timeout=_timeout(timeout, len(view))).num_written
    except grpc.RpcError as exc:
        raise to_domain_error(exc) from None


def read_blocks(stub: Any, *, epoch: int, block_ids: Iterable[int], bytes_per_block: int, out: Any = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: float | None = None, lease_id: str = "",
                grants: Iterable = ()) -> Any:
    """Reads whole blocks of a worker's pool (``ReadBlocks``), each checked against its
    checksum.

    Args:
        stub: a ``WorkerStub`` over a channel opened with ``CHANNEL_OPTIONS``.
        epoch: the pool's epoch.
        block_ids: device blocks of the pool (a block may be named twice).
        bytes_per_block: the pool's (``WorkerInfo.bytes_per_block``).
        out: a writable buffer of ``len(block_ids) * bytes_per_block`` bytes to fill (a
            bytearray, a numpy array, a contiguous CPU tensor); None: a new bytearray.
        chunk_bytes: bytes per message (64 KiB to 16 MiB).
        timeout: seconds (None: 10 s plus the bytes at 20 MB/s).

    Returns:
        ``out`` (or the new bytearray), the blocks in the order of ``block_ids``.

    Raises:
        kvservice.errors.KvsError: the worker's refusal (InvalidArgument, FailedPrecondition
            with reason EPOCH_CHANGED, PermissionDenied...), or a block that did not come
            whole with its checksum (a KvsError, code INTERNAL); ``out`` may then hold part
            of the blocks.
    """
    ids = list(block_ids)
    request = pb.ReadBlocksRequest(epoch=epoch, block_ids=ids, chunk_bytes=check_chunk_bytes(chunk_bytes),
                                   lease_id=lease_id, grants=list(grants))
    size = len(ids) * bytes_per_block
    if out is None:
        out = bytearray(size)
    view = _bytes_of(out, writable=True)
    if len(view) != size:
        raise errors.InvalidArgument(f"out has {len(view)} bytes, {len(ids)} blocks of {bytes_per_block} take {size}")
    got = Assembler(len(ids), bytes_per_block)
    call = stub.ReadBlocks(request, timeout=_timeout(timeout, size))
    try:
        for message in call:
            for position, data, error, digest in got.feed(from_message(message)):
                error = error or verify(data, digest)
                if error:
                    raise _corrupt(ids, position, error)
                view[position * bytes_per_block:(position + 1) * bytes_per_block] = data
    except grpc.RpcError as exc:
        raise to_domain_error(exc) from None
    except errors.KvsError:
        call.cancel()
        raise
    missing = got.missing(ENDED)
    if missing:
        raise _corrupt(ids, missing[0][0], missing[0][2])
    return out


def _corrupt(ids: list[int], position: int, why: str) -> errors.KvsError:
    block = f" = {ids[position]}" if position < len(ids) else ""
    return errors.KvsError(f"ReadBlocks: block_ids[{position}]{block} did not come whole and intact: {why}")


def _bytes_of(data: Any, writable: bool) -> memoryview:
    """A flat byte view of ``data`` (the buffer protocol, or a contiguous CPU tensor), no copy."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise errors.InvalidArgument(f"a tensor of blocks must be contiguous on the CPU, not on {data.device}")
        data = data.detach().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(data)
    if writable and view.readonly:
        raise errors.InvalidArgument("out is read-only")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _timeout(asked: float | None, nbytes: int) -> float:
    return asked if asked is not None else PULL_SECONDS + nbytes / PULL_RATE


__all__ = ["CHANNEL_OPTIONS", "StoreCounts", "check_block_ids", "device_refs", "read_blocks", "receive",
           "write_blocks"]
