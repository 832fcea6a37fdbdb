"""A pool's lower tiers on its worker: host memory, and a file on disk (DESIGN §12).

A tier is a fixed number of **entries**, each holding one block's bytes: every layer's K
then every layer's V of the block's slots (``[2, num_layers, num_kv_heads, block_size,
head_dim]`` in the pool's dtype, ``PoolShape.bytes_per_block`` bytes), with a CRC-32 of
those bytes written beside them. ``store`` copies a device block down into an entry and
returns its checksum; ``load`` copies an entry up into a device block after checking the
checksum, and raises ``LoadFailed`` (the block untouched) when the bytes are not the ones
stored: wrong KV is never served.

- ``HostTier``: one tensor of entries in host memory (pinned when the pool is on a CUDA
  device, so that copies can run on a side stream), gone with the process.
- ``DiskTier``: one preallocated file per pool, ``<dir>/<pool id>.kvtier``, read and
  written in whole entries (a 16-byte header, then the block). A header at the start of
  the file records the geometry; a file of another geometry is made anew. The entries
  survive a restart of their worker: a new process reads what an earlier one stored.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import torch

from worker.pool import KVPool, PoolShape
from worker import tensors

#: File header: magic, version, the geometry (num_layers, num_kv_heads, block_size,
#: head_dim, dtype name), the number of entries; padded to FILE_HEADER bytes.
FILE_MAGIC, FILE_VERSION, FILE_HEADER = b"KVTIER", 1, 4096
_FILE = struct.Struct("<6sHIIIIQ16s")
#: Entry header: magic, CRC-32 of the block's bytes, their length, 4 bytes reserved.
ENTRY_MAGIC = b"KVB1"
_ENTRY = struct.Struct("<4sIII")


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

    def store(self, entry: int, pool: KVPool, block: int) -> int:
        """Copies device ``block`` into ``entry``; returns the checksum written with it."""
        self._check(entry, pool, block)
        data = block_bytes(pool, block)
        crc = checksum(data)
        self._write(entry, data, crc)
        self.stored_blocks += 1
        return crc

    def load(self, entry: int, pool: KVPool, block: int, expected: int | None = None) -> None:
        """Copies ``entry`` into device ``block`` once its bytes match their checksum (and
        ``expected``, the checksum the caller was told at store time, when given).

        Raises:
            LoadFailed: the bytes do not match; ``block`` is unchanged.
        """
        self._check(entry, pool, block)
        try:
            data, crc = self._read(entry)
        except OSError as exc:
            self.load_failures += 1
            raise LoadFailed(f"{self.name} entry {entry}: unreadable ({exc})") from None
        actual = checksum(data)
        if actual != crc or (expected is not None and crc != expected):
            self.load_failures += 1
            want = crc if expected is None else expected
            raise LoadFailed(f"{self.name} entry {entry}: checksum {actual:#010x}, stored {want:#010x}")
        put_block(pool, block, data)
        self.loaded_blocks += 1

    def _check(self, entry: int, pool: KVPool, block: int) -> None:
        if pool.shape != self.shape:
            raise ValueError(f"the pool's geometry {pool.shape} is not the {self.name} tier's {self.shape}")
        if not 0 <= entry < self.num_entries:
            raise ValueError(f"{self.name} entry {entry} is out of range 0..{self.num_entries - 1}")
        if not 0 <= block < self.shape.num_blocks:
            raise ValueError(f"block {block} is out of range 0..{self.shape.num_blocks - 1}")

    def _write(self, entry: int, data: torch.Tensor, crc: int) -> None:
        raise NotImplementedError

    def _read(self, entry: int) -> tuple[torch.Tensor, int]:
        """The entry's bytes and the checksum stored with them."""
        raise NotImplementedError


class HostTier(Tier):
    """Entries in host memory (pinned for a CUDA pool); gone with the process."""

    name = "host"

    def __init__(self, shape: PoolShape, num_entries: int, *, pin: bool = False) -> None:
        super().__init__(shape, num_entries)
        self.data = torch.empty((num_entries, shape.bytes_per_block), dtype=torch.uint8, pin_memory=pin)
        self.checksums = [None] * num_entries

    def _write(self, entry: int, data: torch.Tensor, crc: int) -> None:
        self.data[entry].copy_(data)
        self.checksums[entry] = crc

    def _read(self, entry: int) -> tuple[torch.Tensor, int]:
        crc = self.checksums[entry]
        if crc is None:
            raise OSError("never stored")
        return self.data[entry].clone(), crc


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
                os.posix_fallocate(fd, 0, size)
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

    def _write(self, entry: int, data: torch.Tensor, crc: int) -> None:
        head = _ENTRY.pack(ENTRY_MAGIC, crc, data.numel(), 0)
        os.pwritev(self.fd, [head, data.numpy()], self._offset(entry))

    def _read(self, entry: int) -> tuple[torch.Tensor, int]:
        raw = os.pread(self.fd, self.stride, self._offset(entry))
        if len(raw) != self.stride:
            raise OSError(f"short read: {len(raw)} of {self.stride} bytes")
        magic, crc, length, _ = _ENTRY.unpack_from(raw)
        if magic != ENTRY_MAGIC or length != self.shape.bytes_per_block:
            raise OSError("never stored" if magic != ENTRY_MAGIC else f"length {length}")
        return torch.frombuffer(bytearray(raw[_ENTRY.size:]), dtype=torch.uint8), crc
