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
from kvservice.common import hashing
from kvservice.allocator.codec import STALE_EPOCH, ScriptError
from kvservice.allocator.config import Settings, cache_groups, tenant_quotas
from kvservice.allocator.domain import (TENANT, Create, Heartbeat, LeaseInfo, PoolInfo, SeqDelta, SeqState,
                                        StepOutcome, Update, format_sequence_id, parse_sequence_id)
from kvservice.allocator.checks import (MAX_INT, check_create, check_lease_id, check_pool_arg, check_request_id,
                                        commit_payload, epoch_error, fingerprint, geometry_of, lease_info, seq_state)
from kvservice.allocator.reserves import ReserveOps
from kvservice.allocator.store import Store
from kvservice.common.geometry import Geometry
from kvservice.common.auth import caller
from kvservice.common.security import read_secret
from kvservice.common.settings import echo

log = logging.getLogger(__name__)
#: Pools read at once by one call (ListPools, the placement of a create without pool id).
FAN_OUT = 64
DEFAULT_PAGE, MAX_PAGE = 100, 1000


class Allocator(ReserveOps):
    """Pools, leases and sequences over one ``Store``."""

    def __init__(self, store: Store, settings: Settings | None = None) -> None:
        self.store = store
        self.settings = settings or Settings()
        self._geometry: dict[str, tuple[int, Geometry]] = {}
        self._leases: dict[str, tuple[str, set[str]]] = {}   # lease -> (tenant, attached pools)
        self._sequence_ids: dict[str, tuple[str, int, int, str, str, str]] = {}   # parsed ids of recent steps
        #: Leases this replica granted (retries of one request count once); read by metrics.
        self.leases_granted = 0
        self._groups = cache_groups(self.settings.prefix_cache_groups)
        self._tenant_quotas = tenant_quotas(self.settings.quotas)
        s = self.settings
        self._quotas_on = bool(s.quota_blocks or s.quota_sequences or s.quota_leases or self._tenant_quotas)
        self._secret: bytes | None = None
        if self.settings.prefix_cache_secret_file:
            self._secret = read_secret(self.settings.prefix_cache_secret_file, "prefix_cache_secret_file").encode()

    # ------------------------------------------------------------ pools

    async def register_pool(self, pool_id: str, geometry: Geometry, worker_address: str = "",
                            request_id: str = "") -> PoolInfo:
        if pool_id:
            check_pool_arg(pool_id)
        geometry.check()
        check_request_id(request_id)
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
        check_pool_arg(pool_id)
        info = await self._describe(pool_id)
        if info is None:
            raise errors.NotFound(f"pool {pool_id} is not registered")
        return info

    async def _describe(self, pool_id: str) -> PoolInfo | None:
        counts = await self.store.pool_counts(pool_id)
        if counts is None:
            return None
        meta = counts["meta"]
        geometry = geometry_of(meta)
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
        check_pool_arg(pool_id)
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
            self._geometry[pool_id] = (int(meta["epoch"]), geometry_of(meta))
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
        check_request_id(request_id)
        if request_id:
            lease_id = hashlib.blake2b(f"{tenant}\0{request_id}".encode(), digest_size=8).hexdigest()
        else:
            lease_id = secrets.token_hex(8)
        ttl_ms = max(1, round(ttl_seconds * 1000))
        limit = self.quota(tenant)["leases"]
        if limit:
            await self.store.tenant_leases(tenant, "admit", lease_id, ttl_ms=ttl_ms, limit=limit)
        reply = await self.store.grant_lease({"lease_id": lease_id, "tenant": tenant, "ttl_ms": ttl_ms,
                                              "fingerprint": fingerprint("grant", [tenant, ttl_ms]),
                                              "request_id": request_id, "tombstone_ms": self._tombstone_ms()})
        if not reply.get("replay"):
            self.leases_granted += 1
        return lease_info(reply)

    async def keep_alive(self, lease_id: str) -> LeaseInfo:
        check_lease_id(lease_id)
        reply = await self.store.keep_alive(lease_id, self._tombstone_ms())
        await self._kept_alive(reply)
        return lease_info(reply)

    async def _kept_alive(self, reply: dict[str, Any]) -> None:
        """A keep-alive's reply: the lease's new deadline in its tenant's live leases, where
        the tenant has a lease quota."""
        if self.quota(reply["tenant"])["leases"]:
            await self.store.tenant_leases(reply["tenant"], "touch", reply["lease_id"],
                                           deadline_ms=reply["deadline_ms"])

    async def revoke_lease(self, lease_id: str) -> int:
        """Revokes a lease and frees its sequences; returns how many were freed."""
        check_lease_id(lease_id)
        tenant = await self._lease_tenant(lease_id) if self._quotas_on else ""
        pools = await self.store.revoke_lease(lease_id)
        self._leases.pop(lease_id, None)
        if tenant and self.quota(tenant)["leases"]:
            await self.store.tenant_leases(tenant, "drop", lease_id)
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
        if rec is None or not _tag_fits(tag, rec["lease_id"], pool_id, epoch, n):
            raise errors.NotFound(f"sequence {sequence_id} not found")
        _, geo = await self.geometry(pool_id)
        return seq_state(pool_id, epoch, {"sequence": n, **rec}, rec["lease_id"], geo.block_size)

    async def step(self, lease_id: str, updates: list[Update], creates: list[Create],
                   request_id: str = "") -> StepOutcome:
        """Applies one step: per pool all-or-nothing. See StepRequest in the proto."""
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
                if not _tag_fits(tag, lease_id, pool_id, epoch, n):
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
            by_pool[pool_id]["updates"].append((i, canonical, self._update_payload(u, n, epoch, geo, tag)))

        children = sum(len(u.fork_grow_to) for u in updates)
        if children > s.max_forks_per_call:
            raise errors.InvalidArgument(f"the step forks {children} children, at most {s.max_forks_per_call} per call")
        tenant = ""
        packed = [check_create(c, s.max_prompt_tokens) for c in creates]
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
        if not tenant and self._quotas_on:
            tenant = await self._lease_tenant(lease_id)    # (its quotas)
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
                    if not reply.quota:       # (a quota is the tenant's limit, not the pool's)
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
        if longest > self.settings.max_sequence_blocks * geo.block_size:
            raise errors.InvalidArgument(f"sequence {sid}: {longest} tokens need {-(-longest // geo.block_size)} "
                                         f"blocks, a sequence holds at most {self.settings.max_sequence_blocks}")
        payload = {"sequence": n, "tag": tag, "epoch": epoch, "num_tokens": t, "grow_to": g, "free": free,
                   "num_committed_blocks": 0, "parent_hash": "", "fork_grow_to": forks, "commits": []}
        commits = u.commits
        if not commits:
            return payload
        if t < 0:
            raise errors.InvalidArgument(f"sequence {sid}: commits need num_tokens")
        commit_payload(payload, f"sequence {sid}", u.parent_hash, commits, geo.block_size)
        return payload

    async def _pool_payload(self, pool_id: str, items: dict[str, list], lease_id: str, tenant: str,
                            lease_deadline: int, request_id: str, digest: str) -> dict[str, Any]:
        """One pool's step script call (``scripts/step.lua``). ``lease_deadline`` is 0 when
        the lease is known to be attached to the pool already (the script then reads its
        deadline there)."""
        epoch, geo = await self.geometry(pool_id)
        s = self.settings
        bs = geo.block_size
        blocks = sum(-(-(len(data) // 4) // bs) for _, _, data in items["creates"])
        if blocks > s.max_blocks_per_call:
            raise errors.InvalidArgument(f"pool {pool_id}: the step's creates hold {blocks} blocks in all, at most "
                                         f"{s.max_blocks_per_call} per call (create them over several calls)")
        commits = sum(len(p["commits"]) for _, _, p in items["updates"])
        if commits > s.max_blocks_per_call:
            raise errors.InvalidArgument(f"pool {pool_id}: the step commits {commits} blocks, at most "
                                         f"{s.max_blocks_per_call} per call")
        creates = []
        items["hashes"] = []     # (each create's block hashes, for its reply)
        for _, c, data in items["creates"]:
            root = hashing.root_hash(self._salt(tenant), c.extra_key)
            n = len(data) // 4
            if -(-n // bs) > s.max_sequence_blocks:
                raise errors.InvalidArgument(f"pool {pool_id}: a prompt of {n} tokens needs {-(-n // bs)} blocks, "
                                             f"a sequence holds at most {s.max_sequence_blocks}")
            hs = hashing.chain_hashes(root, data, geo.block_size, n // geo.block_size)
            creates.append({"epoch": epoch, "num_tokens": n, "root_hash": root.hex(),
                            "block_hashes": [h.hex() for h in hs]})
            items["hashes"].append(hs)
        return {"pool": pool_id, "request_id": request_id, "fingerprint": digest,
                "request_ttl_ms": self._request_ttl_ms(), "lease_id": lease_id, "lease_deadline_ms": lease_deadline,
                "tenant": tenant, "quota": self.quota(tenant),
                "max_blocks": s.max_blocks_per_call, "max_fork_refs": s.max_fork_refs_per_call,
                "max_release": s.max_release_per_call,
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

    async def _lease_tenant(self, lease_id: str) -> str:
        """The lease's tenant ("" for an unknown lease), cached."""
        cached = self._leases.get(lease_id)
        if cached is not None:
            return cached[0]
        tenant = await self.store.lease_tenant(lease_id)
        if tenant is None:
            return ""
        if len(self._leases) > 100_000:
            self._leases.clear()
        self._leases[lease_id] = (tenant, set())
        return tenant

    def quota(self, tenant: str) -> dict[str, int]:
        """A tenant's quotas (0: none): blocks and sequences per pool, leases."""
        s = self.settings
        q = {"blocks": s.quota_blocks, "sequences": s.quota_sequences, "leases": s.quota_leases}
        q.update(self._tenant_quotas.get(tenant, {}))
        return q

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
                                  [seq_state(pool_id, epoch, k, lease_id, bs) for k in d["children"]], d["freed"])
        for j, ((i, _, _), rec) in enumerate(zip(items["creates"], reply["created"])):
            state = seq_state(pool_id, epoch, rec, lease_id, bs)
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


def _tag_fits(tag: str, lease_id: str, pool_id: str, epoch: int, n: int) -> bool:
    """Whether a sequence id's tag is the one ``lease_id`` gives it; a missing tag fits for
    an admin and when nobody is authenticated."""
    if not tag:
        ident = caller()
        return ident is None or ident.role == "admin"
    return hmac.compare_digest(tag, hashing.sequence_tag(lease_id, pool_id, epoch, n))
