"""A pool's lower tiers on its worker: host memory, and a file on disk (DESIGN §12).

A tier is a fixed number of **entries**, each holding one block's bytes: every layer's K
then every layer's V of the block's slots (``[2, num_layers, num_kv_heads, block_size,
head_dim]`` in the pool's dtype, ``PoolShape.bytes_per_block`` bytes), with a CRC-32 of
those bytes and the block's hash (its content's name: the allocator's chained hash)
written beside them. ``store`` copies a device block down into an entry and returns its
checksum; ``load`` copies an entry up into a device block after checking the checksum and
the hash, and raises ``LoadFailed`` (the block untouched) when the bytes are not the ones
stored, or not the content asked for: wrong KV is never served. ``Tiers`` runs the
allocator's orders (``MoveBlocks``) over a pool's tiers.

- ``HostTier``: one tensor of entries in host memory (pinned when the pool is on a CUDA
  device, so that copies can run on a side stream), gone with the process.
- ``DiskTier``: one preallocated file per pool, ``<dir>/<pool id>.kvtier``, read and
  written in whole entries (a 16-byte header, then the block). A header at the start of
  the file records the geometry; a file of another geometry is made anew. The entries
  survive a restart of their worker: a new process reads what an earlier one stored.
"""

from __future__ import annotations

import os
import shutil
import struct
import zlib
from pathlib import Path

import torch

from worker.pool import KVPool, PoolShape
from worker import tensors

#: File header: magic, version, the geometry (num_layers, num_kv_heads, block_size,
#: head_dim, dtype name), the number of entries; padded to FILE_HEADER bytes.
FILE_MAGIC, FILE_VERSION, FILE_HEADER = b"KVTIER", 2, 4096
_FILE = struct.Struct("<6sHIIIIQ16s")
#: Entry header: magic, CRC-32 of the block's bytes, their length, 4 bytes reserved, the
#: block's hash (16 bytes).
ENTRY_MAGIC = b"KVB2"
_ENTRY = struct.Struct("<4sIII16s")
#: Tier codes of the allocator's orders (TierOrder, BlockMove).
DEVICE, HOST, DISK = 0, 1, 2


class LoadFailed(Exception):
    """An entry's bytes are not what was stored (checksum or length mismatch, never
    stored, unreadable): the device block was not written."""


def block_bytes(pool: KVPool, block: int) -> torch.Tensor:
    """A device block's bytes as a contiguous uint8 CPU tensor (``bytes_per_block``)."""
    kv = torch.stack([pool.k_caches[:, block], pool.v_caches[:, block]])      # [2, L, H, B, D]
    return kv.contiguous().view(torch.uint8).reshape(-1).cpu()


def put_block(pool: KVPool, block: int, data: torch.Tensor) -> None:
    """Writes ``bytes_per_block`` bytes (uint8) into a device block, every layer's K and V."""
    s = pool.shape
    kv = data.to(pool.device).view(s.dtype).view(2, s.num_layers, s.num_kv_heads, s.block_size, s.head_dim)
    pool.k_caches[:, block].copy_(kv[0])
    pool.v_caches[:, block].copy_(kv[1])


def checksum(data: torch.Tensor) -> int:
    """CRC-32 of a contiguous uint8 CPU tensor's bytes."""
    return zlib.crc32(data.numpy())


