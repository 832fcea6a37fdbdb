"""The pools' lower tiers on the allocator's side (DESIGN §12, ``scripts/lib/tiers.lua``):
their figures, and the settlement of the orders that workers ran. A mixin of
``core.Allocator``."""

from __future__ import annotations

import re
from typing import Any

from kvservice import errors
from kvservice.allocator.checks import MAX_INT, check_pool_arg, tag_fits
from kvservice.allocator.domain import Order, parse_sequence_id
from kvservice.common.grants import move_fields, order_valid, pull_fields
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
    grant_key: Any

    async def settle_tiers(self, pool_id: str, epoch: int, settled: list[tuple[Order, bool]],
                           release_pins: list[str] = (), forget: list[Order] = (), lease_id: str = "",
                           unwritten: list[tuple[str, int]] = ()) -> tuple[int, int, int]:
        """Settles lower-tier orders of one pool (``tier_settle.lua``): a confirmed copy
        makes its entry usable, a failed copy or load drops it; releases the read pins of
        fetches from the pool that ran; drops the hash of the device block of each order of
        ``forget`` (a load or fetch into it that failed: its content is not what the hash
        says) when the block still holds it; drops the hashes of the blocks of each
        sequence of ``unwritten`` (a sequence of ``lease_id``, its blocks from the index
        given on, but never those of its cached prefix: others wrote those) whose KV its
        forward never wrote. Each order is one the allocator gave (its ``order_mac``), for
        this pool and epoch. Returns how many entries still held their
        hash, how many pins were released and how many blocks lost a hash.

        Raises:
            InvalidArgument: a malformed request, or an order of another pool or epoch, or
                of the wrong kind (a settlement's is a move, a forget's fills a device block).
            PermissionDenied: an order that is not the allocator's.
            FailedPrecondition: the pool is at another epoch (EPOCH_CHANGED).
        """
        check_pool_arg(pool_id)
        if not 1 <= epoch <= MAX_INT:
            raise errors.InvalidArgument(f"epoch must be in 1..{MAX_INT}, got {epoch}")
        if len(settled) > MAX_SETTLEMENTS:
            raise errors.InvalidArgument(f"at most {MAX_SETTLEMENTS} settlements per call, got {len(settled)}")
        if len(forget) > MAX_SETTLEMENTS:
            raise errors.InvalidArgument(f"at most {MAX_SETTLEMENTS} forget orders per call, got {len(forget)}")
        if len(unwritten) > MAX_RELEASES:
            raise errors.InvalidArgument(f"at most {MAX_RELEASES} unwritten sequences per call, got {len(unwritten)}")
        seqs = []
        for i, (sid, first) in enumerate(unwritten):
            pool, seq_epoch, n, tag = parse_sequence_id(sid)
            if (pool, seq_epoch) != (pool_id, epoch) or not tag_fits(tag, lease_id, pool, seq_epoch, n):
                raise errors.InvalidArgument(f"unwritten[{i}]: sequence {echo(sid)} is not one of lease "
                                             f"{echo(lease_id)} in pool {pool_id} at epoch {epoch}")
            if not 0 <= first <= MAX_INT:
                raise errors.InvalidArgument(f"unwritten[{i}].first_block {first} is out of range")
            seqs.append([n, first])
        if len(release_pins) > MAX_RELEASES:
            raise errors.InvalidArgument(f"at most {MAX_RELEASES} pins released per call, got {len(release_pins)}")
        for i, pin in enumerate(release_pins):
            if not PIN_ID.fullmatch(pin):
                raise errors.InvalidArgument(f"release_pins[{i}] {echo(pin)} is not a pin id (32 hex digits)")
        if not settled and not release_pins and not forget and not seqs:
            return 0, 0, 0
        for i, (o, _) in enumerate(settled):
            what = f"settled[{i}].order"
            self._check_order(o, pool_id, epoch, what)
            if o.source_pool_id:
                raise errors.InvalidArgument(f"{what} is a fetch: its pins are released (release_pins), not settled")
            if not o.dst_tier and not o.src_tier:
                raise errors.InvalidArgument(f"{what} moves nothing through a lower tier (tiers {o.src_tier} -> "
                                             f"{o.dst_tier})")
        for i, o in enumerate(forget):
            self._check_order(o, pool_id, epoch, f"forget[{i}]")
            if o.dst_tier:
                raise errors.InvalidArgument(f"forget[{i}] fills no device block (dst_tier {o.dst_tier}): only a load "
                                             f"or a fetch that failed leaves a block to forget")
        rows, forget_rows = [], []
        if settled or forget:
            now, key = await self.store.grant_key(pool_id)
            if not now:
                raise errors.NotFound(f"pool {pool_id} is not registered")
            if now != epoch:
                raise errors.FailedPrecondition(f"pool {pool_id} is at epoch {now}, not {epoch}: its worker restarted "
                                                f"and the orders of its earlier epoch are void", reason="EPOCH_CHANGED")
            for i, (o, ok) in enumerate(settled):
                self._check_mac(key, o, f"settled[{i}].order")
                tier, entry = (o.dst_tier, o.dst) if o.dst_tier else (o.src_tier, o.src)
                rows.append([tier, entry, o.block_hash.hex(), bool(ok)])
            for i, o in enumerate(forget):
                if o.source_pool_id:
                    source_key = await self.grant_key(o.source_pool_id, o.source_epoch)
                    if not source_key:
                        continue            # (the source restarted: its orders can no longer be checked)
                    self._check_mac(source_key, o, f"forget[{i}]")
                else:
                    self._check_mac(key, o, f"forget[{i}]")
                forget_rows.append([o.dst, o.block_hash.hex()])
        reply = await self.store.tier_settle(pool_id, epoch, rows, list(release_pins), forget_rows, lease_id, seqs)
        return int(reply["settled"]), int(reply.get("released", 0)), int(reply.get("forgotten", 0))

    @staticmethod
    def _check_order(o: Order, pool_id: str, epoch: int, what: str) -> None:
        if o.pool_id != pool_id or o.epoch != epoch:
            raise errors.InvalidArgument(f"{what} is for pool {echo(o.pool_id)} at epoch {o.epoch}, not {pool_id} at "
                                         f"epoch {epoch} (settle each pool's orders with that pool)")
        for tier in (o.src_tier, o.dst_tier):
            if tier not in (DEVICE, HOST, DISK):
                raise errors.InvalidArgument(f"{what}: tiers are 0 (device), 1 (host), 2 (disk); got {tier}")
        for name, index in (("src", o.src), ("dst", o.dst)):
            if not -1 <= index < MAX_TIER_BLOCKS:
                raise errors.InvalidArgument(f"{what}.{name} {index} is out of range")
        if len(o.block_hash) != 16:
            raise errors.InvalidArgument(f"{what}.block_hash must be 16 bytes, got {len(o.block_hash)}")

    @staticmethod
    def _check_mac(key: bytes, o: Order, what: str) -> None:
        if o.source_pool_id:
            fields = pull_fields(o.source_pool_id, o.source_epoch, o.pool_id, o.serial, o.src_tier, o.src, o.block_hash)
            kind = "pull"
        else:
            fields = move_fields(o.pool_id, o.epoch, o.serial, o.src_tier, o.src, o.dst_tier, o.dst, o.block_hash)
            kind = "move"
        if not order_valid(key, kind, fields, o.order_mac):
            raise errors.PermissionDenied(f"{what} is not an order of the allocator (its order_mac does not match "
                                          f"it): a caller settles only the orders it was given, as it was given them")


def order_of(o: Any) -> Order:
    """A TierOrder message as an ``Order``."""
    return Order(o.pool_id, o.epoch, o.src_tier, o.src, o.dst_tier, o.dst, o.block_hash, o.source_pool_id,
                 o.source_epoch, o.pin_id, o.serial, o.order_mac)
