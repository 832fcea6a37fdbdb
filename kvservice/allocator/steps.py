"""The allocator's steps: creates, growth, forks, frees and commits planned per pool and
applied by ``scripts/step.lua``, and the sequence reads. A mixin of ``core.Allocator``: it
uses the allocator's store, settings, geometry and lease caches and lease attachment.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections import defaultdict
from typing import Any, Mapping

from kvservice import errors
from kvservice.allocator.checks import (MAX_INT, check_create, check_lease_id, check_request_id, commit_payload,
                                        epoch_error, fingerprint, seq_state, tag_fits)
from kvservice.allocator import events
from kvservice.allocator.codec import LEASE_UNKNOWN, STALE_EPOCH, TOO_BIG, ScriptError
from kvservice.allocator.generations import KNOWN_GENERATIONS, known_generation
from kvservice.allocator.runs import Probe, RunOps
from kvservice.allocator.domain import (Create, Order, SeqDelta, SeqState, StepOutcome, Update, format_sequence_id,
                                        parse_sequence_id, tier_orders_of)
from kvservice.common import hashing
from kvservice.common.grants import Grant, pack_blocks
from kvservice.common.geometry import Geometry

#: Placement's credit for a prompt block ready in a lower tier, as a share of a block
#: cached on the device (docs/allocator.md, "Placement"): a load is a copy of the block's
#: bytes, far cheaper than the forward that recomputes it, dearer than sharing it.
TIER_CREDIT = {"host": 0.9, "disk": 0.75}
#: Placement's credit for a prompt block that another pool holds (device or lower tier),
#: for a client that runs fetches: a copy from that pool's worker over the network.
FETCH_CREDIT = 0.6

#: Pools read at once by one call (ListPools, the placement of a create without pool id).
FAN_OUT = 64


class StepOps(RunOps):
    """``Allocator.step`` and ``get_sequence``, and their per-pool payloads (a step too
    big for one call: ``runs.RunOps``)."""

    # ------------------------------------------------------------ sequences

    async def get_sequence(self, sequence_id: str) -> SeqState:
        """A sequence's record. Its id's tag must be the one its lease gives (a wrong or
        missing one reads as an unknown sequence), except for an admin or on a server
        without authentication, who may leave the tag out."""
        pool_id, epoch, n, tag = parse_sequence_id(sequence_id)
        current, rec = await self.store.get_sequence(pool_id, n)
        if current is None:
            raise errors.NotFound(f"pool {pool_id} is not registered")
        if current != epoch:
            raise epoch_error(sequence_id, pool_id, epoch, current)
        if rec is None or rec["state"] or not tag_fits(tag, rec["lease_id"], pool_id, epoch, n):
            raise errors.NotFound(f"sequence {sequence_id} not found")
        _, geo = await self.geometry(pool_id)
        return seq_state(pool_id, epoch, {"sequence": n, **rec}, rec["lease_id"], geo.block_size)

    async def step(self, lease_id: str, updates: list[Update], creates: list[Create],
                   request_id: str = "", generations: Mapping[str, int] | None = None) -> StepOutcome:
        """Applies one step: per pool all-or-nothing. See StepRequest in the proto.
        ``generations``: each pool's generation as the caller heard it (a pool whose
        generation is another one refuses its part: RolledBack)."""
        token = KNOWN_GENERATIONS.set(generations or {})
        try:
            return await self._step(lease_id, updates, creates, request_id)
        finally:
            KNOWN_GENERATIONS.reset(token)

    async def _step(self, lease_id: str, updates: list[Update], creates: list[Create],
                    request_id: str) -> StepOutcome:
        check_lease_id(lease_id)
        check_request_id(request_id)
        s = self.settings
        if not updates and not creates:
            raise errors.InvalidArgument("a step needs at least one update or create")
        if len(updates) + len(creates) > s.max_items_per_call:
            raise errors.InvalidArgument(
                f"too many items: {len(updates) + len(creates)} in one call, at most {s.max_items_per_call}")

        by_pool: dict[str, dict[str, list]] = defaultdict(lambda: {"updates": [], "creates": []})
        seen: set[str] = set()
        parsed = self._sequence_ids
        for i, u in enumerate(updates):
            sid = u.sequence_id
            ids = parsed.get(sid)
            if ids is None or ids[4] != lease_id:
                pool_id, epoch, n, tag = parse_sequence_id(sid)
                if not tag_fits(tag, lease_id, pool_id, epoch, n):
                    await self._check_lease(lease_id)     # (an unknown or expired lease is the error then)
                    raise errors.NotFound(f"sequence {sid} not found")
                ids = (pool_id, epoch, n, format_sequence_id(pool_id, epoch, n, lease_id), lease_id, tag)
                if len(parsed) >= 100_000:
                    parsed.clear()
                parsed[sid] = ids
            pool_id, epoch, n, canonical, _, tag = ids
            if sid in seen:
                raise errors.InvalidArgument(f"sequence {sid} appears twice in one step")
            seen.add(sid)
            cached = self._geometry.get(pool_id)
            current, geo = cached if cached else await self.geometry(pool_id)
            if current != epoch:
                current, geo = await self.geometry(pool_id, refresh=True)
                if current != epoch:
                    raise epoch_error(sid, pool_id, epoch, current)
            payload = self._update_payload(u, n, epoch, geo, tag)
            if "_tokens" in payload:
                by_pool[pool_id].setdefault("tokens", {}).update(payload.pop("_tokens"))
            by_pool[pool_id]["updates"].append((i, canonical, payload))

        children = sum(len(u.fork_grow_to) for u in updates)
        if children > s.max_forks_per_call:
            raise errors.InvalidArgument(f"the step forks {children} children, at most {s.max_forks_per_call} per call")
        tenant = ""
        packed = [check_create(c, s.max_sequence_tokens) for c in creates]
        scans: dict[tuple, Probe] = {}     # (the step's prefix probes, placement's and the fetches')
        # The request's identity for retries: every field of every item.
        digest = ""
        if request_id:
            digest = fingerprint("step", [lease_id, [(sid, payload) for items in by_pool.values()
                                                     for _, sid, payload in items["updates"]],
                                          [(data, c.pool_id, c.extra_key, c.defer_commits, c.pool_role)
                                           for c, data in zip(creates, packed)]])
        if creates:
            explicit = sorted({c.pool_id for c in creates if c.pool_id})
            for pool_id in explicit:
                await self.geometry(pool_id)
                if any(c.pool_id == pool_id and c.pool_role and c.pool_role != self.role(pool_id) for c in creates):
                    raise errors.InvalidArgument(f"a create names pool {pool_id} (role {self.role(pool_id)}) with "
                                                 f"pool_role \"store\"")
                if await self.store.draining(pool_id):
                    raise errors.FailedPrecondition(f"pool {pool_id} is being drained: it takes no new sequence",
                                                    reason="DRAINING")
            anywhere = any(not c.pool_id for c in creates)
            candidates = (await self.store.pool_ids(cached=True) or await self.store.pool_ids()) if anywhere \
                else explicit
            if not candidates:
                raise errors.FailedPrecondition("no pool is registered")
            tenant, lease_left = await self._attach(lease_id, candidates)
            placed = [c.pool_id or await self._place(c, packed[i], tenant, scans) for i, c in enumerate(creates)]
            if anywhere and request_id:
                # A retry must land where the first attempt did (and find its outcome there).
                placed = await self.store.place(lease_id, request_id, digest, placed, self._request_ttl_ms())
                for pool_id in set(placed) - set(candidates):
                    await self.geometry(pool_id)
                    await self._attach(lease_id, [pool_id])
            for i, c in enumerate(creates):
                by_pool[placed[i]]["creates"].append((i, c, packed[i]))
        else:
            lease_left = 0
        if not tenant and self._quotas_on:
            tenant = await self._lease_tenant(lease_id)    # (its quotas)
        outcome = StepOutcome([None] * len(updates), [None] * len(creates), [])
        pools = list(by_pool)
        for pool_id in pools:
            await self.geometry(pool_id)
        big = {p for p in pools if self._too_big(p, by_pool[p])}
        pins = await self._pin_fetches(by_pool, big, tenant, scans) if any(c.fetches for c in creates) else []
        try:
            return await self._run_step(by_pool, pools, big, outcome, creates, lease_id, tenant, lease_left,
                                        request_id, digest)
        finally:
            if pins:
                await self._release_unused(pins, outcome)

    async def _run_step(self, by_pool: dict[str, dict[str, list]], pools: list[str], big: set[str],
                        outcome: StepOutcome, creates: list[Create], lease_id: str, tenant: str, lease_left: int,
                        request_id: str, digest: str) -> StepOutcome:
        payloads = [await self._pool_payload(p, by_pool[p], lease_id, tenant, lease_left, request_id, digest)
                    for p in pools if p not in big]
        replies = iter(await self.store.step(payloads) if payloads else [])
        first_error: errors.KvsError | None = None
        partial = False
        for pool_id in pools:
            reply: Any = ScriptError(TOO_BIG, {}) if pool_id in big else next(replies)
            for _ in range(4):
                if not isinstance(reply, ScriptError):
                    break
                if reply.code == TOO_BIG:
                    # (more than one call's work: the step in parts, in this pool)
                    details = reply.reply if pool_id not in big else None
                    try:
                        reply = await self._step_in_parts(pool_id, by_pool[pool_id], lease_id, tenant, lease_left,
                                                          request_id, digest, details)
                    except (errors.KvsError, ScriptError) as exc:
                        reply = exc
                    continue
                if reply.code == STALE_EPOCH:
                    await self.geometry(pool_id, refresh=True)
                else:  # LEASE_UNKNOWN: the pool forgot the lease (re-registered); attach again
                    self._leases.pop(lease_id, None)
                    tenant, lease_left = await self._attach(lease_id, [pool_id])
                payload = await self._pool_payload(pool_id, by_pool[pool_id], lease_id, tenant,
                                                   lease_left, request_id, digest)
                reply = (await self.store.step([payload]))[0]
            if isinstance(reply, Exception):
                outcome.failed_pools.append(pool_id)
                # (a step in parts refused after its commits and frees: those are the caller's)
                applied = getattr(reply, "applied", None)
                if applied:
                    self._collect_applied(pool_id, by_pool[pool_id], applied, outcome)
                    partial = True
                if isinstance(reply, (errors.ResourceExhausted, errors.RolledBack)):
                    reply.pool_id = pool_id
                if isinstance(reply, errors.ResourceExhausted) and not reply.quota:
                    await self.store.count_failure(pool_id)   # (a quota is the tenant's limit, not the pool's)
                if not isinstance(reply, errors.KvsError):
                    raise reply
                first_error = first_error or reply
                continue
            self._collect(pool_id, by_pool[pool_id], lease_id, reply, outcome)
            # (a step of updates alone never looked the lease up: its tenant, cached, for the grant)
            grant = step_grant(pool_id, lease_id, tenant or await self._lease_tenant(lease_id),
                               self._geometry[pool_id][1].block_size, reply)
            if grant is not None:
                outcome.grants[pool_id] = grant.signed(await self.grant_key(pool_id, grant.epoch))
        if outcome.tier_orders:
            outcome.tier_orders[:] = await self.signed_orders(outcome.tier_orders)
        if first_error is not None:
            if not creates and isinstance(first_error, (errors.NotFound, errors.PermissionDenied)):
                # Updates alone never look the lease up (a pool knows the leases of its
                # sequences): a refused sequence may be the sign of an unknown, revoked or
                # expired lease, and that is the error to report then.
                await self._check_lease(lease_id)
            if len(pools) > 1 or partial:
                first_error.partial = outcome
            raise first_error
        return outcome


    def _update_payload(self, u: Update, n: int, epoch: int, geo: Geometry, tag: str) -> dict[str, Any]:
        """The update as the step script takes it (``scripts/step.lua``). Runs for every
        update of every step: each field is read once (``u`` may be a proto message)."""
        sid = u.sequence_id
        t, g = u.num_tokens, u.grow_to
        if not -1 <= t <= MAX_INT:
            raise errors.InvalidArgument(f"sequence {sid}: num_tokens {t} is out of range")
        if not 0 <= g <= MAX_INT:
            raise errors.InvalidArgument(f"sequence {sid}: grow_to {g} is out of range")
        if t == 0:
            raise errors.InvalidArgument(f"sequence {sid}: num_tokens must be >= 1 (or -1)")
        forks = list(u.fork_grow_to)
        free = u.free
        if free and (g or forks):
            raise errors.InvalidArgument(f"sequence {sid} cannot be freed and forked or grown in one step")
        if forks:
            if len(forks) > self.settings.max_forks_per_sequence:
                raise errors.InvalidArgument(
                    f"sequence {sid}: {len(forks)} forks, at most {self.settings.max_forks_per_sequence} per step")
            for f in forks:
                if not 0 <= f <= MAX_INT:
                    raise errors.InvalidArgument(f"sequence {sid}: fork_grow_to {f} is out of range")
        longest = max(g, max(forks, default=0))
        if longest > self.settings.max_sequence_tokens:
            raise errors.InvalidArgument(f"sequence {sid}: {longest} tokens, a sequence holds at most "
                                         f"{self.settings.max_sequence_tokens} (max_sequence_tokens)")
        payload = {"sequence": n, "tag": tag, "epoch": epoch, "num_tokens": t, "grow_to": g, "free": free,
                   "num_committed_blocks": 0, "parent_hash": "", "fork_grow_to": forks, "commits": []}
        commits = u.commits
        if not commits:
            return payload
        if t < 0:
            raise errors.InvalidArgument(f"sequence {sid}: commits need num_tokens")
        commit_payload(payload, f"sequence {sid}", u.parent_hash, commits, geo.block_size)
        if self.settings.kv_events:
            payload["_tokens"] = events.chain_records(payload["parent_hash"], payload["commits"], b"".join(
                hashing.token_bytes_checked(c.token_ids, "commit") for c in commits), geo.block_size)
        return payload

    def _too_big(self, pool_id: str, items: dict[str, list]) -> bool:
        """Whether a pool's part of a step is known to need more than one call before it is
        tried: its creates hold, or its commits register, more blocks than one call takes."""
        s = self.settings
        bs = self._geometry[pool_id][1].block_size
        blocks = sum(-(-(len(data) // 4) // bs) for _, _, data in items["creates"])
        commits = sum(len(p["commits"]) for _, _, p in items["updates"])
        return blocks > s.max_blocks_per_call or commits > s.max_blocks_per_call

    def _create_payloads(self, pool_id: str, items: dict[str, list], tenant: str, epoch: int,
                         geo: Geometry) -> list[dict[str, Any]]:
        """A pool's creates as the step script takes them; their block hashes (for the
        replies) in ``items["hashes"]``."""
        creates = []
        items["hashes"] = []
        bs = geo.block_size
        fetch = items.get("fetch", {})
        for j, (_, c, data) in enumerate(items["creates"]):
            root = hashing.root_hash(self._salt(tenant), c.extra_key)
            n = len(data) // 4
            hs = hashing.chain_hashes(root, data, bs, n // bs)
            creates.append({"epoch": epoch, "num_tokens": n, "root_hash": root.hex(),
                            "block_hashes": [h.hex() for h in hs], "tier_loads": c.tier_loads,
                            "defer": c.defer_commits})
            if j in fetch:
                creates[-1]["fetch"] = {"from": fetch[j][0], "n": len(fetch[j][1])}
            items["hashes"].append(hs)
        return creates

    def _step_payload(self, pool_id: str, updates: list[dict[str, Any]], creates: list[dict[str, Any]],
                      lease_id: str, tenant: str, lease_left: int, request_id: str, digest: str) -> dict[str, Any]:
        """One step script call (``scripts/step.lua``). ``lease_left``: the lease's time left
        (ms) as its record told, which the pool's shard adds to its own clock; 0 when the
        lease is known to be attached to the pool already (the script then reads its
        deadline there)."""
        s = self.settings
        return {"pool": pool_id, "generation": known_generation(pool_id), "request_id": request_id, "fingerprint": digest,
                "request_ttl_ms": self._request_ttl_ms(), "lease_id": lease_id, "lease_left_ms": lease_left,
                "tenant": tenant, "quota": self.quota(tenant),
                "max_blocks": s.max_blocks_per_call, "max_fork_refs": s.max_fork_refs_per_call,
                "max_release": s.max_release_per_call, "updates": updates, "creates": creates}

    async def _pool_payload(self, pool_id: str, items: dict[str, list], lease_id: str, tenant: str,
                            lease_left: int, request_id: str, digest: str) -> dict[str, Any]:
        """A pool's part of a step in one step script call."""
        epoch, geo = await self.geometry(pool_id)
        creates = self._create_payloads(pool_id, items, tenant, epoch, geo)
        if self.settings.kv_events:
            await self._note_tokens(pool_id, items, creates, geo)
        return self._step_payload(pool_id, [payload for _, _, payload in items["updates"]], creates, lease_id,
                                  tenant, lease_left, request_id, digest)

    async def _note_tokens(self, pool_id: str, items: dict[str, list], creates: list[dict[str, Any]],
                           geo: Geometry) -> None:
        """The token records of the hashes this part of a step registers (``events``)."""
        records: dict[str, bytes] = dict(items.get("tokens", {}))
        for (_, _, data), c in zip(items["creates"], creates):
            records[events.tokens_key(c["root_hash"])] = events.ROOT
            records.update(events.chain_records(c["root_hash"], c["block_hashes"], data, geo.block_size))
        await events.note_tokens(self.store.redis, records)

    async def _scan(self, c: Create, data: bytes, tenant: str, pool_id: str, scans: dict[tuple, Probe],
                    tiers: bool) -> tuple[int, Geometry, list[str], Probe] | None:
        """A pool's epoch, geometry, the create's chain of hashes there (the blocks a hit
        may cover) and its prefix probe (``scans`` keeps a step's probes: placement's and
        the fetches'); None for a pool gone."""
        try:
            epoch, geo = await self.geometry(pool_id)
        except errors.NotFound:
            return None
        root = hashing.root_hash(self._salt(tenant), c.extra_key)
        max_hit = (len(data) // 4 - 1) // geo.block_size
        hs = [h.hex() for h in hashing.chain_hashes(root, data, geo.block_size, max_hit)]
        key = (pool_id, epoch, hs[-1] if hs else root.hex(), len(hs), tiers)
        probe = scans.get(key)
        if probe is None:
            probe = scans[key] = await self._probe_prefix(pool_id, epoch, hs, tiers=tiers)
        return epoch, geo, hs, probe

    async def _scan_all(self, c: Create, data: bytes, tenant: str, scans: dict[tuple, Probe], tiers: bool,
                        pools: list[str] | None = None) -> dict[str, tuple[int, Geometry, list[str], Probe]]:
        """``_scan`` of every registered pool (this replica's recent list; the registry if
        that has none), ``FAN_OUT`` at once."""
        out: dict[str, tuple[int, Geometry, list[str], Probe]] = {}
        for cached in (True, False):
            listed = pools if pools is not None else await self.store.pool_ids(cached=cached)
            for i in range(0, len(listed), FAN_OUT):
                part = listed[i:i + FAN_OUT]
                got = await asyncio.gather(*(self._scan(c, data, tenant, p, scans, tiers) for p in part))
                out.update((p, x) for p, x in zip(part, got) if x is not None)
            if out or pools is not None:
                break
        return out

    async def _place(self, c: Create, data: bytes, tenant: str, scans: dict[tuple, Probe]) -> str:
        """The pool where ``c`` costs least (docs/allocator.md, "Placement"): the prompt
        tokens it would compute there (those its cached prefix does not cover; for a
        client that runs loads, a block ready in a lower tier covers ``TIER_CREDIT`` of
        its tokens; for a client that runs fetches, a block that another pool of the same
        geometry holds past this one's prefix covers ``FETCH_CREDIT``) plus a block's worth
        of tokens per sequence the pool already serves (each one a token of every step's
        work); then the most free + evictable blocks, the smallest id. A pool whose worker
        has not heartbeated for ``placement_silence`` seconds comes after every other (its
        worker has likely stopped: its sequences would fail)."""
        num_tokens = len(data) // 4
        silence_ms = self.settings.placement_silence * 1000
        found = await self._scan_all(c, data, tenant, scans, c.tier_loads or c.fetches)
        # (a store's pools take only the store's creates, and only they)
        found = {p: x for p, x in found.items() if (self.role(p) == "store") == (c.pool_role == "store")}
        if not found:
            raise errors.FailedPrecondition("no store pool is registered" if c.pool_role else
                                            "no pool is registered (store pools take only a store's creates)")
        # (passed over: pools being drained; decode pools while a prefill or both pool is up)
        skip = {p for p in found if await self.store.draining(p)}
        if len(skip) == len(found):
            raise errors.FailedPrecondition("every pool is being drained", reason="DRAINING")
        decode_only = {p for p in found if self.role(p) == "decode"} - skip
        if decode_only != set(found) - skip:
            skip |= decode_only
        scored: list[tuple[bool, float, int, str]] = []
        for pool_id, (_, geo, _, probe) in found.items():
            if pool_id in skip:
                continue
            if c.tier_loads:
                cached = (probe.chain - probe.host - probe.disk + TIER_CREDIT["host"] * probe.host
                          + TIER_CREDIT["disk"] * probe.disk)
            else:
                cached = probe.hits
            if c.fetches:
                elsewhere = max((x[3].chain for p, x in found.items() if p != pool_id and _same_kv(x[1], geo)),
                                default=0)
                cached += FETCH_CREDIT * max(0, elsewhere - (probe.chain if c.tier_loads else probe.hits))
            cost = num_tokens - cached * geo.block_size + probe.sequences * geo.block_size
            scored.append((probe.silent_ms > silence_ms, cost, -probe.available, pool_id))
        return min(scored)[3]

    async def _pin_fetches(self, by_pool: dict[str, dict[str, list]], skip: set[str], tenant: str,
                           scans: dict[tuple, Probe]) -> list[tuple[str, int, str]]:
        """For each create of a client that runs fetches (DESIGN §13): the pool of the same
        geometry whose chain (device, or a ready lower-tier entry) goes furthest past the
        create's own pool's prefix, when one does; those blocks are pinned there for the
        fetch (``scripts/pin.lua``) and the create's payload names them
        (``items["fetch"][j]``: first position, [[tier, block or entry]], hashes, source
        pool, its epoch, pin id, the source's serial). Returns the pins taken: (pool, epoch,
        pin id)."""
        taken: list[tuple[str, int, str]] = []
        for pool_id, items in by_pool.items():
            if pool_id in skip:
                continue
            for j, (_, c, data) in enumerate(items["creates"]):
                if not c.fetches:
                    continue
                own = await self._scan(c, data, tenant, pool_id, scans, True)
                if own is None:
                    continue
                _, geo, hs, probe = own
                start = probe.chain if c.tier_loads else probe.hits
                if start >= len(hs):
                    continue
                others = [p for p in await self.store.pool_ids(cached=True) if p != pool_id]
                found = await self._scan_all(c, data, tenant, scans, True, others)
                best = max(((x[3].chain, p) for p, x in found.items() if _same_kv(x[1], geo)), default=(0, ""))
                if best[0] <= start:
                    continue
                source = best[1]
                epoch = found[source][0]
                wanted = hs[start:min(best[0], start + self.settings.max_blocks_per_call)]
                pin_id, ttl_ms = secrets.token_hex(16), int(self.settings.fetch_pin_ttl * 1000)
                try:
                    pinned, serial = await self.store.pin(source, epoch, pin_id, ttl_ms, wanted)
                except (errors.KvsError, ScriptError):
                    continue       # (the source re-registered or is gone: the create recomputes)
                if pinned:
                    self.reap_schedule.expect([source], ttl_ms)     # (swept by its deadline, if never released)
                    items.setdefault("fetch", {})[j] = (start + 1, pinned, wanted, source, epoch, pin_id, serial)
                    taken.append((source, epoch, pin_id))
        return taken

    async def _release_unused(self, pins: list[tuple[str, int, str]], outcome: StepOutcome) -> None:
        """Releases the pins that no fetch order of the outcome names (the create found its
        prefix in its own pool after all, or the step failed there)."""
        used = {o.pin_id for o in outcome.tier_orders if o.source_pool_id}
        for source, epoch, pin_id in pins:
            if pin_id not in used:
                try:
                    await self.store.tier_settle(source, epoch, [], [pin_id])
                except (errors.KvsError, ScriptError):
                    pass           # (released at its deadline then)

    async def migrate_sequence(self, lease_id: str, sequence_id: str, pool_id: str, block_hashes: bytes,
                               request_id: str = "") -> tuple[SeqState, list[tuple], int]:
        """A copy of a live sequence in another pool (DESIGN §13, ``Sequence.migrate``):
        its blocks are pinned where they are (``pin.lua``), a sequence of the same length,
        commits and last hash is made in ``pool_id`` (or where placement puts it: the pool
        of the same geometry with the least load, neither the source nor draining), sharing
        the committed blocks that pool caches and taking new blocks for the rest, each with
        a fetch order from the source; then the source sequence is freed (its blocks stay,
        held by the pin, until the fetches ran). ``block_hashes``: the hash of each committed block, 16 bytes each (the
        caller's record). Returns the copy, its fetch orders and the destination's
        generation."""
        check_lease_id(lease_id)
        check_request_id(request_id)
        source, epoch, n, tag = parse_sequence_id(sequence_id)
        if not tag_fits(tag, lease_id, source, epoch, n):
            await self._check_lease(lease_id)
            raise errors.NotFound(f"sequence {sequence_id} not found")
        current, rec = await self.store.get_sequence(source, n)
        if current is None:
            raise errors.NotFound(f"pool {source} is not registered")
        if current != epoch:
            raise epoch_error(sequence_id, source, epoch, current)
        if rec is None or rec["state"] or rec["lease_id"] != lease_id:
            raise errors.NotFound(f"sequence {sequence_id} not found")
        _, geo = await self.geometry(source)
        bs, committed = geo.block_size, rec["num_committed_blocks"]
        if len(block_hashes) != committed * hashing.HASH_BYTES:
            raise errors.InvalidArgument(f"sequence {sequence_id} has {committed} committed blocks: block_hashes "
                                         f"needs {committed * hashing.HASH_BYTES} bytes, got {len(block_hashes)}")
        hashes = [block_hashes[i:i + hashing.HASH_BYTES].hex() for i in range(0, len(block_hashes),
                                                                              hashing.HASH_BYTES)]
        if len(rec["block_table"]) > self.settings.max_blocks_per_call:
            raise errors.InvalidArgument(f"sequence {sequence_id} holds {len(rec['block_table'])} blocks; a migration "
                                         f"moves at most {self.settings.max_blocks_per_call} (max_blocks_per_call)")
        dest = pool_id or await self._migration_target(source, geo, hashes)
        if dest == source:
            raise errors.InvalidArgument(f"sequence {sequence_id} is in pool {source} already")
        dest_epoch, dest_geo = await self.geometry(dest)
        if not _same_kv(dest_geo, geo):
            raise errors.InvalidArgument(f"pool {dest} holds another KV layout than pool {source}: a block of one "
                                         f"cannot fill a block of the other")
        if await self.store.draining(dest):
            raise errors.FailedPrecondition(f"pool {dest} is being drained: it takes no new sequence",
                                            reason="DRAINING")
        tenant, lease_left = await self._attach(lease_id, [dest])
        pin_id, ttl_ms = secrets.token_hex(16), int(self.settings.fetch_pin_ttl * 1000)
        pinned, serial = await self.store.pin(source, epoch, pin_id, ttl_ms, [], blocks=rec["block_table"])
        self.reap_schedule.expect([source], ttl_ms)
        create = {"epoch": dest_epoch, "num_tokens": rec["num_tokens"], "root_hash": rec["last_hash"],
                  "block_hashes": hashes,
                  "tier_loads": False, "fetch": {"from": 1, "n": len(pinned)}, "migrate": True}
        digest = fingerprint("migrate", [lease_id, sequence_id, dest, block_hashes]) if request_id else ""
        try:
            for _ in range(2):
                payload = self._step_payload(dest, [], [create], lease_id, tenant, lease_left, request_id, digest)
                reply = (await self.store.step([payload]))[0]
                if not (isinstance(reply, ScriptError) and reply.code == LEASE_UNKNOWN):
                    break
                self._leases.pop(lease_id, None)      # (the pool does not know the lease yet: attach it)
                tenant, lease_left = await self._attach(lease_id, [dest])
            if isinstance(reply, ScriptError):      # (re-registered meanwhile, or more than one call's work)
                raise errors.FailedPrecondition(f"pool {dest} changed during the migration ({reply.code}); retry")
            if isinstance(reply, Exception):
                raise reply
        except BaseException:
            await self._release_unused([(source, epoch, pin_id)], StepOutcome([], [], []))
            raise
        made = seq_state(dest, reply["epoch"], reply["created"][0], lease_id, bs)
        # The source sequence goes (its blocks stay, held by the pin, until the fetches ran).
        try:
            await self.step(lease_id, [Update(sequence_id, free=True)], [],
                            f"{request_id}.free" if request_id else "")
        except BaseException:
            await self.step(lease_id, [Update(made.sequence_id, free=True)], [])
            await self._release_unused([(source, epoch, pin_id)], StepOutcome([], [], []))
            raise
        made.block_hashes = tuple(bytes.fromhex(h) for h in hashes)
        orders = []
        for _, position, block in reply.get("fetches") or ():
            tier, src = pinned[position - 1] if position <= len(pinned) else (0, -1)
            h = bytes.fromhex(hashes[position - 1]) if position <= len(hashes) else b""
            orders.append(Order(dest, reply["epoch"], tier, src, 0, block, h, source, epoch, pin_id, serial))
        orders = await self.signed_orders(orders)
        if not orders:
            await self._release_unused([(source, epoch, pin_id)], StepOutcome([], [], []))
        grant = step_grant(dest, lease_id, tenant, bs, reply)
        if grant is not None:
            grant = grant.signed(await self.grant_key(dest, grant.epoch))
        return made, orders, int(reply["generation"]), grant

    async def _migration_target(self, source: str, geo: Geometry, hashes: list[str]) -> str:
        """Where a migrating sequence goes when the caller names no pool: among the pools of
        the same KV layout but its own and the draining ones, the one that caches most of its
        committed blocks less its load (``_place``'s cost), then the most blocks available; a
        prefill pool (``RegisterPoolRequest.role``) only if no other can take it."""
        scored = []
        for pool_id in await self.store.pool_ids(cached=True):
            if pool_id == source:
                continue
            try:
                epoch, g = await self.geometry(pool_id)
            except errors.NotFound:
                continue
            if not _same_kv(g, geo) or self.role(pool_id) == "store" or await self.store.draining(pool_id):
                continue
            probe = await self._probe_prefix(pool_id, epoch, hashes)
            # (a prefill pool only when no decode or both pool can take it)
            scored.append((self.role(pool_id) == "prefill", probe.sequences - probe.hits, -probe.available, pool_id))
        if not scored:
            raise errors.FailedPrecondition(f"no other pool of pool {source}'s KV layout takes new sequences")
        return min(scored)[3]

    def _collect_applied(self, pool_id: str, items: dict[str, list], applied: dict[int, dict[str, Any]],
                         outcome: StepOutcome) -> None:
        """The deltas of the updates a refused step in parts applied first (commits, lengths,
        frees: ``runs.RunOps._step_in_parts``)."""
        for k, d in applied.items():
            i, sid, _ = items["updates"][k]
            outcome.updates[i] = SeqDelta(sid, d["num_tokens"], [], None, d["num_committed_blocks"],
                                          bytes.fromhex(d["last_hash"]), [], bool(d.get("freed")))

    def _collect(self, pool_id: str, items: dict[str, list], lease_id: str, reply: dict[str, Any],
                 outcome: StepOutcome) -> None:
        epoch = reply["epoch"]
        bs = self._geometry[pool_id][1].block_size
        updates = outcome.updates
        for (i, sid, _), d in zip(items["updates"], reply["updates"]):
            cow = d.get("cow")
            updates[i] = SeqDelta(sid, d["num_tokens"], d.get("new_blocks", []), tuple(cow) if cow else None,
                                  d["num_committed_blocks"], bytes.fromhex(d["last_hash"]),
                                  [seq_state(pool_id, epoch, k, lease_id, bs) for k in d["children"]], d["freed"])
        for j, ((i, _, _), rec) in enumerate(zip(items["creates"], reply["created"])):
            state = seq_state(pool_id, epoch, rec, lease_id, bs)
            state.block_hashes = tuple(items["hashes"][j][:state.num_committed_blocks])
            outcome.created[i] = state
        outcome.copies.extend((pool_id, src, dst) for src, dst in reply["copies"])
        outcome.tier_orders.extend(tier_orders_of(pool_id, epoch, reply))
        fetch = items.get("fetch", {})
        for ci, position, block in reply.get("fetches") or ():
            # (src -1: no pin of this attempt holds the block, as for the replayed reply of
            # a retried step: its client recomputes it)
            h = items["hashes"][ci - 1][position - 1]
            first, pinned, _, source, source_epoch, pin_id, serial = fetch.get(ci - 1, (0, [], [], pool_id, epoch,
                                                                                        "", 0))
            k = position - first
            tier, src = pinned[k] if 0 <= k < len(pinned) else (0, -1)
            outcome.tier_orders.append(Order(pool_id, epoch, tier, src, 0, block, h, source, source_epoch, pin_id, serial))
        outcome.generations[pool_id] = int(reply["generation"])

    def _salt(self, tenant: str) -> str:
        """The prefix-cache salt of a tenant's creates (docs/security.md): its own name,
        its group's (``group:<name>``), or none ("global"); with a secret, the HMAC of
        that under the secret."""
        if self.settings.prefix_cache_scope != "tenant":
            return ""
        group = self._groups.get(tenant)
        scope = f"group:{group}" if group else tenant
        if self._secret is None:
            return scope
        return "hmac:" + hmac.new(self._secret, scope.encode(), hashlib.sha256).hexdigest()


def step_grant(pool_id: str, lease_id: str, tenant: str, block_size: int, reply: dict[str, Any]) -> Grant | None:
    """The grant (unsigned) of what a step's reply in one pool gave the lease: to write,
    the blocks appended, copied on write, created for it (loaded and fetched ones too); to
    read, the cached blocks its creates share. None when it gave nothing."""
    write: list[int] = []
    read: list[int] = []
    for d in reply["updates"]:
        write.extend(d.get("new_blocks") or ())
        if d.get("cow"):
            write.append(d["cow"][1])
        for child in d.get("children") or ():     # (its parent's blocks are the lease's already)
            write.extend(child["block_table"][int(child.get("shared") or 0):])
            if child.get("cow"):
                write.append(child["cow"][1])
    filled = {int(o[3]) for o in reply.get("tier_orders") or () if int(o[2]) == 0}
    filled.update(int(f[2]) for f in reply.get("fetches") or ())
    for rec in reply["created"]:
        table = list(rec["block_table"])
        shared = int(rec["num_cached_tokens"]) // block_size
        for b in table[:shared]:
            (write if b in filled else read).append(b)
        write.extend(table[shared:])
    if not write and not read:
        return None
    return Grant(pool_id, int(reply["epoch"]), int(reply["generation"]), lease_id, tenant, int(reply["serial"]),
                 pack_blocks(write), pack_blocks(read))


def _same_kv(a: Geometry, b: Geometry) -> bool:
    """Whether two pools' blocks hold the same KV layout (a block of one can fill one of
    the other): all but the number of blocks."""
    return (a.block_size, a.num_layers, a.num_kv_heads, a.head_dim, a.dtype) == \
        (b.block_size, b.num_layers, b.num_kv_heads, b.head_dim, b.dtype)


