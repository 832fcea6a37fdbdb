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

from kvservice.errors import InvalidArgument

HASH_BYTES = 16
#: Token ids are in 0..MAX_TOKEN_ID (they travel as int64; the hashes take them as uint32).
MAX_TOKEN_ID = 2**31 - 1


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


def token_bytes_checked(token_ids, what: str) -> bytes:
    """The ids as little-endian uint32 bytes (what the hashes take), after checking each is
    in 0..2^31-1: InvalidArgument names the first one that is not and ``what`` it belongs
    to. In C for valid input: unsigned 32-bit packing refuses negative ids and ids of 2^32
    or more, and the top bit of each packed id is 0 for those below 2^31."""
    try:
        # (a protobuf repeated field is sliced into a list first: array() reads a list in
        # half the time)
        packed = array("I", token_ids if token_ids.__class__ is list else token_ids[:])
    except (OverflowError, TypeError):
        packed = None
    if packed is not None and byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        packed.byteswap()
    data = packed.tobytes() if packed is not None else b""
    if packed is None or (data and max(data[3::4]) >= 0x80):
        bad = next(t for t in token_ids if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID)
        raise InvalidArgument(f"{what}: token id {bad} is outside 0..{MAX_TOKEN_ID}")
    return data


def block_hash_checked(parent: bytes, token_ids, what: str) -> bytes:
    """``block_hash`` after ``token_bytes_checked``."""
    return blake2b(parent + token_bytes_checked(token_ids, what), digest_size=HASH_BYTES).digest()


def chain_hashes(parent: bytes, token_ids, block_size: int, num_blocks: int) -> list[bytes]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids`` (ids, or their
    bytes from ``token_bytes_checked``), chained from ``parent``."""
    data = token_ids if isinstance(token_ids, bytes) else _token_bytes(token_ids)
    return chain_runs(parent, data, block_size, [num_blocks])


def chain_runs(parents: bytes, data: bytes, block_size: int, runs: list[int]) -> list[bytes]:
    """The hashes of consecutive runs of full blocks: run ``i`` has ``runs[i]`` blocks of
    ``data`` (bytes from ``token_bytes_checked``, the runs one after the other) chained
    from the ``i``-th ``HASH_BYTES`` of ``parents``. One flat list, in order."""
    width, hb = 4 * block_size, HASH_BYTES
    out = []
    append = out.append
    off = 0
    for i, c in enumerate(runs):
        parent = parents[i * hb:(i + 1) * hb]
        for _ in range(c):
            parent = blake2b(parent + data[off:off + width], digest_size=HASH_BYTES).digest()
            append(parent)
            off += width
    return out


def sequence_tag(lease_id: str, pool_id: str, epoch: int, n: int) -> str:
    """The unguessable part of a sequence id (``<pool>/<epoch>/<n>-<tag>``): a hash keyed
    by the lease that holds the sequence, whose id only its tenant sees. Whoever lacks the
    lease cannot name the sequence; the allocator checks it against the record's lease
    without storing it."""
    return blake2b(f"{pool_id}/{epoch}/{n}".encode(), key=lease_id.encode()[:64], digest_size=6).hexdigest()


def sequence_id(pool_id: str, epoch: int, n: int, lease_id: str) -> str:
    """A sequence's id as the service hands it out."""
    return f"{pool_id}/{epoch}/{n}-{sequence_tag(lease_id, pool_id, epoch, n)}"
