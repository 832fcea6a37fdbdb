"""Prefix-cache block hashes.

A block's hash chains its parent's hash with its token ids:
``h_i = BLAKE2b-128(h_{i-1} || token ids as little-endian uint32)``. The chain starts at a
root that mixes in a salt (the tenant's name by default, so two tenants never share cache
entries) and an optional per-sequence extra key (an adapter id, an image digest...).
Python's ``hash()`` is never used: it is salted per process and not collision resistant.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b
from sys import byteorder

HASH_BYTES = 16


def root_hash(salt: str, extra_key: bytes = b"") -> bytes:
    """The chain root for one tenant (salt) and one extra key."""
    h = blake2b(b"kvservice-root\0", digest_size=HASH_BYTES)
    h.update(len(salt.encode()).to_bytes(4, "little"))
    h.update(salt.encode())
    h.update(extra_key)
    return h.digest()


def _token_bytes(token_ids) -> bytes:
    packed = array("I", token_ids)
    if byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        packed.byteswap()
    return packed.tobytes()


def block_hash(parent: bytes, token_ids) -> bytes:
    """Hash of one full block, given its parent's hash."""
    return blake2b(parent + _token_bytes(token_ids), digest_size=HASH_BYTES).digest()


def chain_hashes(parent: bytes, token_ids, block_size: int, num_blocks: int) -> list[bytes]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids``, chained from ``parent``."""
    data = _token_bytes(token_ids)
    width = 4 * block_size
    out = []
    for i in range(num_blocks):
        parent = blake2b(parent + data[i * width:(i + 1) * width], digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out
