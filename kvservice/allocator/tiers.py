"""The pools' lower tiers on the allocator's side (DESIGN §12, ``scripts/lib/tiers.lua``):
their figures, and the settlement of the orders that workers ran. A mixin of
``core.Allocator``."""

from __future__ import annotations

import re
from typing import Any

from kvservice import errors
from kvservice.allocator.checks import MAX_INT, check_pool_arg
from kvservice.common.settings import echo
from kvservice.allocator.store import Store

#: The most entries a tier may have (block ids and entries are 24-bit, as a pool's blocks).
MAX_TIER_BLOCKS = 1 << 24
#: Settlements in one SettleTiers call at most.
MAX_SETTLEMENTS = 65_536
#: Pins released by one SettleTiers call at most, and the form of a pin id (steps.py).
MAX_RELEASES = 1024
PIN_ID = re.compile(r"[0-9a-f]{32}")
#: Tier codes of the orders (TierOrder.src_tier / dst_tier) and their names.
DEVICE, HOST, DISK = 0, 1, 2
TIER_NAMES = {HOST: "host", DISK: "disk"}
#: A tier's counters in the pool's stats hash (``tier_<h|d>_<name>``) -> TierStats field.
COUNTERS = {"hit_tokens": "hit_tokens", "offloads": "blocks_in", "loads": "blocks_out",
            "confirmed": "confirmed", "load_failures": "load_failures", "failed_copies": "failed_copies",
            "lost_copies": "lost_copies", "evictions": "evictions", "lag_ms": "offload_lag_ms_sum"}


def tier_stats(meta: dict[str, str], counts: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures of each tier the pool has (``TierStats``), from its counts as read."""
    out = []
    stats = counts["stats"]
    for name in ("host", "disk"):
        entries = int(meta.get(f"{name}_entries", 0))
        if entries <= 0:
            continue
        ready, pending = counts["tiers"][name]
        one = {"tier": name, "num_blocks": entries, "num_used_blocks": ready, "num_pending_blocks": pending}
        for key, field in COUNTERS.items():
            one[field] = int(stats.get(f"tier_{name[0]}_{key}", 0))
        out.append(one)
    return out


def audit_tiers(pool_id: str, meta: dict[str, str], snap: dict[str, dict[str, Any]]) -> list[str]:
    """The lower tiers' invariants (``Store.tier_snapshot``): each entry of a tier is free,
    never used (at or past ``fresh``), pending or ready, exactly one of them; the hash ->
    entry and entry -> hash maps agree, and only pending and ready entries have a hash."""
    problems: list[str] = []

    def bad(msg: str) -> None:
        if len(problems) < 200:
            problems.append(f"pool {pool_id}: {msg}")

    for tier, t in snap.items():
        entries = int(meta.get(f"{tier}_entries", 0))
        fresh = t["state"].get("fresh", 0)
        if entries == 0:
            if any(t[k] for k in ("free", "h2e", "e2h", "lru", "pend")) or fresh:
                bad(f"the pool has no {tier} tier but holds {tier}-tier state")
            continue
        if not 0 <= fresh <= entries:
            bad(f"{tier} tier: fresh mark {fresh} outside 0..{entries}")
        states: dict[int, list[str]] = {}
        for name, members in (("free", t["free"]), ("pending", t["pend"]), ("ready", t["lru"])):
            for e in members:
                states.setdefault(e, []).append(name)
                if not 0 <= e < fresh:
                    bad(f"{tier} tier: {name} entry {e} outside the used range 0..{fresh - 1}")
        for e, names in states.items():
            if len(names) > 1:
                bad(f"{tier} tier: entry {e} is {' and '.join(names)}")
        lost = [e for e in range(fresh) if e not in states]
        if lost:
            bad(f"{tier} tier: entries in no state (lost): {lost[:10]}")
        for h, e in t["h2e"].items():
            if t["e2h"].get(e) != h:
                bad(f"{tier} tier: hash {h[:12]}.. -> entry {e}, but entry {e} -> {str(t['e2h'].get(e))[:12]}..")
        for e, h in t["e2h"].items():
            if t["h2e"].get(h) != e:
                bad(f"{tier} tier: entry {e} -> hash {h[:12]}.., but that hash -> {t['h2e'].get(h)}")
            if states.get(e, ["free"])[0] == "free":
                bad(f"{tier} tier: entry {e} has a hash but is free")
        for e, names in states.items():
            if names[0] in ("pending", "ready") and e not in t["e2h"]:
                bad(f"{tier} tier: {names[0]} entry {e} has no hash")
    return problems


class TierOps:
    """``SettleTiers`` (the ``Allocator``'s)."""

    store: Store

    async def settle_tiers(self, pool_id: str, epoch: int, settled: list[tuple[int, int, bytes, bool]],
                           release_pins: list[str] = (), forget_blocks: list[int] = ()) -> tuple[int, int, int]:
        """Settles lower-tier entries of one pool (``tier_settle.lua``): a confirmed copy
        makes its entry usable, a failed copy or load drops it; releases the read pins of
        fetches from the pool that ran; drops the hashes of ``forget_blocks`` (blocks whose
        content is not what their hash says). Returns how many entries still held their
        hash, how many pins were released and how many blocks lost a hash."""
        check_pool_arg(pool_id)
        if not 1 <= epoch <= MAX_INT:
            raise errors.InvalidArgument(f"epoch must be in 1..{MAX_INT}, got {epoch}")
        if len(settled) > MAX_SETTLEMENTS:
            raise errors.InvalidArgument(f"at most {MAX_SETTLEMENTS} settlements per call, got {len(settled)}")
        rows = []
        for i, (tier, entry, block_hash, ok) in enumerate(settled):
            if tier not in TIER_NAMES:
                raise errors.InvalidArgument(f"settled[{i}].tier must be 1 (host) or 2 (disk), got {tier}")
            if not 0 <= entry < MAX_TIER_BLOCKS:
                raise errors.InvalidArgument(f"settled[{i}].entry {entry} is out of range")
            if len(block_hash) != 16:
                raise errors.InvalidArgument(f"settled[{i}].block_hash must be 16 bytes, got {len(block_hash)}")
            rows.append([tier, entry, block_hash.hex(), bool(ok)])
        if len(release_pins) > MAX_RELEASES:
            raise errors.InvalidArgument(f"at most {MAX_RELEASES} pins released per call, got {len(release_pins)}")
        for i, pin in enumerate(release_pins):
            if not PIN_ID.fullmatch(pin):
                raise errors.InvalidArgument(f"release_pins[{i}] {echo(pin)} is not a pin id (32 hex digits)")
        if len(forget_blocks) > MAX_SETTLEMENTS:
            raise errors.InvalidArgument(f"at most {MAX_SETTLEMENTS} forget_blocks per call, got {len(forget_blocks)}")
        for i, b in enumerate(forget_blocks):
            if not 0 <= b <= MAX_INT:
                raise errors.InvalidArgument(f"forget_blocks[{i}] {b} is out of range")
        if not rows and not release_pins and not forget_blocks:
            return 0, 0, 0
        reply = await self.store.tier_settle(pool_id, epoch, rows, list(release_pins), list(forget_blocks))
        return int(reply["settled"]), int(reply.get("released", 0)), int(reply.get("forgotten", 0))
