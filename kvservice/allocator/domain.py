"""Small result and request objects passed between the allocator's layers (no gRPC, no Redis).

The pool geometry is shared with the workers: ``kvservice.common.geometry``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvservice import errors
from kvservice.common import hashing
from kvservice.common.settings import TENANT_NAME, echo

if TYPE_CHECKING:
    from kvservice.common.geometry import Geometry

LEASE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
TENANT = TENANT_NAME
REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


@dataclass(frozen=True, slots=True)
class Commit:
    """One full block to register in the prefix cache."""

    index: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Update:
    """What one step does to one existing sequence (see SeqUpdate in the proto)."""

    sequence_id: str
    num_tokens: int = -1          # -1: the allocator's view
    parent_hash: bytes = b""
    commits: tuple[Commit, ...] = ()
    free: bool = False
    fork_grow_to: tuple[int, ...] = ()
    grow_to: int = 0


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A heartbeat's outcome: the pool's epoch, the Redis time (ms), and the leases that
    expired or were revoked in the pool since the worker's cursor (``dead_until_ms`` is
    the next cursor)."""

    epoch: int
    heartbeat_ms: int
    dead_leases: list[str]
    dead_until_ms: int
    #: the pool's generation (lib/generation.lua): the worker refuses writes of any other
    generation: int = 0


@dataclass(frozen=True, slots=True)
class Create:
    token_ids: tuple[int, ...]
    pool_id: str = ""
    extra_key: bytes = b""
    #: the caller runs the step's lower-tier loads (StepRequest.tier_loads)
    tier_loads: bool = False
    #: the caller runs fetches from other pools' workers (StepRequest.fetches)
    fetches: bool = False
    #: the blocks past the cached prefix get their hashes from later commits (CreateOp.defer_commits)
    defer_commits: bool = False
    #: "" (the engine's pools) or "store": where a create without pool_id is placed
    pool_role: str = ""


@dataclass(slots=True)
class SeqState:
    """A sequence as the allocator knows it."""

    sequence_id: str
    pool_id: str
    epoch: int
    lease_id: str
    block_table: list[int]
    num_tokens: int
    num_cached_tokens: int
    num_committed_blocks: int
    last_hash: bytes
    cow: tuple[int, int] | None = None
    block_size: int = 0
    #: Only for a sequence just created: the hash of each committed block.
    block_hashes: tuple[bytes, ...] = ()


@dataclass(slots=True)
class SeqDelta:
    """How one step changed an existing sequence."""

    sequence_id: str
    num_tokens: int
    new_blocks: list[int]
    cow: tuple[int, int] | None
    num_committed_blocks: int
    last_hash: bytes
    children: list[SeqState] = field(default_factory=list)
    freed: bool = False


@dataclass(slots=True)
class StepOutcome:
    """Results in request order; None where the item's pool failed."""

    updates: list[SeqDelta | None]
    created: list[SeqState | None]
    copies: list[tuple[str, int, int]]
    #: (an error's partial outcome) the pools whose part was refused
    failed_pools: list[str] = field(default_factory=list)
    #: the generation of each pool whose part was applied
    generations: dict[str, int] = field(default_factory=dict)
    #: lower-tier orders and fetches (``Order``)
    tier_orders: list[Order] = field(default_factory=list)
    #: per pool whose part gave the lease blocks: the signed grant of them (``grants.Grant``)
    grants: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class JournalColumns:
    """A run of journal entries, one list per field (``JournalEntries`` in the proto)."""

    kinds: list[int] = field(default_factory=list)
    sequences: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    num_blocks: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_commits: list[int] = field(default_factory=list)
    commit_tokens: list[int] = field(default_factory=list)
    parent_hashes: bytes = b""

    def __len__(self) -> int:
        return len(self.kinds)


@dataclass(frozen=True, slots=True)
class SequenceClaim:
    """A sequence as a client holds it, in a resync (``SequenceClaim`` in the proto)."""

    sequence: int
    num_tokens: int
    block_table: tuple[int, ...]
    num_committed_blocks: int
    last_hash: bytes
    block_hashes: bytes
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ReserveRequest:
    """What a Sync asks of one pool's reserve (see PoolSync in the proto)."""

    pool_id: str
    epoch: int
    want_blocks: int = 0
    returned_blocks: tuple[int, ...] = ()
    first_entry: int = 1
    #: The journal entries from ``first_entry`` on.
    entries: "JournalColumns | None" = None
    want_sequence_numbers: int = 0
    need_blocks: int = 0
    #: Instead of entries: the lease's whole state in the pool (``PoolResync``).
    resync: "tuple[SequenceClaim, ...] | None" = None
    #: The pool's generation as the client heard it (0: none).
    generation: int = 0


