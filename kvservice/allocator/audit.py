"""The allocator's invariants (DESIGN §3), checked on a consistent snapshot of one pool.

- every block is in exactly one of {free, evictable, referenced, reserved by one lease};
  a referenced block held only by staged records (runs under way, ``runs.py``) is
  *staged*, the fifth state (reported per lease), each staged record has its run and the
  pool's admitted blocks are its runs' sum;
- ref(b) equals the number of block tables that hold b plus the read pins on it (fetches
  by other pools' workers, ``scripts/lib/pins.lua``); each pin's counts agree with the pin
  records, and no pin outlives its deadline by more than ``PIN_GRACE_MS`` (one a fetch
  never settled is released by the reaper at its deadline);
- the hash -> block and block -> hash maps agree, and only cached blocks have hashes
  (evictable blocks always do, free blocks never);
- the counts reported by the stats equal the sets they count;
- every sequence record is well formed (table length matches its token count, committed
  blocks are full) and indexed under its lease, and every lease index entry has a record;
- every entry of each lower tier (``tiers.audit_tiers``) is in exactly one of {free,
  never used, pending, ready}, and the tier's hash -> entry and entry -> hash maps agree;
- the holdings kept for the quotas (``scripts/lib/held.lua``) are what the leases hold:
  per lease its tables' block references plus its reserve, at least its sequences; per
  tenant the sums over its leases.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from kvservice.allocator.domain import LeaseHoldings, PoolInfo
from kvservice.allocator.tiers import audit_tiers
from kvservice.common.settings import check_pool_id
from kvservice.errors import InvalidArgument, NotFound

if TYPE_CHECKING:
    from kvservice.allocator.core import Allocator

#: Pools audited at once (each pool's snapshot is read in many small round trips).
AUDIT_CONCURRENCY = 8
#: How long past its deadline a read pin may still be recorded (ms): the reaper sweeps a
#: pool when its earliest pin deadline passes, give or take a tick and a shard's clock.
PIN_GRACE_MS = 30_000


def audit_pool(pool_id: str, snap: dict[str, Any], counts: dict[str, Any] | None = None,
               now_ms: int | None = None) -> list[str]:
    """Returns the list of broken invariants (empty when the pool is consistent).

    Args:
        pool_id: for the messages.
        snap: ``Store.snapshot(pool_id)``.
        counts: ``Store.pool_counts(pool_id)`` taken at the same moment, to check the
            reported counters against the sets (optional).
        now_ms: the time (ms, the pool's shard's clock) against which pin deadlines are
            checked; None: not checked.
    """
    problems: list[str] = []

    def bad(msg: str) -> None:
        if len(problems) < 200:
            problems.append(f"pool {pool_id}: {msg}")

    meta = snap["meta"]
    num_blocks, bs = int(meta["num_blocks"]), int(meta["block_size"])
    fresh = snap["state"].get("fresh", 0)
    if not 0 <= fresh <= num_blocks:
        bad(f"fresh mark {fresh} outside 0..{num_blocks}")

    free_list = snap["free"]
    for b, n in Counter(free_list).items():
        if n > 1:
            bad(f"block {b} is {n} times in the free list")
        if not 0 <= b < fresh:
            bad(f"free-list block {b} is outside 0..{fresh - 1} (the used range)")
    # The blocks from the fresh mark on were never used: free by construction. They are
    # checked as one range (a pool of 2^24 blocks, mostly unused, costs what its used part
    # costs); the sets below hold blocks of 0..fresh-1 only.
    # (The checks run in a thread beside the serving event loop: they stay in Python-level
    # loops and small set operations, which let the loop take the interpreter lock every
    # few ms, rather than single C-level operations over a whole large set.)
    free = set(free_list)
    evictable = snap["evict"].keys()
    referenced = snap["ref"].keys()
    reserved = {b for _, b in snap["reserve"]}
    counted = Counter(lease for lease, _ in snap["reserve"])
    for lease in sorted(set(counted) | set(snap["journal"])):
        recorded = snap["journal"].get(lease, (0, 0))[1]
        if recorded != counted.get(lease, 0):
            bad(f"lease {lease} holds {counted.get(lease, 0)} reserved blocks, its journal record says {recorded}")
    for lease in sorted({lease for lease, _ in snap["reserve"]} - set(snap["leases"])):
        bad(f"lease {lease} holds a reserve but is unknown to the pool (it would never be reclaimed)")
    for name, group in (("evictable", evictable), ("referenced", referenced), ("reserved", reserved)):
        outside = [b for b in group if not 0 <= b < num_blocks]
        if outside:
            bad(f"{name} blocks outside 0..{num_blocks - 1}: {sorted(outside)[:10]}")
        unused = [b for b in group if fresh <= b < num_blocks]
        if unused:
            bad(f"blocks both free and {name} (never used: at or past the fresh mark {fresh}): {sorted(unused)[:10]}")
    groups = (("free", free), ("evictable", evictable), ("referenced", referenced), ("reserved", reserved))
    overlaps = False
    for i, (n1, g1) in enumerate(groups):
        for n2, g2 in groups[i + 1:]:
            small, large = (g1, g2) if len(g1) <= len(g2) else (g2, g1)
            both = [b for b in small if b in large]
            if both:
                overlaps = True
                bad(f"blocks both {n1} and {n2}: {sorted(both)[:10]}")
    # (disjoint groups: the blocks they account for are the sum of their sizes in range)
    accounted = sum(1 for _, g in groups for b in g if 0 <= b < fresh)
    if overlaps:
        accounted = sum(1 for b in range(fresh) if b in free or b in evictable or b in referenced or b in reserved)
    if accounted != fresh:
        missing = (b for b in range(fresh) if b not in free and b not in evictable and b not in referenced
                   and b not in reserved)
        bad(f"blocks in no set (lost): {[b for b, _ in zip(missing, range(10))]}")

    holders: Counter[int] = Counter()
    for n, rec in snap["seqs"].items():
        table = rec["block_table"]
        holders.update(table)
        t, c = rec["num_tokens"], rec["num_committed_blocks"]
        if len(table) != rec["num_blocks"]:
            bad(f"sequence {n}: its record says {rec['num_blocks']} blocks, its table holds {len(table)}")
        if rec["state"] not in ("", "s", "f"):
            bad(f"sequence {n}: unknown state {rec['state']!r}")
        elif not rec["state"] and len(table) != math.ceil(t / bs):
            bad(f"sequence {n}: {len(table)} blocks for {t} tokens (block size {bs})")
        elif rec["state"] and len(table) > math.ceil(t / bs):
            bad(f"sequence {n} ({_STATES[rec['state']]}): {len(table)} blocks for {t} tokens (block size {bs})")
        if not 0 <= c <= min(len(table), t // bs):
            bad(f"sequence {n}: {c} committed blocks but only {t // bs} full")
        if len(set(table)) != len(table):
            bad(f"sequence {n}: a block appears twice in its table")
    pinned = _audit_pins(snap, num_blocks, now_ms, bad)
    for b, r in snap["ref"].items():
        if r != holders.get(b, 0) + pinned.get(b, 0):
            bad(f"block {b}: ref {r} but held by {holders.get(b, 0)} block tables and {pinned.get(b, 0)} pins")
    for b, n in holders.items():
        if b not in snap["ref"]:
            bad(f"block {b}: ref 0 but held by {n} block tables")
    for b, n in pinned.items():
        if b not in snap["ref"]:
            bad(f"block {b}: ref 0 but held by {n} pins")
    for b, r in snap["ref"].items():
        if r <= 0:
            bad(f"block {b} has ref {r} in the ref map")

    h2b, b2h = snap["h2b"], snap["b2h"]
    for h, b in h2b.items():
        if b2h.get(b) != h:
            bad(f"hash {h[:12]}.. -> block {b}, but block {b} -> {str(b2h.get(b))[:12]}..")
    for b, h in b2h.items():
        if h2b.get(h) != b:
            bad(f"block {b} -> hash {h[:12]}.., but that hash -> {h2b.get(h)}")
        if b in free or b >= fresh:
            bad(f"free block {b} still has a hash")
        if b in reserved:
            bad(f"reserved block {b} has a hash")
    for b in evictable:
        if b not in b2h:
            bad(f"evictable block {b} has no hash")

    lease_index = Counter()
    for member in snap["lseq"]:
        lease, _, n = member.rpartition(":")
        lease_index[int(n)] += 1
        rec = snap["seqs"].get(int(n))
        if rec is None:
            bad(f"lease index entry {member} has no sequence")
        elif rec["lease_id"] != lease:
            bad(f"lease index entry {member} but the sequence belongs to {rec['lease_id']}")
    for n, rec in snap["seqs"].items():
        if lease_index.get(n, 0) != 1:
            bad(f"sequence {n} is indexed {lease_index.get(n, 0)} times under its lease")
        if rec["lease_id"] not in snap["leases"]:
            bad(f"sequence {n} hangs off lease {rec['lease_id']}, unknown to the pool")

    _audit_holdings(snap, counted, bad)
    _audit_runs(snap, bad)
    st = snap.get("stats", {})
    live = st.get("sequences_created", 0) - st.get("sequences_freed", 0)
    num_live = sum(1 for rec in snap["seqs"].values() if not rec["state"])
    if live != num_live:
        bad(f"counters say {live} live sequences (created - freed) but {num_live} exist")
    if counts is not None:
        expect = {"num_free_blocks": len(free) + num_blocks - fresh, "num_evictable_blocks": len(evictable),
                  "num_used_blocks": len(referenced), "num_sequences": len(snap["seqs"]),
                  "num_leases": len(snap["leases"]), "num_reserved_blocks": len(snap["reserve"])}
        for name, value in expect.items():
            if counts.get(name) != value:
                bad(f"{name} reports {counts.get(name)} but the set holds {value}")
    return problems


_STATES = {"s": "staged", "f": "being freed"}


def _audit_pins(snap: dict[str, Any], num_blocks: int, now_ms: int | None, bad: Any) -> Counter[int]:
    """The read pins' records against their counts and deadlines; returns the pins per
    device block."""
    pins = snap.get("pins", {})
    items: Counter[str] = Counter()
    for pin_id, (deadline, held) in pins.items():
        items.update(f"{kind}:{index}" for kind, index in held)
        if now_ms is not None and deadline < now_ms - PIN_GRACE_MS:
            bad(f"pin {pin_id} is {(now_ms - deadline) / 1000:.0f} s past its deadline and still held")
        for kind, index in held:
            if kind == "b" and not 0 <= index < num_blocks:
                bad(f"pin {pin_id} holds block {index}, outside 0..{num_blocks - 1}")
    counts = snap.get("pin_counts", {})
    for field in sorted(set(items) | set(counts)):
        if items.get(field, 0) != counts.get(field, 0):
            bad(f"pin count {field} is {counts.get(field, 0)} but {items.get(field, 0)} pins hold it")
    deadlines = [d for d, _ in pins.values()]
    if deadlines and (snap.get("pin_next") is None or snap["pin_next"] > min(deadlines)):
        bad(f"the earliest pin deadline is recorded as {snap.get('pin_next')}, but a pin ends at {min(deadlines)}")
    return Counter({int(f[2:]): n for f, n in items.items() if f.startswith("b:")})


def staged_blocks(snap: dict[str, Any]) -> set[int]:
    """The blocks held only by staged records: taken by a run (a create, a fork or a resync
    claim larger than one call, ``scripts/stage.lua``) that has not made its sequence yet,
    the fifth state of a block beside free, evictable, referenced and reserved."""
    live: set[int] = set()
    staged: set[int] = set()
    for rec in snap["seqs"].values():
        (staged if rec["state"] == "s" else live).update(rec["block_table"])
    return staged - live


def _audit_runs(snap: dict[str, Any], bad: Any) -> None:
    """Runs (``scripts/stage.lua``): each names a staged or freeing record of its lease, and
    the pool's admitted blocks are the sum of what the runs were admitted and have not
    taken yet."""
    runs = snap.get("runs", {})
    admitted = 0
    for n, (lease, left) in sorted(runs.items()):
        rec = snap["seqs"].get(n)
        if rec is None or not rec["state"]:
            bad(f"run of sequence {n} has no staged record")
        elif rec["lease_id"] != lease:
            bad(f"run of sequence {n} belongs to lease {lease}, its record to {rec['lease_id']}")
        admitted += left
    if admitted != snap["state"].get("admitted", 0):
        bad(f"the pool counts {snap['state'].get('admitted', 0)} admitted blocks, its runs {admitted}")
    for n, rec in sorted(snap["seqs"].items()):
        if rec["state"] == "s" and n not in runs:
            bad(f"staged sequence {n} has no run")


def _audit_holdings(snap: dict[str, Any], reserved: Counter, bad: Any) -> None:
    refs: Counter[str] = Counter()
    seqs: Counter[str] = Counter()
    for rec in snap["seqs"].values():
        refs[rec["lease_id"]] += len(rec["block_table"])
        if rec["state"] in ("", "s"):      # (a record being freed left its lease's sequences)
            seqs[rec["lease_id"]] += 1
    held = snap.get("held", {})
    sums: dict[str, list[int]] = {}
    for key, value in sorted(held.items()):
        if not key.startswith("L:"):
            continue
        lease = key[2:]
        tenant, blocks, sequences = value
        if blocks != refs[lease] + reserved[lease]:
            bad(f"lease {lease} is counted to hold {blocks} blocks, but holds {refs[lease]} block references "
                f"in its tables and {reserved[lease]} in reserve")
        if sequences < seqs[lease]:
            bad(f"lease {lease} is counted to hold {sequences} sequences, but holds {seqs[lease]}")
        s = sums.setdefault(tenant, [0, 0, 0])
        s[0] += blocks
        s[1] += sequences
        s[2] += 1
    for lease in sorted(set(refs) | {lease for lease, n in reserved.items() if n}):
        if f"L:{lease}" not in held:
            bad(f"lease {lease} holds blocks that no tenant's holdings count")
    tenants = {key[2:]: tuple(value) for key, value in held.items() if key.startswith("T:")}
    for tenant in sorted(set(tenants) | set(sums)):
        if tenants.get(tenant) != tuple(sums.get(tenant, ())):
            bad(f"tenant {tenant}'s holdings read {tenants.get(tenant)} (blocks, sequences, leases), "
                f"its leases' sum to {tuple(sums.get(tenant, ()))}")


def lease_holdings(pool_id: str, snap: dict[str, Any]) -> list[LeaseHoldings]:
    """Per lease known to the pool: its sequences, its reserve, its staged blocks and its
    journal's progress."""
    seqs = Counter(rec["lease_id"] for rec in snap["seqs"].values() if not rec["state"])
    reserved = Counter(lease for lease, _ in snap["reserve"])
    staged = staged_blocks(snap)
    owner: dict[int, str] = {}
    for rec in snap["seqs"].values():
        if rec["state"] == "s":
            owner.update((b, rec["lease_id"]) for b in rec["block_table"] if b in staged)
    staged_by = Counter(owner.values())
    leases = sorted(set(snap["leases"]) | set(seqs) | set(reserved) | set(snap["journal"]) | set(staged_by))
    return [LeaseHoldings(pool_id, lease, seqs.get(lease, 0), reserved.get(lease, 0),
                          snap["journal"].get(lease, (0, 0))[0], staged_by.get(lease, 0))
            for lease in leases]


