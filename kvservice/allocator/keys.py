"""Redis key names: defined here and nowhere else.

All state of one pool lives under the hash tag ``{<pool_id>}``, so every script touches
one cluster slot; a lease lives under ``{L:<lease_id>}``. Pool ids cannot contain ``:``,
so the two tag families never meet.

Pool keys (``kvs:{<pool>}:<name>``), in the order the scripts receive them as KEYS:

- ``meta``   hash: geometry, ``epoch``, ``worker_address``, ``registered_ms``, ``next_seq``,
  ``heartbeat_ms`` (the last worker heartbeat, Redis clock), ``generation``, ``server``
  (the run_id of the Redis process that began it), ``generations`` (how many began in
  the pool's life: ``scripts/lib/generation.lua``) and ``grant_key`` (the epoch's key of
  the grants the allocator signs for the pool's worker, hex: ``kvservice/common/grants.py``)
- ``state``  hash: ``fresh`` (blocks at or above it were never used, hence free), ``clock``
  (LRU counter of the evictable set), ``version`` (raised by every script that changes the
  pool: the audit reads the pool in pieces and checks it read one state),
  ``reclaim:<lease>`` (where the reaper's scan of an ended lease's reserve stopped),
  ``resync:<lease>`` (the run of a resync in parts under way: no other call of the lease
  runs in the pool meanwhile)
- ``free``   list of free block ids (below ``fresh``)
- ``evict``  zset: evictable block id -> LRU clock (ref 0, still cached by hash)
- ``ref``    hash: block id -> ref count, for referenced blocks only
- ``h2b``    hash: block hash (hex) -> block id
- ``b2h``    hash: block id -> block hash (hex)
- ``seqs``   hash: sequence number -> ``"<lease> <num_tokens> <committed blocks>
  <cached tokens> <last hash>"``
- ``leases`` zset: lease id -> deadline (ms, the clock of the shard holding the pool: pool scripts are given a lease's time left, never another shard's deadline)
- ``lseq``   zset (score 0): ``<lease>:<seq number>``, read by lexicographic range
- ``dead``   zset: lease id -> when it was reaped (tombstones, one hour)
- ``stats``  hash: counters since the epoch began
- ``tabs``   hash: sequence number -> its block table, 6 hex digits per block id
- ``reserve`` hash: block id -> the lease that holds it in reserve (in no table); a Sync
  reads only the fields of the blocks it moves
- ``journal`` hash: lease id -> ``"<applied> <reserved>"``: the number of the last entry
  of the lease's journal applied in this pool, and the size of its reserve
  (``scripts/lib/reserve.lua``)
- ``held``   hash: what each tenant holds here, for its quotas (``scripts/lib/held.lua``):
  ``L:<lease>`` -> ``"<tenant> <blocks> <sequences>"``, ``T:<tenant>`` -> ``"<blocks>
  <sequences> <leases>"``
- ``pins``   hash: read pins of the blocks and entries another pool's worker is fetching
  (DESIGN §13, ``scripts/lib/pins.lua``): ``p:<pin id>`` -> ``"<deadline ms> <kind>:<index>
  ..."`` (kind ``b`` a device block, ``h`` / ``d`` a host / disk entry), ``b:<block>`` /
  ``h:<entry>`` / ``d:<entry>`` -> how many live pins hold it (a pinned device block holds
  one reference per pin in ``ref``), ``next`` -> the earliest pin deadline (ms)

- per lower tier (``host:`` and ``disk:``, DESIGN §12, ``scripts/lib/tiers.lua``):
  ``state`` hash (``fresh``: entries at or above it were never used; ``clock``: the LRU
  counter), ``free`` list of free entries, ``h2e`` hash: block hash -> entry, ``e2h``
  hash: entry -> block hash, ``lru`` zset: ready entries -> LRU clock, ``pend`` zset:
  entries whose copy is not confirmed yet -> when it was ordered (ms). An entry is free,
  never used, pending (in ``e2h`` and ``pend``) or ready (in ``e2h`` and ``lru``).
Everything but ``meta`` and the ``disk:`` keys belongs to one epoch and is dropped when the pool re-registers.

Per request (same slot as its pool): ``kvs:{<pool>}:req:<request id>``, the fingerprint
of the request and its reply (``scripts/lib/request.lua``). Per lease:
``kvs:{L:<lease>}`` (tenant, TTL, deadline), ``kvs:{L:<lease>}:pools`` (where it holds
sequences) and ``kvs:{L:<lease>}:place:<request id>`` (where a request's pool-less creates
were placed). Per lease and pool: ``kvs:{<pool>}:resync:<lease>``, the state of its
resync in parts (``scripts/resync.lua``; expires). Per tenant: ``kvs:{T:<tenant>}:leases`` (zset lease id -> deadline: its
live leases, kept while it has a lease quota). Global: ``kvs:pools`` (the registry of pool ids), ``kvs:pools:draining`` (the pools being
drained: ``kvservice drain``), ``kvs:pools:next`` (the
counter of ``pool-<n>`` ids), ``kvs:pools:req:<request id>`` (the id a registration
without a pool id got), ``kvs:exporter`` (the metrics exporter lease).

Stored records keep a compact text form (a ``seqs`` entry is read and rewritten for every
update of a step, a ``tabs`` entry grows by string concatenation without being decoded);
everything that crosses the script boundary is msgpack (``codec``).
"""

