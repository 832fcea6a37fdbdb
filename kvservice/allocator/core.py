"""The allocator: validates requests, computes block hashes, plans per-pool script calls.

Stateless apart from caches of immutable facts (a pool's geometry per epoch, a lease's
tenant), so any number of replicas can serve one Redis. Raises ``kvservice.errors``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import secrets
from collections import defaultdict
from typing import Any

from kvservice import errors
from kvservice.allocator import codec
from kvservice.common import hashing
from kvservice.allocator.codec import STALE_EPOCH, ScriptError
from kvservice.allocator.config import Settings, cache_groups
from kvservice.allocator.domain import (LEASE_ID, REQUEST_ID, TENANT, Create, Heartbeat, LeaseInfo, PoolInfo,
                                        ReserveGrant,
                                        ReserveRequest, SeqDelta, SeqState, StepOutcome, Update, format_sequence_id,
                                        parse_sequence_id)
from kvservice.allocator.journal import journal_payload, resync_payload
from kvservice.allocator.store import Store
from kvservice.common.geometry import Geometry
from kvservice.common.security import read_secret
from kvservice.common.settings import check_pool_id, echo

log = logging.getLogger(__name__)
MAX_INT = 2**31 - 1
#: Pools read at once by one call (ListPools, the placement of a create without pool id).
FAN_OUT = 64
DEFAULT_PAGE, MAX_PAGE = 100, 1000


class Allocator:
    """Pools, leases and sequences over one ``Store``."""

    def __init__(self, store: Store, settings: Settings | None = None) -> None:
        self.store = store
        self.settings = settings or Settings()
        self._geometry: dict[str, tuple[int, Geometry]] = {}
        self._leases: dict[str, tuple[str, set[str]]] = {}   # lease -> (tenant, attached pools)
        self._sequence_ids: dict[str, tuple[str, int, int, str]] = {}   # parsed ids of recent steps
        #: Leases this replica granted (retries of one request count once); read by metrics.
        self.leases_granted = 0
        self._groups = cache_groups(self.settings.prefix_cache_groups)
        self._secret: bytes | None = None
        if self.settings.prefix_cache_secret_file:
            self._secret = read_secret(self.settings.prefix_cache_secret_file, "prefix_cache_secret_file").encode()

    # ------------------------------------------------------------ pools

    async def register_pool(self, pool_id: str, geometry: Geometry, worker_address: str = "",
                            request_id: str = "") -> PoolInfo:
        if pool_id:
            _check_pool_id(pool_id)
        geometry.check()
        _check_request_id(request_id)
        if len(worker_address) > 256:
            raise errors.InvalidArgument("worker_address is longer than 256 characters")
        if not pool_id:
            pool_id = await self.store.new_pool_id(request_id, self._request_ttl_ms())
        payload = {"pool": pool_id, "request_id": request_id, "request_ttl_ms": self._request_ttl_ms(),
                   "num_blocks": geometry.num_blocks, "block_size": geometry.block_size,
                   "num_layers": geometry.num_layers, "num_kv_heads": geometry.num_kv_heads,
                   "head_dim": geometry.head_dim, "dtype": geometry.dtype,
                   "worker_address": worker_address}
        payload["fingerprint"] = fingerprint("register", payload)
        reply = await self.store.register_pool(payload)
        self._geometry[pool_id] = (int(reply["epoch"]), geometry)
        log.info("pool %s registered: epoch %s, %d blocks of %d tokens", pool_id, reply["epoch"],
                 geometry.num_blocks, geometry.block_size)
        return PoolInfo(pool_id, int(reply["epoch"]), geometry, worker_address, int(reply["registered_ms"]))

    async def list_pools(self) -> list[PoolInfo]:
        """Every pool (read a page of ``FAN_OUT`` at a time)."""
        out: list[PoolInfo] = []
        ids = sorted(await self.store.pool_ids())
        for i in range(0, len(ids), FAN_OUT):
            out.extend(await self._describe_many(ids[i:i + FAN_OUT]))
        return out

    async def list_pools_page(self, page_size: int = 0, page_token: str = "") -> tuple[list[PoolInfo], str]:
        """One page of pools in pool-id order, and the next page's token ("" after the last)."""
        if page_size < 0:
            raise errors.InvalidArgument(f"page_size must be >= 0, got {page_size}")
        size = min(page_size or DEFAULT_PAGE, MAX_PAGE)
        after = ""
        if page_token:
            try:
                after = base64.urlsafe_b64decode(page_token.encode()).decode().removeprefix("after:")
            except (ValueError, UnicodeDecodeError):
                after = None
            if not after:
                raise errors.InvalidArgument(f"malformed page_token {echo(page_token)}")
        ids = sorted(p for p in await self.store.pool_ids() if p > after)
        page = ids[:size]
        infos: list[PoolInfo] = []
        for i in range(0, len(page), FAN_OUT):
            infos.extend(await self._describe_many(page[i:i + FAN_OUT]))
        token = base64.urlsafe_b64encode(f"after:{page[-1]}".encode()).decode() if len(ids) > size else ""
        return infos, token

    async def _describe_many(self, pool_ids: list[str]) -> list[PoolInfo]:
        infos = await asyncio.gather(*(self._describe(p) for p in pool_ids))
        return [i for i in infos if i is not None]

    async def describe_pool(self, pool_id: str) -> PoolInfo:
        _check_pool_id(pool_id)
        info = await self._describe(pool_id)
        if info is None:
            raise errors.NotFound(f"pool {pool_id} is not registered")
        return info

    async def _describe(self, pool_id: str) -> PoolInfo | None:
        counts = await self.store.pool_counts(pool_id)
        if counts is None:
            return None
        meta = counts["meta"]
        geometry = _geometry_of(meta)
        self._geometry[pool_id] = (int(meta["epoch"]), geometry)
        stats: dict[str, float] = {k: v for k, v in counts.items() if k.startswith("num_")}
        stats.update(counts["stats"])
        stats["num_blocks"] = geometry.num_blocks
        stats["usage"] = counts["num_used_blocks"] / geometry.num_blocks
        return PoolInfo(pool_id, int(meta["epoch"]), geometry, meta.get("worker_address", ""),
                        int(meta.get("registered_ms", 0)), stats, int(meta.get("heartbeat_ms", 0)))

    async def heartbeat(self, pool_id: str, epoch: int, dead_since_ms: int = 0) -> Heartbeat:
        """Records a worker's heartbeat; returns the epoch, the Redis time and the leases
        that died in the pool since ``dead_since_ms``."""
        _check_pool_id(pool_id)
        if not 1 <= epoch <= MAX_INT:
            raise errors.InvalidArgument(f"epoch must be in 1..{MAX_INT}, got {epoch}")
        if not 0 <= dead_since_ms <= 2**62:
            raise errors.InvalidArgument(f"dead_since_ms {dead_since_ms} is out of range")
        reply = await self.store.heartbeat(pool_id, epoch, dead_since_ms)
        return Heartbeat(int(reply["epoch"]), int(reply["heartbeat_ms"]), list(reply["dead"]),
                         int(reply["dead_until_ms"]))

    async def geometry(self, pool_id: str, *, refresh: bool = False) -> tuple[int, Geometry]:
        """The pool's current epoch and geometry (cached per epoch)."""
        if refresh or pool_id not in self._geometry:
            meta = await self.store.pool_meta(pool_id)
            if meta is None:
                self._geometry.pop(pool_id, None)
                raise errors.NotFound(f"pool {pool_id} is not registered")
            self._geometry[pool_id] = (int(meta["epoch"]), _geometry_of(meta))
        return self._geometry[pool_id]

    # ------------------------------------------------------------ leases

    async def grant_lease(self, tenant: str, ttl_seconds: float, request_id: str = "") -> LeaseInfo:
        tenant = tenant or "default"
        if not TENANT.fullmatch(tenant):
            raise errors.InvalidArgument(f"malformed tenant {echo(tenant)}")
        s = self.settings
        if not s.min_lease_ttl <= ttl_seconds <= s.max_lease_ttl:
            raise errors.InvalidArgument(
                f"ttl_seconds must be in {s.min_lease_ttl}..{s.max_lease_ttl}, got {ttl_seconds}")
        _check_request_id(request_id)
        if request_id:
            lease_id = hashlib.blake2b(f"{tenant}\0{request_id}".encode(), digest_size=8).hexdigest()
        else:
            lease_id = secrets.token_hex(8)
        ttl_ms = max(1, round(ttl_seconds * 1000))
        reply = await self.store.grant_lease({"lease_id": lease_id, "tenant": tenant, "ttl_ms": ttl_ms,
                                              "fingerprint": fingerprint("grant", [tenant, ttl_ms]),
                                              "request_id": request_id, "tombstone_ms": self._tombstone_ms()})
        if not reply.get("replay"):
            self.leases_granted += 1
        return _lease_info(reply)

    async def keep_alive(self, lease_id: str) -> LeaseInfo:
        _check_lease_id(lease_id)
        reply = await self.store.keep_alive(lease_id, self._tombstone_ms())
        return _lease_info(reply)

    async def revoke_lease(self, lease_id: str) -> int:
        """Revokes a lease and frees its sequences; returns how many were freed."""
        _check_lease_id(lease_id)
        pools = await self.store.revoke_lease(lease_id)
        self._leases.pop(lease_id, None)
        freed = 0
        for pool_id in pools:
            while True:
                try:
                    reply = await self.store.reap(pool_id, force_lease=lease_id,
                                                  tombstone_ms=self._tombstone_ms())
                except errors.NotFound:
                    break
                freed += reply["sequences"]
                if not reply["more"]:
                    break
        return freed

    async def reap(self) -> dict[str, int]:
        """Frees the sequences of every expired lease in every pool (idempotent)."""
        total = {"leases": 0, "sequences": 0}
        for pool_id in await self.store.pool_ids():
            for _ in range(1000):
                try:
                    reply = await self.store.reap(pool_id, tombstone_ms=self._tombstone_ms())
                except errors.NotFound:
                    break
                total["leases"] += reply["leases"]
                total["sequences"] += reply["sequences"]
                if not reply["more"]:
                    break
        return total

    # ------------------------------------------------------------ reserves

    async def sync(self, lease_id: str, pools: list[ReserveRequest],
                   request_id: str = "") -> tuple[LeaseInfo, list[ReserveGrant]]:
        """Keeps the lease alive, then refills or takes back its reserve in each pool
        (one script call per pool, all-or-nothing per pool). See SyncRequest in the proto."""
        _check_lease_id(lease_id)
        _check_request_id(request_id)
        if len(pools) > self.settings.max_items_per_call:
            raise errors.InvalidArgument(f"{len(pools)} pools in one Sync, at most {self.settings.max_items_per_call}")
        seen: set[str] = set()
        for r in pools:
            _check_pool_id(r.pool_id)
            if r.pool_id in seen:
                raise errors.InvalidArgument(f"pool {r.pool_id} appears twice in one Sync")
            seen.add(r.pool_id)
            if not 1 <= r.epoch <= MAX_INT:
                raise errors.InvalidArgument(f"pool {r.pool_id}: epoch must be in 1..{MAX_INT}, got {r.epoch}")
            if not 0 <= r.want_blocks <= MAX_INT:
                raise errors.InvalidArgument(f"pool {r.pool_id}: want_blocks {r.want_blocks} is out of range")
            if not 0 <= r.need_blocks <= self.settings.max_blocks_per_call:
                raise errors.InvalidArgument(f"pool {r.pool_id}: need_blocks {r.need_blocks} is out of range "
                                             f"(0..{self.settings.max_blocks_per_call})")
            if r.entries is not None and len(r.entries) > self.settings.max_items_per_call:
                raise errors.InvalidArgument(f"pool {r.pool_id}: {len(r.entries)} journal entries, at most "
                                             f"{self.settings.max_items_per_call} per call")
            if len(r.returned_blocks) > self.settings.max_blocks_per_call:
                raise errors.InvalidArgument(f"pool {r.pool_id}: {len(r.returned_blocks)} returned blocks, at most "
                                             f"{self.settings.max_blocks_per_call} per call")
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
                entries[r.pool_id] = resync_payload(r, geo)
            else:
                entries[r.pool_id] = journal_payload(r.entries, r.first_entry, r.pool_id, geo,
                                                     self.settings.max_blocks_per_call, self.settings.max_forks_per_call)
        # The keep-alive first; each pool's script raises the lease's deadline there itself.
        kept = await self.store.keep_alive(lease_id, self._tombstone_ms(),
                                           touched_by_caller=[r.pool_id for r in pools])
        lease = _lease_info(kept)
        if not pools:
            return lease, []
        _, deadline = await self._attach(lease_id, [r.pool_id for r in pools])
        grants = await asyncio.gather(*(self._sync_pool(lease_id, r, entries[r.pool_id], deadline, request_id,
                                                        lease.deadline_ms) for r in pools))
        return lease, list(grants)

    async def _sync_pool(self, lease_id: str, r: ReserveRequest, entries: Any, deadline: int,
                         request_id: str, touch_ms: int) -> ReserveGrant:
        s = self.settings
        _, geo = await self.geometry(r.pool_id)
        cap = max(s.reserve_min_blocks, int(s.reserve_share * geo.num_blocks))
        if r.resync is not None:
            payload = {"pool": r.pool_id, "epoch": r.epoch, "request_id": request_id,
                       "fingerprint": fingerprint("resync", [lease_id, r.pool_id, r.epoch, r.first_entry, entries])
                       if request_id else "",
                       "request_ttl_ms": self._request_ttl_ms(), "lease_id": lease_id, "lease_deadline_ms": deadline,
                       "touch_deadline_ms": touch_ms, "first_entry": r.first_entry, "cap": cap, "claims": entries}
            reply = await self._attached(lease_id, r.pool_id, payload, self.store.resync)
            return ReserveGrant(r.pool_id, reply["epoch"], [], len(reply["reserve"]), reply["cap"], reply["applied"],
                                lost_sequences=tuple(reply["lost"]), reserve_blocks=tuple(reply["reserve"]),
                                resynced=True)
        returned = [int(b) for b in r.returned_blocks]
        # The entries are known by their numbers (a resend is a no-op by numbering): the
        # fingerprint covers the rest of the request and which entries it carries.
        request = [lease_id, r.pool_id, r.epoch, r.want_blocks, returned, r.first_entry, entries["n"],
                   r.want_sequence_numbers, r.need_blocks]
        payload = {"pool": r.pool_id, "epoch": r.epoch, "request_id": request_id,
                   "fingerprint": fingerprint("sync", request) if request_id else "",
                   "request_ttl_ms": self._request_ttl_ms(), "lease_id": lease_id, "lease_deadline_ms": deadline,
                   "touch_deadline_ms": touch_ms, "first_entry": r.first_entry, "journal": entries,
                   "want": r.want_blocks, "cap": cap,
                   "pressure_blocks": int(s.reserve_pressure_share * geo.num_blocks),
                   "pressure_cap": s.reserve_min_blocks, "returned": returned,
                   "want_sequence_numbers": r.want_sequence_numbers, "need": r.need_blocks,
                   "max_fork_refs": s.max_fork_refs_per_call, "max_refill": s.max_refill_per_call}
        reply = await self._attached(lease_id, r.pool_id, payload, self.store.sync)
        return ReserveGrant(r.pool_id, reply["epoch"], reply["granted"], reply["num_reserved"], reply["cap"],
                            reply["applied"], reply["first_sequence_number"], reply["num_sequence_numbers"])

    async def _attached(self, lease_id: str, pool_id: str, payload: dict[str, Any], call: Any) -> dict[str, Any]:
        """A Sync script call; once more after attaching the lease again when the pool no
        longer knows it (LEASE_UNKNOWN: re-registered since it was attached)."""
        try:
            return await call(payload)
        except ScriptError:
            self._leases.pop(lease_id, None)
            _, payload["lease_deadline_ms"] = await self._attach(lease_id, [pool_id])
            return await call(payload)

    # ------------------------------------------------------------ sequences

    async def get_sequence(self, sequence_id: str) -> SeqState:
        pool_id, epoch, n = parse_sequence_id(sequence_id)
        current, rec = await self.store.get_sequence(pool_id, n)
        if current is None:
            raise errors.NotFound(f"pool {pool_id} is not registered")
        if current != epoch:
            raise _epoch_error(sequence_id, pool_id, epoch, current)
        if rec is None:
            raise errors.NotFound(f"sequence {sequence_id} not found")
        _, geo = await self.geometry(pool_id)
        return _state(pool_id, epoch, {"sequence": n, **rec}, rec["lease_id"], geo.block_size)

    async def step(self, lease_id: str, updates: list[Update], creates: list[Create],
                   request_id: str = "") -> StepOutcome:
        """Applies one step: per pool all-or-nothing. See StepRequest in the proto."""
        _check_lease_id(lease_id)
        _check_request_id(request_id)
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
            if ids is None:
                pool_id, epoch, n = parse_sequence_id(sid)
                ids = (pool_id, epoch, n, format_sequence_id(pool_id, epoch, n))
                if len(parsed) >= 100_000:
                    parsed.clear()
                parsed[sid] = ids
            pool_id, epoch, n, canonical = ids
            if sid in seen:
                raise errors.InvalidArgument(f"sequence {sid} appears twice in one step")
            seen.add(sid)
            cached = self._geometry.get(pool_id)
            current, geo = cached if cached else await self.geometry(pool_id)
            if current != epoch:
                current, geo = await self.geometry(pool_id, refresh=True)
                if current != epoch:
                    raise _epoch_error(sid, pool_id, epoch, current)
            by_pool[pool_id]["updates"].append((i, canonical, self._update_payload(u, n, epoch, geo)))

        children = sum(len(u.fork_grow_to) for u in updates)
        if children > s.max_forks_per_call:
            raise errors.InvalidArgument(f"the step forks {children} children, at most {s.max_forks_per_call} per call")
        tenant = ""
        packed = [_check_create(c, s.max_prompt_tokens) for c in creates]
        # The request's identity for retries: every field of every item.
        digest = ""
        if request_id:
            digest = fingerprint("step", [lease_id, [(sid, payload) for items in by_pool.values()
                                                     for _, sid, payload in items["updates"]],
                                          [(data, c.pool_id, c.extra_key) for c, data in zip(creates, packed)]])
        if creates:
            explicit = sorted({c.pool_id for c in creates if c.pool_id})
            for pool_id in explicit:
                await self.geometry(pool_id)
            anywhere = any(not c.pool_id for c in creates)
            candidates = await self.store.pool_ids() if anywhere else explicit
            if not candidates:
                raise errors.FailedPrecondition("no pool is registered")
            tenant, lease_deadline = await self._attach(lease_id, candidates)
            placed = [c.pool_id or await self._place(c, packed[i], tenant) for i, c in enumerate(creates)]
            if anywhere and request_id:
                # A retry must land where the first attempt did (and find its outcome there).
                placed = await self.store.place(lease_id, request_id, digest, placed, self._request_ttl_ms())
                for pool_id in set(placed) - set(candidates):
                    await self.geometry(pool_id)
                    await self._attach(lease_id, [pool_id])
            for i, c in enumerate(creates):
                by_pool[placed[i]]["creates"].append((i, c, packed[i]))
        else:
            lease_deadline = 0
        outcome = StepOutcome([None] * len(updates), [None] * len(creates), [])
        pools = list(by_pool)
        payloads = [await self._pool_payload(p, by_pool[p], lease_id, tenant, lease_deadline, request_id, digest)
                    for p in pools]
        replies = await self.store.step(payloads)
        first_error: errors.KvsError | None = None
        for pool_id, payload, reply in zip(pools, payloads, replies):
            for _ in range(3):
                if not isinstance(reply, ScriptError):
                    break
                if reply.code == STALE_EPOCH:
                    await self.geometry(pool_id, refresh=True)
                else:  # LEASE_UNKNOWN: the pool forgot the lease (re-registered); attach again
                    self._leases.pop(lease_id, None)
                    tenant, lease_deadline = await self._attach(lease_id, [pool_id])
                payload = await self._pool_payload(pool_id, by_pool[pool_id], lease_id, tenant,
                                                   lease_deadline, request_id, digest)
                reply = (await self.store.step([payload]))[0]
            if isinstance(reply, Exception):
                if isinstance(reply, errors.ResourceExhausted):
                    reply.pool_id = pool_id
                    await self.store.count_failure(pool_id)
                if not isinstance(reply, errors.KvsError):
                    raise reply
                first_error = first_error or reply
                continue
            self._collect(pool_id, by_pool[pool_id], lease_id, reply, outcome)
        if first_error is not None:
            if not creates and isinstance(first_error, (errors.NotFound, errors.PermissionDenied)):
                # Updates alone never look the lease up (a pool knows the leases of its
                # sequences): a refused sequence may be the sign of an unknown, revoked or
                # expired lease, and that is the error to report then.
                await self._check_lease(lease_id)
            if len(pools) > 1:
                first_error.partial = outcome
            raise first_error
        return outcome

    # ------------------------------------------------------------ helpers

    def _update_payload(self, u: Update, n: int, epoch: int, geo: Geometry) -> dict[str, Any]:
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
        payload = {"sequence": n, "epoch": epoch, "num_tokens": t, "grow_to": g, "free": free,
                   "num_committed_blocks": 0, "parent_hash": "", "fork_grow_to": forks, "commits": []}
        commits = u.commits
        if not commits:
            return payload
        if t < 0:
            raise errors.InvalidArgument(f"sequence {sid}: commits need num_tokens")
        _commit_payload(payload, f"sequence {sid}", u.parent_hash, commits, geo.block_size)
        return payload

    async def _pool_payload(self, pool_id: str, items: dict[str, list], lease_id: str, tenant: str,
                            lease_deadline: int, request_id: str, digest: str) -> dict[str, Any]:
        """One pool's step script call (``scripts/step.lua``). ``lease_deadline`` is 0 when
        the lease is known to be attached to the pool already (the script then reads its
        deadline there)."""
        epoch, geo = await self.geometry(pool_id)
        creates = []
        items["hashes"] = []     # (each create's block hashes, for its reply)
        for _, c, data in items["creates"]:
            root = hashing.root_hash(self._salt(tenant), c.extra_key)
            n = len(data) // 4
            hs = hashing.chain_hashes(root, data, geo.block_size, n // geo.block_size)
            creates.append({"epoch": epoch, "num_tokens": n, "root_hash": root.hex(),
                            "block_hashes": [h.hex() for h in hs]})
            items["hashes"].append(hs)
        return {"pool": pool_id, "request_id": request_id, "fingerprint": digest,
                "request_ttl_ms": self._request_ttl_ms(), "lease_id": lease_id, "lease_deadline_ms": lease_deadline,
                "max_blocks": self.settings.max_blocks_per_call, "max_fork_refs": self.settings.max_fork_refs_per_call,
                "updates": [payload for _, _, payload in items["updates"]], "creates": creates}

    async def _attach(self, lease_id: str, pools: list[str]) -> tuple[str, int]:
        """The lease's tenant and deadline, attaching it to ``pools``; the deadline is 0 when
        the lease was attached to all of them before (then the pools know its deadline)."""
        cached = self._leases.get(lease_id)
        if cached is not None and cached[1].issuperset(pools):
            return cached[0], 0
        reply = await self.store.attach_lease(lease_id, pools, self._tombstone_ms())
        tenant = reply["tenant"]
        if len(self._leases) > 100_000:
            self._leases.clear()
        attached = cached[1] if cached else set()
        attached.update(pools)
        self._leases[lease_id] = (tenant, attached)
        return tenant, reply["deadline_ms"]

    async def _check_lease(self, lease_id: str) -> None:
        """Raises NotFound or FailedPrecondition unless the lease is live (writes nothing)."""
        await self.store.attach_lease(lease_id, [], self._tombstone_ms())

    async def _place(self, c: Create, data: bytes, tenant: str) -> str:
        """The pool with the longest cached prefix of ``c``, then the most free blocks."""
        pools = await self.store.pool_ids()
        root = hashing.root_hash(self._salt(tenant), c.extra_key)

        async def score(pool_id: str) -> tuple[int, int, str] | None:
            try:
                epoch, geo = await self.geometry(pool_id)
            except errors.NotFound:
                return None
            max_hit = (len(data) // 4 - 1) // geo.block_size
            hs = [h.hex() for h in hashing.chain_hashes(root, data, geo.block_size, max_hit)]
            reply = await self.store.probe(pool_id, epoch, hs)
            return int(reply["hits"]) * geo.block_size, int(reply["available"]), pool_id

        scored = []
        for i in range(0, len(pools), FAN_OUT):
            scored += [x for x in await asyncio.gather(*(score(p) for p in pools[i:i + FAN_OUT])) if x is not None]
        if not scored:
            raise errors.FailedPrecondition("no pool is registered")
        # Most cached tokens, then most blocks available, then the smallest pool id.
        return min(scored, key=lambda x: (-x[0], -x[1], x[2]))[2]

    def _collect(self, pool_id: str, items: dict[str, list], lease_id: str, reply: dict[str, Any],
                 outcome: StepOutcome) -> None:
        epoch = reply["epoch"]
        bs = self._geometry[pool_id][1].block_size
        updates = outcome.updates
        for (i, sid, _), d in zip(items["updates"], reply["updates"]):
            cow = d.get("cow")
            updates[i] = SeqDelta(sid, d["num_tokens"], d.get("new_blocks", []), tuple(cow) if cow else None,
                                  d["num_committed_blocks"], bytes.fromhex(d["last_hash"]),
                                  [_state(pool_id, epoch, k, lease_id, bs) for k in d["children"]], d["freed"])
        for j, ((i, _, _), rec) in enumerate(zip(items["creates"], reply["created"])):
            state = _state(pool_id, epoch, rec, lease_id, bs)
            state.block_hashes = tuple(items["hashes"][j][:state.num_committed_blocks])
            outcome.created[i] = state
        outcome.copies.extend((pool_id, src, dst) for src, dst in reply["copies"])

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

    def _request_ttl_ms(self) -> int:
        return int(self.settings.request_ttl * 1000)

    def _tombstone_ms(self) -> int:
        return int(self.settings.lease_tombstone * 1000)


def _commit_payload(payload: dict[str, Any], what: str, parent: bytes, commits: Any, block_size: int) -> None:
    """Sets ``parent_hash``, ``num_committed_blocks`` and ``commits`` (the hashes, hex) of a
    step update's payload from its parent hash and ``BlockCommit``s."""
    if len(parent) != hashing.HASH_BYTES:
        raise errors.InvalidArgument(f"{what}: parent_hash must be {hashing.HASH_BYTES} bytes")
    payload["parent_hash"] = parent.hex()
    first = commits[0].index
    if first < 0:
        raise errors.InvalidArgument(f"{what}: commit starts at block {first}; block indexes start at 0")
    hashes = payload["commits"]
    index = first
    for c in commits:
        if c.index != index:
            raise errors.InvalidArgument(f"{what}: commits must be consecutive blocks")
        tokens = c.token_ids
        if len(tokens) != block_size:
            raise errors.InvalidArgument(
                f"{what}: block {index} has {len(tokens)} tokens, a full block has {block_size}")
        parent = hashing.block_hash_checked(parent, tokens, what)
        hashes.append(parent.hex())
        index += 1
    payload["num_committed_blocks"] = first


def _state(pool_id: str, epoch: int, rec: dict[str, Any], lease_id: str, block_size: int) -> SeqState:
    """A sequence record (a script's reply record, or a stored one: ``store.parse_record``)."""
    cow = rec.get("cow")
    return SeqState(format_sequence_id(pool_id, epoch, rec["sequence"]), pool_id, epoch,
                    rec.get("lease_id", lease_id), rec["block_table"], rec["num_tokens"], rec["num_cached_tokens"],
                    rec["num_committed_blocks"], bytes.fromhex(rec["last_hash"]), tuple(cow) if cow else None,
                    block_size)


def _geometry_of(meta: dict[str, str]) -> Geometry:
    return Geometry(int(meta["num_blocks"]), int(meta["block_size"]), int(meta["num_layers"]),
                    int(meta["num_kv_heads"]), int(meta["head_dim"]), meta["dtype"])


def _lease_info(reply: dict[str, Any]) -> LeaseInfo:
    return LeaseInfo(reply["lease_id"], reply["tenant"], reply["ttl_ms"] / 1000, reply["deadline_ms"])


def fingerprint(kind: str, request: Any) -> str:
    """The identity of a request for retries under one request id: SHA-256 (64 hex digits)
    over the msgpack form of everything the request says."""
    return hashlib.sha256(codec.encode([kind, request])).hexdigest()


def _epoch_error(sequence_id: str, pool_id: str, epoch: int, current: int) -> errors.KvsError:
    """A sequence id of an epoch that is not the pool's: stale (FAILED_PRECONDITION), or
    one that the pool has not reached, so the sequence never existed (NOT_FOUND)."""
    if epoch > current:
        return errors.NotFound(f"sequence {sequence_id} not found: pool {pool_id} is at epoch {current}")
    return errors.FailedPrecondition(f"sequence {sequence_id} belongs to epoch {epoch} but pool {pool_id} "
                                     f"was re-registered (epoch {current})", reason="EPOCH_CHANGED")


def _check_pool_id(pool_id: str) -> None:
    try:
        check_pool_id(pool_id)
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc)) from None


def _check_lease_id(lease_id: str) -> None:
    if not LEASE_ID.fullmatch(lease_id or ""):
        raise errors.InvalidArgument(f"malformed lease_id {echo(lease_id)}")


def _check_request_id(request_id: str) -> None:
    if request_id and not REQUEST_ID.fullmatch(request_id):
        raise errors.InvalidArgument(f"malformed request_id {echo(request_id)} (1..128 of A-Z a-z 0-9 _ . : -)")


def _check_create(c: Create, max_prompt_tokens: int) -> bytes:
    """Checks a create; returns its prompt as the bytes the block hashes take."""
    if not c.token_ids:
        raise errors.InvalidArgument("a create needs a non-empty prompt (token_ids)")
    if len(c.token_ids) > max_prompt_tokens:
        raise errors.InvalidArgument(f"prompt of {len(c.token_ids)} tokens, at most {max_prompt_tokens}")
    data = hashing.token_bytes_checked(c.token_ids, "prompt")
    if c.pool_id:
        _check_pool_id(c.pool_id)
    if len(c.extra_key) > 1024:
        raise errors.InvalidArgument("extra_key is longer than 1024 bytes")
    return data