@dataclass(frozen=True, slots=True)
class ReserveGrant:
    """A lease's reserve in one pool after a Sync."""

    pool_id: str
    epoch: int
    granted_blocks: list[int]
    num_reserved_blocks: int
    reserve_cap: int
    applied_entries: int = 0
    first_sequence_number: int = 0
    num_sequence_numbers: int = 0
    #: After a resync: the sequences the pool could not keep, and the lease's reserve.
    lost_sequences: tuple[int, ...] = ()
    reserve_blocks: tuple[int, ...] = ()
    resynced: bool = False
    #: The quota ("blocks", "sequences") that kept the grant below what was needed now, and its limit.
    quota: str = ""
    quota_limit: int = 0
    #: The pool's generation; ``rolled_back``: the client's was another one (nothing applied).
    generation: int = 0
    rolled_back: bool = False
    #: copies down a tier of the blocks the refill evicted (StepOutcome.tier_orders)
    tier_orders: tuple[Order, ...] = ()
    #: the signed grant of ``granted_blocks`` (``grants.Grant``; None: none granted)
    grant: Any = None


class Order(NamedTuple):
    """An order to a pool's worker (TierOrder): a move between its tiers (a copy of a device
    block down a tier, a load back, a move between the lower tiers), or a fetch of a block
    another pool's worker holds (``source_pool_id`` set). ``serial``: the pool's change
    counter the order holds as of (a fetch's: the source pool's when the block was pinned).
    ``order_mac``: the allocator's MAC (``Allocator.signed_orders``), "" until signed."""

    pool_id: str
    epoch: int
    src_tier: int
    src: int
    dst_tier: int
    dst: int
    block_hash: bytes
    source_pool_id: str = ""
    source_epoch: int = 0
    pin_id: str = ""
    serial: int = 0
    order_mac: bytes = b""


def tier_orders_of(pool_id: str, epoch: int, reply: dict) -> list[Order]:
    """A script reply's ``tier_orders`` ([src_tier, src, dst_tier, dst, hash hex]) as
    unsigned orders, as of the reply's serial."""
    serial = int(reply.get("serial") or 0)
    return [Order(pool_id, epoch, int(o[0]), int(o[1]), int(o[2]), int(o[3]), bytes.fromhex(o[4]), serial=serial)
            for o in reply.get("tier_orders") or ()]


@dataclass(frozen=True, slots=True)
class LeaseHoldings:
    """What one lease holds in one pool, as the audit reads it."""

    pool_id: str
    lease_id: str
    num_sequences: int
    num_reserved_blocks: int
    applied_entries: int
    #: blocks held only by the lease's staged records (runs under way)
    num_staged_blocks: int = 0


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    lease_id: str
    tenant: str
    ttl_seconds: float
    deadline_ms: int


@dataclass(slots=True)
class PoolInfo:
    pool_id: str
    epoch: int
    geometry: Geometry
    worker_address: str
    registered_at_ms: int
    stats: dict[str, float] = field(default_factory=dict)
    last_heartbeat_ms: int = 0
    generation: int = 0
    host_tier_blocks: int = 0
    disk_tier_blocks: int = 0
    #: being drained (``kvservice drain``): placement passes it over
    draining: bool = False
    #: "both", "prefill" or "decode" (RegisterPoolRequest.role)
    role: str = "both"
    #: the pool's grant key of this epoch: in a registration's reply only (for its worker)
    grant_key: bytes = b""


#: ``<pool>/<epoch>/<n>-<tag>``: ASCII digits only (``str.isdigit`` also takes "²" and
#: "١"), and few enough of them to stay exact in the scripts' Lua numbers (doubles); the
#: tag (``hashing.sequence_tag``, 12 hex digits) may be left out by an admin, or by anyone
#: on a server without authentication.
SEQUENCE_ID = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,63})/([0-9]{1,15})/([0-9]{1,15})(?:-([0-9a-f]{12}))?")


def parse_sequence_id(sequence_id: str) -> tuple[str, int, int, str]:
    """``"<pool>/<epoch>/<n>-<tag>"`` -> (pool, epoch, n, tag or ""); InvalidArgument when
    malformed."""
    m = SEQUENCE_ID.fullmatch(sequence_id)
    if m:
        return m.group(1), int(m.group(2)), int(m.group(3)), m.group(4) or ""
    raise errors.InvalidArgument(f"malformed sequence_id {echo(sequence_id)} (expected <pool>/<epoch>/<n>-<tag>)")


def format_sequence_id(pool_id: str, epoch: int, n: int, lease_id: str) -> str:
    return hashing.sequence_id(pool_id, epoch, n, lease_id)
