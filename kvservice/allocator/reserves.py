"""The allocator's Sync: a lease's journal applied, its reserve refilled or taken back,
sequence numbers granted (DESIGN §5). A mixin of ``core.Allocator``: it uses the
allocator's store, settings, geometry cache and lease attachment.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from kvservice import errors
from kvservice.common.grants import Grant, pack_blocks
from kvservice.allocator.checks import MAX_INT, check_lease_id, check_pool_arg, check_request_id, fingerprint, lease_info
from kvservice.allocator.codec import ScriptError
from kvservice.allocator.domain import LeaseInfo, ReserveGrant, ReserveRequest, tier_orders_of
from kvservice.allocator import events
from kvservice.allocator.journal import RESYNC_WORK, journal_chunks, journal_payload, resync_payload


class ReserveOps:
    """``Allocator.sync`` and its per-pool script calls."""

    async def sync(self, lease_id: str, pools: list[ReserveRequest],
                   request_id: str = "") -> tuple[LeaseInfo, list[ReserveGrant]]:
        """Keeps the lease alive, then refills or takes back its reserve in each pool
        (one script call per pool, all-or-nothing per pool). See SyncRequest in the proto."""
        check_lease_id(lease_id)
        check_request_id(request_id)
        if len(pools) > self.settings.max_items_per_call:
            raise errors.InvalidArgument(f"{len(pools)} pools in one Sync, at most {self.settings.max_items_per_call}")
        seen: set[str] = set()
        for r in pools:
            check_pool_arg(r.pool_id)
            if r.pool_id in seen:
                raise errors.InvalidArgument(f"pool {r.pool_id} appears twice in one Sync")
            seen.add(r.pool_id)
            if not 1 <= r.epoch <= MAX_INT:
                raise errors.InvalidArgument(f"pool {r.pool_id}: epoch must be in 1..{MAX_INT}, got {r.epoch}")
            if not 0 <= r.want_blocks <= MAX_INT:
                raise errors.InvalidArgument(f"pool {r.pool_id}: want_blocks {r.want_blocks} is out of range")
            if not 0 <= r.need_blocks <= self.settings.max_journal_blocks:
                raise errors.InvalidArgument(f"pool {r.pool_id}: need_blocks {r.need_blocks} is out of range "
                                             f"(0..{self.settings.max_journal_blocks})")
            if r.entries is not None and len(r.entries) > self.settings.max_journal_entries:
                raise errors.InvalidArgument(f"pool {r.pool_id}: {len(r.entries)} journal entries, at most "
                                             f"{self.settings.max_journal_entries} per call")
            if len(r.returned_blocks) > self.settings.max_returned_blocks:
                raise errors.InvalidArgument(f"pool {r.pool_id}: {len(r.returned_blocks)} returned blocks, at most "
                                             f"{self.settings.max_returned_blocks} per call")
            if len(set(r.returned_blocks)) != len(r.returned_blocks):
                raise errors.InvalidArgument(f"pool {r.pool_id}: a returned block appears twice")
            current, geo = await self.geometry(r.pool_id)
            if current != r.epoch:
                current, geo = await self.geometry(r.pool_id, refresh=True)
                if current != r.epoch:
                    raise errors.FailedPrecondition(f"pool {r.pool_id} is at epoch {current}, not {r.epoch} "
                                                    f"(re-registered since)", reason="EPOCH_CHANGED")
            for b in r.returned_blocks:
                if not 0 <= b < geo.num_blocks:
                    raise errors.InvalidArgument(f"pool {r.pool_id}: returned block {b} is outside "
                                                 f"0..{geo.num_blocks - 1}")
        entries: dict[str, Any] = {}
        for r in pools:
            _, geo = await self.geometry(r.pool_id)
            if r.resync is not None:
                s = self.settings
                blocks = sum(len(c.block_table) for c in r.resync)
                longest = max((c.num_tokens for c in r.resync), default=0)
                if longest > s.max_sequence_tokens:
                    raise errors.InvalidArgument(f"pool {r.pool_id}: a resync claims a sequence of {longest} tokens, "
                                                 f"at most {s.max_sequence_tokens} (max_sequence_tokens)")
                if len(r.resync) > s.max_journal_entries or blocks > s.max_journal_blocks:
                    raise errors.InvalidArgument(
                        f"pool {r.pool_id}: a resync of {len(r.resync)} sequences and {blocks} blocks, at most "
                        f"{s.max_journal_entries} and {s.max_journal_blocks}")
                entries[r.pool_id] = resync_payload(r, geo)
            else:
                entries[r.pool_id] = journal_payload(r.entries, r.first_entry, r.pool_id, geo,
                                                     self.settings.max_journal_blocks, self.settings.max_forks_per_call)
                if self.settings.kv_events and r.entries is not None:
                    await events.note_tokens(self.store.redis, events.journal_records(
                        entries[r.pool_id], r.entries.commit_tokens, geo.block_size))
        # The keep-alive first; each pool's script raises the lease's deadline there itself.
        kept = await self.store.keep_alive(lease_id, self._tombstone_ms(),
                                           touched_by_caller=[r.pool_id for r in pools])
        await self._kept_alive(kept)
        lease = lease_info(kept)
        if not pools:
            return lease, []
        tenant, left_ms = await self._attach(lease_id, [r.pool_id for r in pools])
        grants = await asyncio.gather(*(self._sync_pool(lease_id, tenant, r, entries[r.pool_id], left_ms,
                                                        request_id, kept["ttl_ms"]) for r in pools))
        return lease, list(grants)

    async def _sync_pool(self, lease_id: str, tenant: str, r: ReserveRequest, entries: Any, left_ms: int,
                         request_id: str, touch_ms: int) -> ReserveGrant:
        """One pool's part of a Sync. ``left_ms``: the lease's time left as its record tells
        (0: attached to the pool already), ``touch_ms``: after the keep-alive; each pool's
        shard adds them to its own clock. A pool whose generation is not the client's
        applies nothing and says so (``rolled_back``): the client resyncs there."""
        try:
            return await self._sync_pool_now(lease_id, tenant, r, entries, left_ms, request_id, touch_ms)
        except errors.RolledBack as exc:
            return ReserveGrant(r.pool_id, r.epoch, [], 0, 0, generation=exc.generation, rolled_back=True)

    async def _sync_pool_now(self, lease_id: str, tenant: str, r: ReserveRequest, entries: Any, left_ms: int,
                             request_id: str, touch_ms: int) -> ReserveGrant:
        s = self.settings
        _, geo = await self.geometry(r.pool_id)
        cap = max(s.reserve_min_blocks, int(s.reserve_share * geo.num_blocks))
        if r.resync is not None:
            payload = {"pool": r.pool_id, "epoch": r.epoch, "request_id": request_id,
                       "fingerprint": fingerprint("resync", [lease_id, r.pool_id, r.epoch, r.first_entry, entries])
                       if request_id else "",
                       "request_ttl_ms": self._request_ttl_ms(), "lease_id": lease_id, "tenant": tenant,
                       "lease_left_ms": left_ms, "touch_left_ms": touch_ms, "first_entry": r.first_entry,
                       "cap": cap, "run": secrets.token_hex(8), "budget": RESYNC_WORK, "total": len(entries)}
            reply = await self._resync_parts(lease_id, r.pool_id, payload, entries)
            # The grant of what the lease holds after it (a new generation voided the old
            # ones): the blocks of the sequences it kept, and its reserve. (Read after the
            # last part: the lease holds them all now.)
            lost = set(reply["lost"])
            kept = [b for c in entries if c["n"] not in lost for b in c["tab"]] + list(reply["reserve"])
            epoch = int(reply["epoch"])
            grant = Grant(r.pool_id, epoch, int(reply["generation"]), lease_id, tenant,
                          await self.store.version(r.pool_id), pack_blocks(kept)).signed(
                await self.grant_key(r.pool_id, epoch)) if kept else None
            return ReserveGrant(r.pool_id, reply["epoch"], [], len(reply["reserve"]), reply["cap"], reply["applied"],
                                lost_sequences=tuple(reply["lost"]), reserve_blocks=tuple(reply["reserve"]),
                                resynced=True, generation=int(reply["generation"]), grant=grant)
        returned = [int(b) for b in r.returned_blocks]
        # The entries are known by their numbers (a resend is a no-op by numbering): the
        # fingerprint covers the rest of the request and which entries it carries.
        request = [lease_id, r.pool_id, r.epoch, r.want_blocks, returned, r.first_entry, entries["n"],
                   r.want_sequence_numbers, r.need_blocks]
        base = {"pool": r.pool_id, "epoch": r.epoch, "generation": r.generation,
                "request_ttl_ms": self._request_ttl_ms(), "lease_id": lease_id,
                "tenant": tenant, "quota": self.quota(tenant), "lease_left_ms": left_ms,
                "touch_left_ms": touch_ms, "cap": cap,
                "pressure_blocks": int(s.reserve_pressure_share * geo.num_blocks),
                "pressure_cap": s.reserve_min_blocks, "max_fork_refs": s.max_fork_refs_per_call,
                "max_refill": s.max_refill_per_call, "max_need": s.max_blocks_per_call}
        idle = {"request_id": "", "fingerprint": "", "want": 0, "need": 0, "returned": [],
                "want_sequence_numbers": 0}
        # The journal in script calls of bounded work (each stalls Redis while it runs):
        # every call but the last only applies entries (a resend is a no-op by numbering);
        # the last also refills, takes back and grants numbers, under the request id.
        chunks = journal_chunks(entries, geo.block_size, s.max_fork_refs_per_call, s.max_release_per_call)
        if chunks[-1][2]:       # (a long entry last: the refill and the rest in a call after it)
            chunks.append((entries["n"], {"n": 0}, False))
        for offset, part, big in chunks[:-1]:
            call = {**base, **idle, "first_entry": r.first_entry + offset, "journal": part}
            if not big:
                await self._attached(lease_id, r.pool_id, call, self.store.sync)
                continue
            # One long FORK or FREE, applied in parts (``scripts/sync.lua``): until the pool
            # says it is applied (a part that applied nothing says so: a gap, or applied before).
            call.update(part=True, budget=s.max_blocks_per_call)
            while True:
                got = await self._attached(lease_id, r.pool_id, call, self.store.sync)
                if got["applied"] >= r.first_entry + offset or got.get("stuck"):
                    break
        offset, part, _ = chunks[-1]
        draining = await self.store.draining(r.pool_id)      # (a pool being drained grants no block)
        reply = await self._attached(lease_id, r.pool_id, {
            **base, "request_id": request_id, "fingerprint": fingerprint("sync", request) if request_id else "",
            "first_entry": r.first_entry + offset, "journal": part, "want": 0 if draining else r.want_blocks,
            "returned": returned, "want_sequence_numbers": r.want_sequence_numbers,
            "need": 0 if draining else r.need_blocks}, self.store.sync)
        granted, last = list(reply["granted"]), reply
        orders = tier_orders_of(r.pool_id, reply["epoch"], reply)
        # What a step needs at once, max_blocks_per_call per call (under request ids of their
        # own, so that a resend gets the same blocks).
        k = 0
        while not draining and last["num_reserved"] < r.need_blocks and len(last["granted"]) >= s.max_blocks_per_call:
            k += 1
            rid = f"{request_id}.need{k}" if request_id else ""
            last = await self._attached(lease_id, r.pool_id, {
                **base, **idle, "request_id": rid, "fingerprint": fingerprint("sync-need", request + [k]) if rid else "",
                "first_entry": 1, "journal": {"n": 0}, "need": r.need_blocks}, self.store.sync)
            granted += last["granted"]
            orders += tier_orders_of(r.pool_id, last["epoch"], last)
        quota = last["quota"] or reply["quota"]
        grant = None
        if granted:     # (the last call's serial: the lease holds every block granted by then)
            epoch = int(last["epoch"])
            grant = Grant(r.pool_id, epoch, int(last["generation"]), lease_id, tenant, int(last["serial"]),
                          pack_blocks(granted)).signed(await self.grant_key(r.pool_id, epoch))
        return ReserveGrant(r.pool_id, last["epoch"], granted, last["num_reserved"], last["cap"],
                            reply["applied"], reply["first_sequence_number"], reply["num_sequence_numbers"],
                            quota=quota, quota_limit=last["quota_limit"] if last["quota"] else reply["quota_limit"],
                            generation=int(last["generation"]), tier_orders=tuple(await self.signed_orders(orders)),
                            grant=grant)

    async def _resync_parts(self, lease_id: str, pool_id: str, payload: dict[str, Any],
                            claims: list[dict[str, Any]]) -> dict[str, Any]:
        """A resync, in script calls of bounded work (``scripts/resync.lua``): each part
        gets the claims from the one the run wants next, about a part's work of them; a
        claim longer than a part goes alone, in pieces of a part's blocks."""
        part, offset, start = 0, 0, 1
        while True:
            end, work = offset, 0
            while end < len(claims) and (end == offset or work + len(claims[end]["tab"]) <= RESYNC_WORK):
                work += 1 + len(claims[end]["tab"])
                end += 1
            call = {**payload, "part": part, "offset": offset, "claims": claims[offset:end], "piece": False,
                    "from": 1, "blocks": 0}
            if offset < len(claims) and len(claims[offset]["tab"]) > RESYNC_WORK:
                c = claims[offset]
                a, b = start - 1, start - 1 + RESYNC_WORK
                call.update(claims=[{**c, "tab": c["tab"][a:b], "hs": c["hs"][a:b]}], piece=True, **{"from": start},
                            blocks=len(c["tab"]))
            reply = await self._attached(lease_id, pool_id, call, self.store.resync)
            if reply["done"]:
                return reply
            part, offset, start = part + 1, reply["next"], reply.get("from", 1)

    async def _attached(self, lease_id: str, pool_id: str, payload: dict[str, Any], call: Any) -> dict[str, Any]:
        """A Sync script call; once more after attaching the lease again when the pool no
        longer knows it (LEASE_UNKNOWN: re-registered since it was attached)."""
        try:
            return await call(payload)
        except ScriptError:
            self._leases.pop(lease_id, None)
            _, payload["lease_left_ms"] = await self._attach(lease_id, [pool_id])
            return await call(payload)