async def run_audit(allocator: Allocator, pool_id: str = "", *,
                    holdings: list[LeaseHoldings] | None = None) -> tuple[list[str], list[PoolInfo]]:
    """Audits one pool (or all); returns the problems and each pool's stats, and adds what
    each lease holds in each pool to ``holdings`` when given."""
    if pool_id:
        try:
            check_pool_id(pool_id)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
    pools = [pool_id] if pool_id else await allocator.store.pool_ids()
    limit = asyncio.Semaphore(AUDIT_CONCURRENCY)

    async def one(p: str) -> tuple[list[str], list[LeaseHoldings], PoolInfo] | None:
        async with limit:
            snap = await allocator.store.snapshot(p)
            if snap is None:
                if pool_id:
                    raise NotFound(f"pool {pool_id} is not registered")
                return None
            # (the check is Python over the whole snapshot: in a thread, so that the
            # replica's event loop goes on serving meanwhile)
            found = await asyncio.to_thread(audit_pool, p, snap, snap["counts"], int(time.time() * 1000))
            found += await asyncio.to_thread(audit_tiers, p, snap["meta"], await allocator.store.tier_snapshot(p))
            return found, lease_holdings(p, snap) if holdings is not None else [], \
                allocator.pool_info(p, snap["counts"])

    problems: list[str] = []
    infos: list[PoolInfo] = []
    for done in await asyncio.gather(*(one(p) for p in pools)):
        if done is not None:
            problems += done[0]
            if holdings is not None:
                holdings.extend(done[1])
            infos.append(done[2])
    return problems, infos
