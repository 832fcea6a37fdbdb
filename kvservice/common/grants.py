"""Grants: the allocator's proof, checked by a worker, of which blocks a lease may touch.

The allocator alone knows who holds which block; a worker holds the bytes. Each time the
allocator gives a lease blocks of a pool (a create, a step's appends and copies on write,
a reserve, a resync), it signs a **grant**: the pool, its epoch and generation, the lease
and its tenant, the blocks the lease may write (those it allocated: private until shared)
and those it may only read (cached blocks it shares), and the grant's **serial**, a
counter of the pool that every grant raises. The signature is an HMAC-SHA256 under the
pool's **grant key**, which the allocator draws at each registration and hands to the
pool's worker in the RegisterPool reply (over the deployment's mTLS): a new epoch, a new
key, and every grant of the old one is worthless.

A holder sends its grants with its data-plane calls; the worker verifies each once (a few
microseconds, no Redis) and keeps per block who may write it and who may read it
(``worker/rights.py``). The serial orders grants of one block: a block that changed hands
(freed, then allocated to another lease) has a newer grant, and the worker honours no
older grant of another lease for it from the moment it has seen the newer one.

The same key signs the allocator's **orders** to the pool's worker that others carry: a
fetch order (``order_mac("pull", pull_fields(...))``) names a block or entry of the pool,
the pool it goes to and the pool's serial when it was pinned; the pool's worker serves a
pull only for blocks with such an order, to the worker of the pool it names, and not a
device block granted to a writer since that serial (it may hold other bytes by then). A
tier order (``order_mac("move", move_fields(...))``: a copy of a device block down a tier,
a load back, a move between the lower tiers) names its source, its destination and the
hash the entry is to hold; the pool's worker runs no move without one, and copies no device
block written under a grant as new as the order's serial (its bytes are no longer those of
the hash). ``SettleTiers`` takes the same orders back: the allocator settles an entry, or
forgets the hash of a block a load or fetch failed to fill, only on an order it gave.

Encoding: every field is tagged and length-prefixed before it is hashed, so that no two
different field lists hash the same bytes; block ids travel as little-endian uint32 arrays
(``pack_blocks``).
"""

from __future__ import annotations

import array
import hashlib
import hmac
import secrets
import sys
from dataclasses import dataclass
from typing import Iterable, Sequence

#: The grant key's length (bytes).
KEY_BYTES = 32
#: A MAC's length (the first bytes of the HMAC-SHA256).
MAC_BYTES = 16
#: Domain separation of what a key signs.
GRANT = b"kvservice grant v1"
ORDER = b"kvservice order v1"
#: A block id in a grant: 4 bytes, little-endian (the standard library's, so that the
#: allocator needs no numpy).
_BLOCK = "I" if array.array("I").itemsize == 4 else "L"


def new_key() -> bytes:
    """A fresh grant key (the allocator's, one per pool epoch)."""
    return secrets.token_bytes(KEY_BYTES)


def pack_blocks(blocks: Iterable[int]) -> bytes:
    """Block ids as the bytes a grant carries (little-endian uint32)."""
    try:
        arr = array.array(_BLOCK, blocks)
    except OverflowError:
        raise ValueError("a block id is out of 0 .. 2^32 - 1") from None
    if arr.itemsize != 4 or (arr and max(arr) >= 1 << 32):
        raise ValueError("a block id is out of 0 .. 2^32 - 1")
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def unpack_blocks(data: bytes, what: str = "blocks") -> array.array:
    """The block ids of ``pack_blocks``'s bytes.

    Raises:
        ValueError: not a whole number of ids.
    """
    if len(data) % 4:
        raise ValueError(f"{what}: {len(data)} bytes is not a whole number of 4-byte block ids")
    arr = array.array(_BLOCK)
    arr.frombytes(data)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr


def _mac(key: bytes, domain: bytes, fields: Sequence[int | str | bytes]) -> bytes:
    h = hmac.new(key, domain, hashlib.sha256)
    for f in fields:
        if isinstance(f, bool) or not isinstance(f, (int, str, bytes, bytearray, memoryview)):
            raise TypeError(f"a signed field is an int, a str or bytes, got {type(f).__name__}")
        if isinstance(f, int):
            tag, data = b"i", f.to_bytes(8, "little", signed=True)
        elif isinstance(f, str):
            tag, data = b"s", f.encode()
        else:
            tag, data = b"b", bytes(f)
        h.update(tag + len(data).to_bytes(4, "little") + data)
    return h.digest()[:MAC_BYTES]


@dataclass(frozen=True, slots=True)
class Grant:
    """What one lease may touch in one pool, as of ``serial``: blocks it may write (and
    read), blocks it may only read. ``write`` and ``read`` are ``pack_blocks`` bytes."""

    pool_id: str
    epoch: int
    generation: int
    lease_id: str
    tenant: str
    serial: int
    write: bytes = b""
    read: bytes = b""
    mac: bytes = b""

    def fields(self) -> tuple:
        return (self.pool_id, self.epoch, self.generation, self.lease_id, self.tenant, self.serial, self.write,
                self.read)

    def signed(self, key: bytes) -> "Grant":
        """This grant with its MAC under ``key``."""
        return Grant(*self.fields(), mac=_mac(key, GRANT, self.fields()))

    def valid(self, key: bytes) -> bool:
        """Whether its MAC is the one ``key`` gives (constant time)."""
        return len(self.mac) == MAC_BYTES and hmac.compare_digest(self.mac, _mac(key, GRANT, self.fields()))

    @classmethod
    def from_pb(cls, g) -> "Grant":
        return cls(g.pool_id, g.epoch, g.generation, g.lease_id, g.tenant, g.serial, g.write_blocks, g.read_blocks,
                   g.mac)

    def to_pb(self, pb_module):
        return pb_module.Grant(pool_id=self.pool_id, epoch=self.epoch, generation=self.generation,
                               lease_id=self.lease_id, tenant=self.tenant, serial=self.serial,
                               write_blocks=self.write, read_blocks=self.read, mac=self.mac)


def pull_fields(source_pool: str, source_epoch: int, dst_pool: str, serial: int, tier: int, index: int,
                block_hash: bytes) -> tuple:
    """The fields a fetch order's MAC covers: which block (or entry) of which source pool
    and epoch goes to which pool, as of which serial of the source."""
    return (source_pool, source_epoch, dst_pool, serial, tier, index, block_hash)


def move_fields(pool: str, epoch: int, serial: int, src_tier: int, src: int, dst_tier: int, dst: int,
                block_hash: bytes) -> tuple:
    """The fields a tier order's MAC covers (a copy down a tier, a load, a move between the
    lower tiers): which block or entry of which pool and epoch goes where, under which hash,
    as of which serial of the pool."""
    return (pool, epoch, serial, src_tier, src, dst_tier, dst, block_hash)


def order_mac(key: bytes, kind: str, fields: Sequence[int | str | bytes]) -> bytes:
    """The MAC of an allocator's order of ``kind`` (e.g. "move", "pull") over its fields."""
    return _mac(key, ORDER, (kind, *fields))


def order_valid(key: bytes, kind: str, fields: Sequence[int | str | bytes], mac: bytes) -> bool:
    """Whether ``mac`` is the order's MAC under ``key`` (constant time)."""
    return len(mac) == MAC_BYTES and hmac.compare_digest(mac, order_mac(key, kind, fields))


__all__ = ["GRANT", "Grant", "KEY_BYTES", "MAC_BYTES", "ORDER", "move_fields", "new_key", "order_mac", "order_valid",
           "pack_blocks", "pull_fields", "unpack_blocks"]