from __future__ import annotations

PREFIX = "kvs"
POOLS = f"{PREFIX}:pools"
POOL_COUNTER = f"{PREFIX}:pools:next"
#: The pools being drained (``kvservice drain``): placement passes them over.
DRAINING = f"{PREFIX}:pools:draining"
#: The metrics exporter lease (kvservice.common.metrics): which replica exports the pool series.
EXPORTER = f"{PREFIX}:exporter"
POOL_KEY_NAMES = ("meta", "state", "free", "evict", "ref", "h2b", "b2h", "seqs",
                  "leases", "lseq", "dead", "stats", "tabs", "reserve", "journal", "held", "pins",
                  *(f"{tier}:{name}" for tier in ("host", "disk")
                    for name in ("state", "free", "h2e", "e2h", "lru", "pend")),
                  "events")


def pool_keys(pool_id: str) -> list[str]:
    """The 30 keys of one pool, in script KEYS order."""
    return [f"{PREFIX}:{{{pool_id}}}:{name}" for name in POOL_KEY_NAMES]


def pool_key(pool_id: str, name: str) -> str:
    return f"{PREFIX}:{{{pool_id}}}:{name}"


def request_key(pool_id: str, request_id: str) -> str:
    """Idempotency record of one request in one pool (same slot as the pool)."""
    return f"{PREFIX}:{{{pool_id}}}:req:{request_id}"


def resync_key(pool_id: str, lease_id: str) -> str:
    """The state of a lease's resync in parts in one pool (same slot as its pool;
    ``scripts/resync.lua``)."""
    return f"{PREFIX}:{{{pool_id}}}:resync:{lease_id}"


def pool_id_request_key(request_id: str) -> str:
    """The pool id that a registration without one got, under its request id."""
    return f"{PREFIX}:pools:req:{request_id}"


def placement_key(lease_id: str, request_id: str) -> str:
    """Where a request's pool-less creates were placed (same slot as the lease)."""
    return f"{PREFIX}:{{L:{lease_id}}}:place:{request_id}"


def tenant_leases_key(tenant: str) -> str:
    """A tenant's live leases, while it has a lease quota (``scripts/tenant_leases.lua``)."""
    return f"{PREFIX}:{{T:{tenant}}}:leases"


def lease_keys(lease_id: str) -> list[str]:
    """The lease hash and the set of pools where it holds sequences."""
    return [f"{PREFIX}:{{L:{lease_id}}}", f"{PREFIX}:{{L:{lease_id}}}:pools"]
