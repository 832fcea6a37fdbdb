"""The allocator: validates requests, computes block hashes, plans per-pool script calls
(pools and leases here; steps and sequence reads in ``steps.py``, the Sync in
``reserves.py``: mixins of ``Allocator``).

Stateless apart from caches of immutable facts (a pool's geometry per epoch, a lease's
tenant), so any number of replicas can serve one Redis. Raises ``kvservice.errors``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import secrets
import time
from typing import Any

from kvservice import errors
from kvservice.allocator.config import Settings, cache_groups, tenant_quotas
from kvservice.allocator.domain import TENANT, Heartbeat, LeaseInfo, Order, PoolInfo
from kvservice.common.grants import move_fields, new_key, order_mac, pull_fields
from kvservice.allocator.checks import (MAX_INT, check_lease_id, check_pool_arg, check_request_id, fingerprint,
                                        geometry_of, lease_info)
from kvservice.allocator.reaping import ReapSchedule
from kvservice.allocator.reserves import ReserveOps
from kvservice.allocator.steps import FAN_OUT, StepOps
from kvservice.allocator.store import Store
from kvservice.allocator.tiers import MAX_TIER_BLOCKS, TierOps, tier_stats
from kvservice.common.geometry import Geometry
from kvservice.common.redis_errors import REDIS_DOWN
from kvservice.common.security import read_secret
from kvservice.common.settings import echo

log = logging.getLogger(__name__)

#: Pools the reaper sweeps at once, and how long one reap call may take before its pool
#: is skipped for this sweep (a normal one takes milliseconds; a shard that fails over
#: leaves its calls hanging for seconds).
REAP_CONCURRENCY = 16
REAP_CALL_TIMEOUT = 2.0
DEFAULT_PAGE, MAX_PAGE = 100, 1000
#: What the engine runs on a pool (RegisterPoolRequest.role, DESIGN §13).
ROLES = ("both", "prefill", "decode", "store")


class Allocator(StepOps, ReserveOps, TierOps):
    """Pools, leases and sequences over one ``Store``."""

    def __init__(self, store: Store, settings: Settings | None = None) -> None:
        self.store = store
        self.settings = settings or Settings()
        self._geometry: dict[str, tuple[int, Geometry]] = {}
        #: Each pool's grant key and its epoch (``grant_key``).
        self._grant_keys: dict[str, tuple[int, bytes]] = {}
        self.reap_schedule = ReapSchedule(self.settings.reap_recheck)
        self._roles: dict[str, str] = {}            # pool -> role (RegisterPoolRequest.role)
        self._leases: dict[str, tuple[str, set[str]]] = {}   # lease -> (tenant, attached pools)
        self._sequence_ids: dict[str, tuple[str, int, int, str, str, str]] = {}   # parsed ids of recent steps
        #: Leases this replica granted (retries of one request count once); read by metrics.
        self.leases_granted = 0
        self._groups = cache_groups(self.settings.prefix_cache_groups)
        self._tenant_quotas = tenant_quotas(self.settings.quotas)
        self._quota_of: dict[str, dict[str, int]] = {}
        s = self.settings
        self._quotas_on = bool(s.quota_blocks or s.quota_sequences or s.quota_leases or self._tenant_quotas)
        self._secret: bytes | None = None
        if self.settings.prefix_cache_secret_file:
            self._secret = read_secret(self.settings.prefix_cache_secret_file, "prefix_cache_secret_file").encode()

    # ------------------------------------------------------------ pools

    async def register_pool(self, pool_id: str, geometry: Geometry, worker_address: str = "",
                            request_id: str = "", host_tier_blocks: int = 0, disk_tier_blocks: int = 0,
                            disk_tier_kept: bool = False, role: str = "") -> PoolInfo:
        if pool_id:
            check_pool_arg(pool_id)
        role = role or "both"
        if role not in ROLES:
            raise errors.InvalidArgument(f"role must be one of {', '.join(ROLES)}, got {echo(role)}")
        geometry.check()
        check_request_id(request_id)
        if len(worker_address) > 256:
            raise errors.InvalidArgument("worker_address is longer than 256 characters")
        for name, n in (("host_tier_blocks", host_tier_blocks), ("disk_tier_blocks", disk_tier_blocks)):
            if not 0 <= n <= MAX_TIER_BLOCKS:
                raise errors.InvalidArgument(f"{name} must be in 0..{MAX_TIER_BLOCKS}, got {n}")
        if not pool_id:
            pool_id = await self.store.new_pool_id(request_id, self._request_ttl_ms())
        payload = {"pool": pool_id, "request_id": request_id, "request_ttl_ms": self._request_ttl_ms(),
                   "num_blocks": geometry.num_blocks, "block_size": geometry.block_size,
                   "num_layers": geometry.num_layers, "num_kv_heads": geometry.num_kv_heads,
                   "head_dim": geometry.head_dim, "dtype": geometry.dtype,
                   "worker_address": worker_address, "host_entries": host_tier_blocks,
                   "disk_entries": disk_tier_blocks, "disk_kept": bool(disk_tier_kept), "role": role,
                   "events": self.settings.kv_events}
        payload["fingerprint"] = fingerprint("register", payload)
        # (drawn here, for the new epoch; a retry gets the key its first call stored)
        payload["grant_key"] = new_key().hex()
        reply = await self.store.register_pool(payload)
        self._geometry[pool_id] = (int(reply["epoch"]), geometry)
        self._roles[pool_id] = role
        log.info("pool %s registered: epoch %s, %d blocks of %d tokens", pool_id, reply["epoch"],
                 geometry.num_blocks, geometry.block_size)
        return PoolInfo(pool_id, int(reply["epoch"]), geometry, worker_address, int(reply["registered_ms"]),
                        generation=int(reply["generation"]), role=role, grant_key=bytes.fromhex(reply["grant_key"]))

    async def grant_key(self, pool_id: str, epoch: int) -> bytes:
        """The key of the grants of ``pool_id`` at ``epoch`` (read once per epoch; b"":
        the pool is at another epoch now, and a grant of ``epoch`` is void anyway)."""
        known = self._grant_keys.get(pool_id)
        if known is None or known[0] != epoch:
            known = self._grant_keys[pool_id] = await self.store.grant_key(pool_id)
        return known[1] if known[0] == epoch else b""

    async def signed_orders(self, orders: list[Order]) -> list[Order]:
        """``orders`` with their MACs (``grants``): a fetch's under the source pool's grant key
        (the source's worker serves the block to the order's pool only with it), a tier
        order's under its pool's (the pool's worker runs no move without it, and
        ``SettleTiers`` settles or forgets only on orders it gave; a fetch of nothing, src -1,
        is signed too: its block is forgotten on it)."""
        out = []
        for o in orders:
            if o.source_pool_id:
                key = await self.grant_key(o.source_pool_id, o.source_epoch)
                o = o._replace(order_mac=order_mac(key, "pull", pull_fields(
                    o.source_pool_id, o.source_epoch, o.pool_id, o.serial, o.src_tier, o.src, o.block_hash))
                    if key else b"")
            else:
                key = await self.grant_key(o.pool_id, o.epoch)
                o = o._replace(order_mac=order_mac(key, "move", move_fields(
                    o.pool_id, o.epoch, o.serial, o.src_tier, o.src, o.dst_tier, o.dst, o.block_hash)) if key else b"")
            out.append(o)
        return out

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
        return None if counts is None else self.pool_info(pool_id, counts)

    def pool_info(self, pool_id: str, counts: dict[str, Any]) -> PoolInfo:
        """A pool's description from its counts as read (``Store.pool_counts``)."""
        meta = counts["meta"]
        geometry = geometry_of(meta)
        self._geometry[pool_id] = (int(meta["epoch"]), geometry)
        self._roles[pool_id] = meta.get("role", "both")
        stats: dict[str, Any] = {k: v for k, v in counts.items() if k.startswith("num_")}
        stats.update(counts["stats"])
        stats["tiers"] = tier_stats(meta, counts)
        stats["generations"] = int(meta.get("generations", 0))
        stats["num_blocks"] = geometry.num_blocks
        stats["usage"] = counts["num_used_blocks"] / geometry.num_blocks
        return PoolInfo(pool_id, int(meta["epoch"]), geometry, meta.get("worker_address", ""),
                        int(meta.get("registered_ms", 0)), stats, int(meta.get("heartbeat_ms", 0)),
                        int(meta.get("generation", 0)), int(meta.get("host_entries", 0)),
                        int(meta.get("disk_entries", 0)), self.store.draining_now(pool_id),
                        meta.get("role", "both"))

    async def drain_pool(self, pool_id: str, on: bool = True) -> PoolInfo:
        """Marks a pool as being drained (``kvservice drain``, DESIGN §13): placement passes
        it over, a create or a migration that names it is refused (FAILED_PRECONDITION,
        reason DRAINING), and engines move their sequences off it. ``on`` False: it takes
        sequences again."""
        info = await self.describe_pool(pool_id)
        await self.store.set_draining(pool_id, on)
        info.draining = on
        return info

    async def unregister_pool(self, pool_id: str, force: bool = False) -> dict[str, int]:
        """Removes a drained pool from the registry (``unregister_pool.lua``): refused while
        it holds a sequence, a reserved block or a live read pin, unless ``force``. Its
        worker learns it from its next heartbeat and stops."""
        check_pool_arg(pool_id)
        await self.geometry(pool_id, refresh=True)          # (NotFound for a pool not registered)
        if not force and not await self.store.draining(pool_id):
            raise errors.FailedPrecondition(f"pool {pool_id} is not being drained (DrainPool first)",
                                            reason="NOT_DRAINING")
        reply = await self.store.unregister_pool(pool_id, force)
        self._geometry.pop(pool_id, None)
        self.reap_schedule.forget(pool_id)
        return {k: int(reply[k]) for k in ("epoch", "sequences", "reserved", "pins")}

    async def heartbeat(self, pool_id: str, epoch: int, dead_since_ms: int = 0) -> Heartbeat:
        """Records a worker's heartbeat; returns the epoch, the Redis time, the leases that
        died in the pool since ``dead_since_ms`` and the pool's generation."""
        check_pool_arg(pool_id)
        if not 1 <= epoch <= MAX_INT:
            raise errors.InvalidArgument(f"epoch must be in 1..{MAX_INT}, got {epoch}")
        if not 0 <= dead_since_ms <= 2**62:
            raise errors.InvalidArgument(f"dead_since_ms {dead_since_ms} is out of range")
        reply = await self.store.heartbeat(pool_id, epoch, dead_since_ms)
        return Heartbeat(int(reply["epoch"]), int(reply["heartbeat_ms"]), list(reply["dead"]),
                         int(reply["dead_until_ms"]), int(reply["generation"]))

    async def geometry(self, pool_id: str, *, refresh: bool = False) -> tuple[int, Geometry]:
        """The pool's current epoch and geometry (cached per epoch)."""
        if refresh or pool_id not in self._geometry:
            meta = await self.store.pool_meta(pool_id)
            if meta is None:
                self._geometry.pop(pool_id, None)
                raise errors.NotFound(f"pool {pool_id} is not registered")
            self._geometry[pool_id] = (int(meta["epoch"]), geometry_of(meta))
            self._roles[pool_id] = meta.get("role", "both")
        return self._geometry[pool_id]

    def role(self, pool_id: str) -> str:
        """The pool's role as last read with its geometry ("both" if unknown)."""
        return self._roles.get(pool_id, "both")

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
        """A keep-alive's reply: the lease's new deadline in the reaper's schedule of its
        pools, and in its tenant's live leases where the tenant has a lease quota."""
        self.reap_schedule.expect(reply["pools"], reply["ttl_ms"])
        if self.quota(reply["tenant"])["leases"]:
            await self.store.tenant_leases(reply["tenant"], "touch", reply["lease_id"],
                                           left_ms=reply["ttl_ms"])

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
        """Frees the sequences of every expired lease in the pools whose sweep is due
        (``reaping.ReapSchedule``), idempotently. A pool
        whose Redis (shard) is unreachable is skipped and logged: the others are reaped all
        the same (on a Redis Cluster, while one shard fails over)."""
        total = {"leases": 0, "sequences": 0}
        failed: list[tuple[str, BaseException]] = []
        limit = asyncio.Semaphore(REAP_CONCURRENCY)
        schedule = self.reap_schedule

        async def reap_pool(pool_id: str) -> None:
            async with limit:
                for _ in range(1000):
                    started = time.monotonic()
                    try:
                        reply = await asyncio.wait_for(
                            self.store.reap(pool_id, tombstone_ms=self._tombstone_ms()), REAP_CALL_TIMEOUT)
                    except errors.NotFound:
                        schedule.forget(pool_id)
                        return
                    except (*REDIS_DOWN, errors.Unavailable, asyncio.TimeoutError) as exc:
                        failed.append((pool_id, exc))
                        schedule.retry(pool_id)
                        return
                    total["leases"] += reply["leases"]
                    total["sequences"] += reply["sequences"]
                    if not reply["more"]:
                        schedule.swept(pool_id, started, int(reply["next_ms"]))
                        return

        pools = await self.store.pool_ids(cached=True)
        # (concurrently: a shard that hangs while it fails over holds back its pools only)
        await asyncio.gather(*(reap_pool(p) for p in schedule.due(pools)))
        for pool_id, exc in failed:
            log.warning("reaper: pool %s skipped, its Redis is unreachable: %s", pool_id,
                        exc if str(exc) else type(exc).__name__)
        return total

    # ------------------------------------------------------------ helpers

    async def _attach(self, lease_id: str, pools: list[str]) -> tuple[str, int]:
        """The lease's tenant and time left (ms), attaching it to ``pools``; the time left
        is 0 when the lease was attached to all of them before (then the pools know its
        deadline). A time left, not a deadline: each pool's shard adds it to its own clock,
        which need not be the clock of the lease's shard."""
        cached = self._leases.get(lease_id)
        if cached is not None and cached[1].issuperset(pools):
            return cached[0], 0
        reply = await self.store.attach_lease(lease_id, pools, self._tombstone_ms())
        self.reap_schedule.expect(pools, reply["left_ms"])
        tenant = reply["tenant"]
        if len(self._leases) > 100_000:
            self._leases.clear()
        attached = cached[1] if cached else set()
        attached.update(pools)
        self._leases[lease_id] = (tenant, attached)
        return tenant, reply["left_ms"]

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
        """A tenant's quotas (0: none): blocks and sequences per pool, leases (made once per
        tenant: every step and Sync payload carries them; callers do not change it)."""
        q = self._quota_of.get(tenant)
        if q is None:
            s = self.settings
            q = {"blocks": s.quota_blocks, "sequences": s.quota_sequences, "leases": s.quota_leases,
                 **self._tenant_quotas.get(tenant, {})}
            if len(self._quota_of) >= 100_000:
                self._quota_of.clear()
            self._quota_of[tenant] = q
        return q

    async def _check_lease(self, lease_id: str) -> None:
        """Raises NotFound or FailedPrecondition unless the lease is live (writes nothing)."""
        await self.store.attach_lease(lease_id, [], self._tombstone_ms())

    def _request_ttl_ms(self) -> int:
        return int(self.settings.request_ttl * 1000)

    def _tombstone_ms(self) -> int:
        return int(self.settings.lease_tombstone * 1000)