def entries_for_budget(budget_bytes: int, shape: PoolShape) -> int:
    """How many entries a tier of ``budget_bytes`` holds."""
    return max(0, budget_bytes // shape.bytes_per_block)


class Tier:
    """Entries ``0 .. num_entries - 1`` of one tier; a subclass keeps the bytes."""

    name = ""

    def __init__(self, shape: PoolShape, num_entries: int) -> None:
        if num_entries < 1:
            raise ValueError(f"a {self.name} tier needs at least one entry, got {num_entries}")
        self.shape = shape
        self.num_entries = num_entries
        self.stored_blocks = self.loaded_blocks = self.load_failures = 0

    def store(self, entry: int, pool: KVPool, block: int, tag: bytes = b"") -> int:
        """Copies device ``block`` into ``entry`` under ``tag`` (the block's hash); returns
        the checksum written with it."""
        self._check(entry, pool, block)
        return self.put(entry, block_bytes(pool, block), tag)

    def put(self, entry: int, data: torch.Tensor, tag: bytes = b"") -> int:
        """Writes a block's bytes (uint8, ``bytes_per_block``) into ``entry`` under ``tag``."""
        if not 0 <= entry < self.num_entries:
            raise ValueError(f"{self.name} entry {entry} is out of range 0..{self.num_entries - 1}")
        crc = checksum(data)
        self._write(entry, data, crc, _tag(tag))
        self.stored_blocks += 1
        return crc

    def get(self, entry: int, tag: bytes | None = None, expected: int | None = None) -> torch.Tensor:
        """The bytes of ``entry``, once they match their checksum (and ``expected``, the
        checksum the caller was told at store time, and ``tag``, the hash they were
        stored under, when given).

        Raises:
            LoadFailed: unreadable, or the bytes or the tag do not match.
        """
        if not 0 <= entry < self.num_entries:
            raise ValueError(f"{self.name} entry {entry} is out of range 0..{self.num_entries - 1}")
        try:
            data, crc, stored_tag = self._read(entry)
        except OSError as exc:
            self.load_failures += 1
            raise LoadFailed(f"{self.name} entry {entry}: unreadable ({exc})") from None
        actual = checksum(data)
        if actual != crc or (expected is not None and crc != expected):
            self.load_failures += 1
            want = crc if expected is None else expected
            raise LoadFailed(f"{self.name} entry {entry}: checksum {actual:#010x}, stored {want:#010x}")
        if tag is not None and stored_tag != _tag(tag):
            self.load_failures += 1
            # (the stored hash is not told: it may be another tenant's)
            raise LoadFailed(f"{self.name} entry {entry} holds another block than the one asked for (another hash)")
        return data

    def load(self, entry: int, pool: KVPool, block: int, expected: int | None = None,
             tag: bytes | None = None) -> None:
        """Copies ``entry`` into device ``block`` once its bytes pass ``get``'s checks.

        Raises:
            LoadFailed: the bytes do not match; ``block`` is unchanged.
        """
        self._check(entry, pool, block)
        put_block(pool, block, self.get(entry, tag, expected))
        self.loaded_blocks += 1

    def _check(self, entry: int, pool: KVPool, block: int) -> None:
        if pool.shape != self.shape:
            raise ValueError(f"the pool's geometry {pool.shape} is not the {self.name} tier's {self.shape}")
        if not 0 <= entry < self.num_entries:
            raise ValueError(f"{self.name} entry {entry} is out of range 0..{self.num_entries - 1}")
        if not 0 <= block < self.shape.num_blocks:
            raise ValueError(f"block {block} is out of range 0..{self.shape.num_blocks - 1}")

    def _write(self, entry: int, data: torch.Tensor, crc: int, tag: bytes) -> None:
        raise NotImplementedError

    def _read(self, entry: int) -> tuple[torch.Tensor, int, bytes]:
        """The entry's bytes, and the checksum and tag stored with them."""
        raise NotImplementedError


class HostTier(Tier):
    """Entries in host memory (pinned for a CUDA pool); gone with the process."""

    name = "host"

    def __init__(self, shape: PoolShape, num_entries: int, *, pin: bool = False) -> None:
        super().__init__(shape, num_entries)
        self.data = torch.empty((num_entries, shape.bytes_per_block), dtype=torch.uint8, pin_memory=pin)
        self.checksums: list[tuple[int, bytes] | None] = [None] * num_entries

    def _write(self, entry: int, data: torch.Tensor, crc: int, tag: bytes) -> None:
        self.data[entry].copy_(data)
        self.checksums[entry] = (crc, tag)

    def _read(self, entry: int) -> tuple[torch.Tensor, int, bytes]:
        stored = self.checksums[entry]
        if stored is None:
            raise OSError("never stored")
        return self.data[entry].clone(), stored[0], stored[1]


class DiskTier(Tier):
    """Entries in one preallocated file, ``<directory>/<pool_id>.kvtier``; they survive a
    restart of the worker (a file of another geometry is made anew)."""

    name = "disk"

    def __init__(self, shape: PoolShape, num_entries: int, directory: str | Path, pool_id: str) -> None:
        super().__init__(shape, num_entries)
        self.path = Path(directory) / f"{pool_id}.kvtier"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stride = _ENTRY.size + shape.bytes_per_block
        header = _FILE.pack(FILE_MAGIC, FILE_VERSION, shape.num_layers, shape.num_kv_heads, shape.block_size,
                            shape.head_dim, num_entries, tensors.NAMES[shape.dtype].encode())
        size = FILE_HEADER + num_entries * self.stride
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.pread(fd, len(header), 0) != header or os.fstat(fd).st_size != size:
                os.ftruncate(fd, 0)             # (another geometry, or none: made anew, empty)
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.ftruncate(fd, 0)
                    free = shutil.disk_usage(self.path.parent).free
                    raise OSError(exc.errno, f"the disk tier's file {self.path} needs {size / 1e9:.2f} GB and "
                                             f"its file system has {free / 1e9:.2f} GB free: {exc.strerror}; "
                                             f"give it less (disk_tier_gb) or room") from None
                os.pwrite(fd, header, 0)
                #: Whether the file was made anew (no entry of an earlier process is kept).
                self.created = True
            else:
                self.created = False
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _offset(self, entry: int) -> int:
        return FILE_HEADER + entry * self.stride

    def _write(self, entry: int, data: torch.Tensor, crc: int, tag: bytes) -> None:
        head = _ENTRY.pack(ENTRY_MAGIC, crc, data.numel(), 0, tag)
        os.pwritev(self.fd, [head, data.numpy()], self._offset(entry))

    def _read(self, entry: int) -> tuple[torch.Tensor, int, bytes]:
        raw = os.pread(self.fd, self.stride, self._offset(entry))
        if len(raw) != self.stride:
            raise OSError(f"short read: {len(raw)} of {self.stride} bytes")
        magic, crc, length, _, tag = _ENTRY.unpack_from(raw)
        if magic != ENTRY_MAGIC or length != self.shape.bytes_per_block:
            raise OSError("never stored" if magic != ENTRY_MAGIC else f"length {length}")
        return torch.frombuffer(bytearray(raw[_ENTRY.size:]), dtype=torch.uint8), crc, tag


def _tag(tag: bytes) -> bytes:
    """A block hash as stored beside an entry: 16 bytes (shorter ones zero-padded)."""
    if len(tag) > 16:
        raise ValueError(f"a block hash has at most 16 bytes, got {len(tag)}")
    return tag.ljust(16, b"\0")


class Tiers:
    """A pool's lower tiers on its worker, and the orders that move blocks between them
    and the device (``MoveBlocks``; DESIGN §12).

    Args:
        pool: the device pool.
        host: the host tier (None: none).
        disk: the disk tier (None: none).
    """

    def __init__(self, pool: KVPool, host: HostTier | None = None, disk: DiskTier | None = None) -> None:
        self.pool = pool
        self.by_code: dict[int, Tier] = {c: t for c, t in ((HOST, host), (DISK, disk)) if t is not None}
        #: Blocks and bytes moved, per (src tier, dst tier) code pair; failed moves per pair.
        self.moved: dict[tuple[int, int], int] = {}
        self.moved_bytes: dict[tuple[int, int], int] = {}
        self.failed: dict[tuple[int, int], int] = {}
        self._stream = None

    @property
    def host(self) -> HostTier | None:
        return self.by_code.get(HOST)      # type: ignore[return-value]

    @property
    def disk(self) -> DiskTier | None:
        return self.by_code.get(DISK)      # type: ignore[return-value]

    def _tier(self, code: int) -> Tier:
        tier = self.by_code.get(code)
        if tier is None:
            raise LoadFailed(f"this worker has no {'host' if code == HOST else 'disk' if code == DISK else code} "
                             f"tier (start it with --host-tier-gb / --disk-tier-dir)")
        return tier

    def move(self, src_tier: int, src: int, dst_tier: int, dst: int, tag: bytes) -> None:
        """One order: device -> tier (a copy down), tier -> tier (host -> disk), tier ->
        device (a load, checked against the entry's checksum and ``tag``).

        Raises:
            LoadFailed: the source's bytes are not the block asked for, or no such tier.
            ValueError: an index out of range, or a device -> device order.
        """
        if src_tier == DEVICE and dst_tier == DEVICE:
            raise ValueError("a device -> device order is a copy (CopyBlocks), not a move")
        if dst_tier == DEVICE:
            self._tier(src_tier).load(src, self.pool, dst, tag=tag)
        elif src_tier == DEVICE:
            self._tier(dst_tier).store(dst, self.pool, src, tag)
        else:
            self._tier(dst_tier).put(dst, self._tier(src_tier).get(src, tag), tag)
        pair = (src_tier, dst_tier)
        self.moved[pair] = self.moved.get(pair, 0) + 1
        self.moved_bytes[pair] = self.moved_bytes.get(pair, 0) + self.pool.shape.bytes_per_block

    def run(self, moves: list[tuple[int, int, int, int, bytes]]) -> list[str]:
        """Runs orders in the order given; returns one error per order ("" where it was
        carried out). A failed order changes nothing (its destination is left as it was)."""
        if self.pool.device.type == "cuda":       # (a side stream, after the forwards queued so far)
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.pool.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            with torch.cuda.stream(self._stream):
                out = self._run(moves)
            self._stream.synchronize()
            return out
        return self._run(moves)

    def _run(self, moves: list[tuple[int, int, int, int, bytes]]) -> list[str]:
        out = []
        for src_tier, src, dst_tier, dst, tag in moves:
            try:
                self.move(src_tier, src, dst_tier, dst, tag)
                out.append("")
            except (LoadFailed, ValueError) as exc:
                pair = (src_tier, dst_tier)
                self.failed[pair] = self.failed.get(pair, 0) + 1
                out.append(str(exc) or type(exc).__name__)
        return out

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
