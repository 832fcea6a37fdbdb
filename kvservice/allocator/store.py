"""The Redis layer: runs the Lua scripts and reads state; knows nothing of gRPC.

Every mutation is one registered script (EVALSHA, reloaded on NOSCRIPT by redis-py),
from the one registry ``kvservice.allocator.lua.SCRIPTS``; arguments and replies go
through ``kvservice.allocator.codec``, whose decoder turns error replies into
``kvservice.errors`` exceptions. A Redis error raised inside a script names the script's
file and line (``lua.LuaScript.explain``). Reads that must be consistent are one MULTI/EXEC.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Callable, Iterable

import redis.asyncio as aioredis
from redis.exceptions import ClusterError as RedisClusterError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvservice import errors
from kvservice.allocator import codec, keys, lua
from kvservice.allocator.codec import LEASE_UNKNOWN, RUN_SHORT, STALE_EPOCH, TOO_BIG
from kvservice.common.redis_errors import REDIS_DOWN


#: Blocks per stored page of a block table (``scripts/lib/records.lua``: page 0 under the
#: sequence's field ``<n>``, page k under ``<n>:<k>``).
PAGE = 128


def blocks_of(table: str | bytes) -> list[int]:
    """A stored block table (6 hex digits per block id) as a list of ids."""
    if isinstance(table, bytes):
        table = table.decode()
    return [int(table[i:i + 6], 16) for i in range(0, len(table), 6)]


def page_fields(n: int | str, num_blocks: int) -> list[str]:
    """The ``tabs`` fields of a table of ``num_blocks`` blocks, page by page."""
    pages = -(-num_blocks // PAGE)
    return [str(n) if k == 0 else f"{n}:{k}" for k in range(pages)]


def parse_record(meta: bytes | str, table: bytes | str | None) -> dict[str, Any]:
    """A stored sequence record (``keys.py``: ``seqs``, and its ``tabs`` pages joined) as
    ``{lease_id, num_tokens, num_committed_blocks, num_cached_tokens, last_hash, num_blocks,
    state, block_table}``; ``state`` is "" for a live sequence, "s" for one a run is
    building (staged), "f" for one being freed in parts."""
    if isinstance(meta, bytes):
        meta = meta.decode()
    lease, t, c, k, h, nb, *state = meta.split(" ")
    return {"lease_id": lease, "num_tokens": int(t), "num_committed_blocks": int(c), "num_cached_tokens": int(k),
            "last_hash": h, "num_blocks": int(nb), "state": state[0] if state else "",
            "block_table": blocks_of(table or "")}


def join_pages(tabs: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """A ``tabs`` hash as read (page fields ``<n>`` and ``<n>:<k>``) -> each sequence's
    whole table, its pages joined in order."""
    pages: dict[bytes, list[tuple[int, bytes]]] = {}
    for field, value in tabs.items():
        n, _, k = field.partition(b":")
        pages.setdefault(n, []).append((int(k) if k else 0, value))
    return {n: b"".join(v for _, v in sorted(ps)) for n, ps in pages.items()}


def redacted(url: str) -> str:
    """A Redis URL without its password (for logs)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.netloc.rsplit('@', 1)[1]}"
    return urlunsplit(parts._replace(netloc=netloc))


def is_cluster(url: str) -> bool:
    """Whether the Redis at ``url`` is a node of a Redis Cluster (it answers CLUSTER SLOTS)."""
    import redis as sync_redis

    with sync_redis.Redis.from_url(url, socket_timeout=5) as r:
        try:
            r.execute_command("CLUSTER", "SLOTS")
            return True
        except ResponseError as exc:
            if "cluster support disabled" in str(exc).lower() or "cluster mode" in str(exc).lower():
                return False
            raise


def connect(url: str, max_connections: int = 64, pool_timeout: float = 10.0, *, cluster: bool | None = None,
            **kwargs: Any) -> aioredis.Redis:
    """An asyncio Redis client for ``redis://``, ``rediss://`` or ``unix://`` URLs, over at
    most ``max_connections`` connections: a call that finds none free waits for one (up
    to ``pool_timeout`` seconds), instead of failing at once as redis-py's default pool
    does past 100. ``cluster``: a Redis Cluster client (``url`` names one node; the others
    are discovered), at most ``max_connections`` per node; None: one when the server at
    ``url`` is a cluster node (``is_cluster``; never for ``unix://``)."""
    if cluster is None:
        cluster = not url.startswith("unix:") and is_cluster(url)
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, max_connections=max_connections, decode_responses=False, **kwargs)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=pool_timeout,
                                                    decode_responses=False, health_check_interval=30, **kwargs)
    return aioredis.Redis(connection_pool=pool)


#: How long a replica serves placement and the reaper from the pool list it read (seconds).
POOL_LIST_TTL = 1.0
#: How long a refresh of that list may take before the list it had is served instead (the
#: registry's shard may be failing over: its calls then hang for seconds).
POOL_LIST_WAIT = 0.25

#: The scripts that hand out or free blocks: with ``Store.wait_replicas``, each is
#: acknowledged only once that many replicas of its shard have its writes (``WAIT``).
DURABLE_SCRIPTS = frozenset({"step", "sync", "resync", "reap", "stage", "pin"})


class Store:
    """Allocator state in one Redis (or one Redis Cluster: every call names one slot)."""

    def __init__(self, redis: aioredis.Redis, observe: Callable[[str, float], None] | None = None, *,
                 wait_replicas: int = 0, wait_timeout_ms: int = 100) -> None:
        self.redis = redis
        #: ``WAIT`` after each of ``DURABLE_SCRIPTS``, on the connection that ran it, for
        #: this many replicas (0: none), at most ``wait_timeout_ms``; fewer acknowledgements
        #: raise UNAVAILABLE (a retry with the same request id returns the same outcome).
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        #: A Redis Cluster: calls of several pools run concurrently, never in one pipeline
        #: (their keys hash to different slots).
        self.cluster = type(redis).__name__ == "RedisCluster"
        #: Called with (script name, seconds) after every script call (metrics hook).
        self.observe = observe
        self._scripts = {name: redis.register_script(s.source) for name, s in lua.SCRIPTS.items()}
        self._pool_list: tuple[float, list[str]] | None = None
        self._draining: set[str] = set()     # (read with the pool list)
        #: Changes this replica made to the registry or the draining set: a read that began
        #: before one of them does not overwrite what it knows (``pool_ids``).
        self._registry_changes = 0

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> None:
        await self.redis.ping()

    async def _call(self, name: str, keys_: list[str], payload: dict[str, Any], *,
                    internal: tuple[str, ...] = ()) -> dict[str, Any]:
        """One script call: ``payload`` encoded, the reply decoded; timed for ``observe``."""
        start = time.perf_counter()
        try:
            if self.wait_replicas and name in DURABLE_SCRIPTS:
                raw = await self._call_and_wait(name, keys_, codec.encode(payload))
            else:
                raw = await self._scripts[name](keys=keys_, args=[codec.encode(payload)])
        except ResponseError as exc:
            raise _explained(name, exc) from None
        finally:
            if self.observe is not None:
                self.observe(name, time.perf_counter() - start)
        return codec.decode_reply(raw, internal=internal)

    async def _call_and_wait(self, name: str, keys_: list[str], arg: bytes) -> Any:
        """The script, then ``WAIT wait_replicas wait_timeout_ms`` in one pipeline (one
        connection: WAIT waits for that connection's writes), on the node of the script's
        slot; its raw reply once enough replicas acknowledged it."""
        script = self._scripts[name]
        for attempt in range(2):
            if self.cluster:
                pipe = self.redis.pipeline()
                node = self.redis.get_node_from_key(keys_[0])
            else:
                pipe = self.redis.pipeline(transaction=False)
                node = None
            on = {} if node is None else {"target_nodes": node}     # (both on the slot's node)
            async with pipe:
                # (EVALSHA by name: redis-py's cluster pipeline refuses its evalsha method)
                pipe.execute_command("EVALSHA", script.sha, len(keys_), *keys_, arg, **on)
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms, **on)
                raw, acked = await pipe.execute(raise_on_error=False)
            if isinstance(raw, NoScriptError) and attempt == 0:
                await self.redis.script_load(script.script)     # (not run: load it and run it once more)
                continue
            break
        if isinstance(raw, Exception):
            raise raw
        if isinstance(acked, Exception):
            raise acked
        if int(acked) < self.wait_replicas:
            raise errors.Unavailable(
                f"{name}: its writes reached {acked} of the {self.wait_replicas} replicas the allocator waits for "
                f"(redis_wait_replicas) within {self.wait_timeout_ms} ms; not acknowledged (a retry with the same "
                f"request id returns the same outcome)")
        return raw

    async def _pipelined(self, name: str, calls: list[tuple[list[str], dict[str, Any]]], *,
                         internal: tuple[str, ...] = ()) -> list[dict[str, Any] | Exception]:
        """Calls of one script in one pipeline; each reply decoded, or the exception it
        raised (a lost connection raises at once). Each call is observed with the
        pipeline's time."""
        if self.cluster or (self.wait_replicas and name in DURABLE_SCRIPTS):
            return await self._concurrent(name, calls, internal=internal)
        script = self._scripts[name]
        start = time.perf_counter()
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for keys_, payload in calls:
                    await script(keys=keys_, args=[codec.encode(payload)], client=pipe)
                raws = await pipe.execute(raise_on_error=False)
        finally:
            if self.observe is not None:
                elapsed = time.perf_counter() - start
                for _ in calls:
                    self.observe(name, elapsed)
        out: list[dict[str, Any] | Exception] = []
        for raw in raws:
            if isinstance(raw, (RedisConnectionError, RedisTimeoutError)):
                raise raw
            if isinstance(raw, ResponseError):
                out.append(_explained(name, raw))
            elif isinstance(raw, Exception):
                out.append(raw)
            else:
                try:
                    out.append(codec.decode_reply(raw, internal=internal))
                except Exception as exc:  # noqa: BLE001 - handed back per call
                    out.append(exc)
        return out

    async def _concurrent(self, name: str, calls: list[tuple[list[str], dict[str, Any]]], *,
                          internal: tuple[str, ...] = ()) -> list[dict[str, Any] | Exception]:
        """``_pipelined`` on a Redis Cluster (or with ``WAIT``): each call on its own, all at
        once; a lost connection (or a cluster error) raises, as a pipeline's would."""
        results = await asyncio.gather(*(self._call(name, k, p, internal=internal) for k, p in calls),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, (RedisConnectionError, RedisTimeoutError, RedisClusterError)):
                raise r
        return list(results)

    # ------------------------------------------------------------ pool scripts

    @staticmethod
    def _pool_args(pool_id: str, request_id: str = "") -> list[str]:
        """The pool keys plus the request key, as idempotent scripts take them."""
        return keys.pool_keys(pool_id) + [keys.request_key(pool_id, request_id)]

    async def new_pool_id(self, request_id: str, ttl_ms: int) -> str:
        """A fresh ``pool-<n>`` id; the same one again for a retried request id."""
        reply = await self._call("new_pool_id", [keys.POOL_COUNTER, keys.pool_id_request_key(request_id)],
                                 {"request_id": request_id, "ttl_ms": ttl_ms})
        return reply["pool"]

    async def register_pool(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Registers a pool and adds it to the registry, in one script (``register_pool.lua``);
        on a Redis Cluster the registry (another slot) is added to after the script."""
        pool_id = payload["pool"]
        args = self._pool_args(pool_id, payload["request_id"])
        self._stale_pool_list()
        if not self.cluster:
            reply = await self._call("register_pool", args + [keys.POOLS], payload)
        else:
            reply = await self._call("register_pool", args, payload)
            await self.redis.sadd(keys.POOLS, pool_id)
        await self.redis.srem(keys.DRAINING, pool_id)      # (a pool registered anew is not drained)
        self._stale_pool_list(pool_id)
        return reply

    def _stale_pool_list(self, also: str = "") -> None:
        """The cached pool list (plus ``also``) is to be read again at the next use; it is
        kept all the same, to serve while the registry's shard is away."""
        self._registry_changes += 1
        if self._pool_list is not None:
            self._pool_list = (-math.inf, sorted({*self._pool_list[1], *([also] if also else [])}))

    def _forget_pool(self, pool_id: str) -> None:
        """The pool left the registry: the cached list forgets it."""
        self._registry_changes += 1
        if self._pool_list is not None:
            self._pool_list = (-math.inf, [p for p in self._pool_list[1] if p != pool_id])

    async def step(self, payloads: list[dict[str, Any]]) -> list[dict[str, Any] | Exception]:
        """Runs one step script per pool (pipelined); returns each pool's reply or error
        (see ``step.lua`` for the payload)."""
        calls = [(self._pool_args(p["pool"], p["request_id"]), p) for p in payloads]
        internal = (STALE_EPOCH, LEASE_UNKNOWN, TOO_BIG)
        if len(calls) == 1:
            try:
                return [await self._call("step", *calls[0], internal=internal)]
            except (RedisConnectionError, RedisTimeoutError):
                raise
            except Exception as exc:  # noqa: BLE001 - handed back per pool
                return [exc]
        return await self._pipelined("step", calls, internal=internal)

    async def sync(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A lease's Sync in one pool: its journal, its reserve, sequence numbers (``sync.lua``)."""
        return await self._call("sync", self._pool_args(payload["pool"], payload["request_id"]), payload,
                                internal=(LEASE_UNKNOWN,))

    async def resync(self, payload: dict[str, Any]) -> dict[str, Any]:
        """One part of a lease's resync in one pool, after the pool lost writes (``resync.lua``)."""
        pool_id = payload["pool"]
        return await self._call("resync", self._pool_args(pool_id, payload["request_id"])
                                + [keys.resync_key(pool_id, payload["lease_id"])], payload,
                                internal=(LEASE_UNKNOWN,))

    async def stage(self, payload: dict[str, Any]) -> dict[str, Any]:
        """One part of a run in one pool (``stage.lua``): a create or a fork larger than one
        call, a long sequence freed from its last block."""
        return await self._call("stage", self._pool_args(payload["pool"], payload["request_id"]), payload,
                                internal=(STALE_EPOCH, LEASE_UNKNOWN, RUN_SHORT))

    async def remember(self, pool_id: str, request_id: str, fingerprint: str, outcome: dict[str, Any],
                       ttl_ms: int) -> None:
        """Keeps a step's outcome under its request id in one pool (``remember.lua``)."""
        await self._call("remember", [keys.request_key(pool_id, request_id)],
                         {"fingerprint": fingerprint, "outcome": outcome, "request_ttl_ms": ttl_ms})

    async def run_number(self, pool_id: str, request_id: str) -> int:
        """The sequence number of the run under a request id (``stage.lua`` keeps
        ``<fingerprint>#<n>`` there while the run goes on); 0 when there is none."""
        raw = await self.redis.get(keys.request_key(pool_id, request_id))
        if raw and raw[64:65] == b"#" and raw[65:].isdigit():
            return int(raw[65:])
        return 0

    async def block_table(self, pool_id: str, n: int) -> list[int]:
        """A record's whole block table (live or staged), read page by page."""
        meta = await self.redis.hget(keys.pool_key(pool_id, "seqs"), str(n))
        if not meta:
            raise errors.NotFound(f"sequence {pool_id}/{n} not found")
        rec = parse_record(meta, b"")
        pages = await self.redis.hmget(keys.pool_key(pool_id, "tabs"), page_fields(n, rec["num_blocks"]))
        return blocks_of(b"".join(p or b"" for p in pages))

    async def reap(self, pool_id: str, *, force_lease: str = "", max_leases: int = 16,
                   max_seqs: int = 128, max_blocks: int = 512, tombstone_ms: int = 3_600_000) -> dict[str, Any]:
        return await self._call("reap", keys.pool_keys(pool_id),
                                {"pool": pool_id, "force_lease": force_lease, "max_leases": max_leases,
                                 "max_seqs": max_seqs, "max_blocks": max_blocks, "tombstone_ms": tombstone_ms})

    async def heartbeat(self, pool_id: str, epoch: int, dead_since_ms: int = 0,
                        max_dead: int = 4096) -> dict[str, Any]:
        return await self._call("heartbeat", [keys.pool_key(pool_id, "meta"), keys.pool_key(pool_id, "dead")],
                                {"pool": pool_id, "epoch": epoch, "dead_since_ms": dead_since_ms,
                                 "max_dead": max_dead})

    async def tier_settle(self, pool_id: str, epoch: int, settled: list[list[Any]], release: list[str] = (),
                          forget: list[list[Any]] = (), lease_id: str = "",
                          unwritten: list[list[int]] = ()) -> dict[str, Any]:
        """The worker's word on lower-tier orders of one pool, the read pins of its
        fetches that ran, and the blocks whose hashes go (``tier_settle.lua``)."""
        return await self._call("tier_settle", keys.pool_keys(pool_id),
                                {"pool": pool_id, "epoch": epoch, "settled": settled, "release": list(release),
                                 "forget": list(forget), "lease": lease_id, "unwritten": list(unwritten)})

    async def draining(self, pool_id: str) -> bool:
        """Whether the pool is being drained (``kvservice drain``): it takes no new
        sequence. As this replica read the set at most ``POOL_LIST_TTL`` seconds ago."""
        await self.pool_ids(cached=True)
        return pool_id in self._draining

    def draining_now(self, pool_id: str) -> bool:
        """``draining`` as last read, without reading."""
        return pool_id in self._draining

    async def set_draining(self, pool_id: str, on: bool) -> None:
        """Marks the pool as being drained (or no more)."""
        if on:
            await self.redis.sadd(keys.DRAINING, pool_id)
            self._draining = self._draining | {pool_id}
        else:
            await self.redis.srem(keys.DRAINING, pool_id)
            self._draining = self._draining - {pool_id}
        self._stale_pool_list()

    async def unregister_pool(self, pool_id: str, force: bool = False) -> dict[str, Any]:
        """Removes a drained pool (``unregister_pool.lua``) from the registry and from the
        draining set."""
        args = keys.pool_keys(pool_id)
        reply = await self._call("unregister_pool", args if self.cluster else args + [keys.POOLS],
                                 {"pool": pool_id, "force": force})
        if self.cluster:
            await self.redis.srem(keys.POOLS, pool_id)
        await self.redis.srem(keys.DRAINING, pool_id)
        self._forget_pool(pool_id)
        return reply

    async def pin(self, pool_id: str, epoch: int, pin_id: str, ttl_ms: int, hashes: list[str],
                  blocks: list[int] | None = None) -> tuple[list[list[int]], int]:
        """Pins the leading blocks of a chain that the pool holds ready for a fetch, or the
        device blocks ``blocks`` of a migrating sequence (``pin.lua``); returns [tier code,
        block or entry] per block pinned, and the pool's serial after the pin."""
        payload = {"pool": pool_id, "epoch": epoch, "pin_id": pin_id, "ttl_ms": ttl_ms, "block_hashes": hashes}
        if blocks is not None:
            payload["blocks"] = blocks
        reply = await self._call("pin", keys.pool_keys(pool_id), payload)
        return [list(x) for x in reply["pinned"]], int(reply.get("serial") or 0)

    async def tier_snapshot(self, pool_id: str) -> dict[str, dict[str, Any]]:
        """The lower tiers' keys of one pool, read in one transaction (for the audit):
        per tier its state, free list, h2e, e2h, lru and pend, decoded."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for tier in ("host", "disk"):
                k = {n: keys.pool_key(pool_id, f"{tier}:{n}") for n in ("state", "free", "h2e", "e2h", "lru", "pend")}
                pipe.hgetall(k["state"])
                pipe.lrange(k["free"], 0, -1)
                pipe.hgetall(k["h2e"])
                pipe.hgetall(k["e2h"])
                pipe.zrange(k["lru"], 0, -1)
                pipe.zrange(k["pend"], 0, -1)
            res = await pipe.execute()
        out = {}
        for i, tier in enumerate(("host", "disk")):
            state, free, h2e, e2h, lru, pend = res[6 * i:6 * i + 6]
            out[tier] = {"state": {a.decode(): int(b) for a, b in state.items()}, "free": [int(x) for x in free],
                         "h2e": {a.decode(): int(b) for a, b in h2e.items()},
                         "e2h": {int(a): b.decode() for a, b in e2h.items()},
                         "lru": [int(x) for x in lru], "pend": [int(x) for x in pend]}
        return out

    async def probe(self, pool_id: str, epoch: int, hashes: list[str], *, tiers: bool = False) -> dict[str, Any]:
        return await self._call("probe", keys.pool_keys(pool_id),
                                {"pool": pool_id, "epoch": epoch, "block_hashes": hashes, "tiers": tiers})

    # ------------------------------------------------------------ lease scripts

    async def tenant_leases(self, tenant: str, op: str, lease_id: str, *, left_ms: int = 0, ttl_ms: int = 0,
                            limit: int = 0) -> int:
        """Admits ('admit'), touches or drops a lease in its tenant's set of live leases;
        returns how many the tenant holds (``tenant_leases.lua``)."""
        reply = await self._call("tenant_leases", [keys.tenant_leases_key(tenant)],
                                 {"op": op, "lease_id": lease_id, "left_ms": left_ms, "ttl_ms": ttl_ms,
                                  "limit": limit})
        return int(reply["leases"])

    async def grant_lease(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await self._call("lease_grant", keys.lease_keys(payload["lease_id"]), payload)

    async def keep_alive(self, lease_id: str, tombstone_ms: int, *,
                         touched_by_caller: Iterable[str] = ()) -> dict[str, Any]:
        """Extends the lease, then its deadline in every pool where it holds sequences
        (but ``touched_by_caller``: the caller's own script calls raise it there, as a
        Sync's do).

        Raises:
            the first error of a pool's touch: a lease that is extended but not touched
            everywhere would be reaped in that pool.
        """
        reply = await self._call("lease_keepalive", keys.lease_keys(lease_id),
                                 {"lease_id": lease_id, "tombstone_ms": tombstone_ms})
        skip = set(touched_by_caller)
        pools = [pool_id for pool_id in reply["pools"] if pool_id not in skip]
        if pools:
            touched = await self._pipelined("lease_touch", [
                ([keys.pool_key(pool_id, "leases")], {"lease_id": lease_id, "left_ms": reply["ttl_ms"]})
                for pool_id in pools])
            for result in touched:
                if isinstance(result, Exception):
                    raise result
        return reply

    async def attach_lease(self, lease_id: str, pools: list[str], tombstone_ms: int) -> dict[str, Any]:
        return await self._call("lease_attach", keys.lease_keys(lease_id),
                                {"lease_id": lease_id, "pools": pools, "tombstone_ms": tombstone_ms})

    async def lease_tenant(self, lease_id: str) -> str | None:
        """The tenant a lease was granted to (None: no such lease, or its tombstone is gone)."""
        tenant = await self.redis.hget(keys.lease_keys(lease_id)[0], "tenant")
        return tenant.decode() if isinstance(tenant, bytes) else tenant

    async def revoke_lease(self, lease_id: str) -> list[str]:
        reply = await self._call("lease_revoke", keys.lease_keys(lease_id), {"lease_id": lease_id})
        return list(reply["pools"])

    async def place(self, lease_id: str, request_id: str, fingerprint: str, pools: list[str],
                    ttl_ms: int) -> list[str]:
        """The placement of a request's pool-less creates: ``pools`` the first time, the
        first placement again for a retry (``place.lua``)."""
        reply = await self._call("place", [keys.placement_key(lease_id, request_id)],
                                 {"request_id": request_id, "fingerprint": fingerprint, "pools": pools,
                                  "ttl_ms": ttl_ms})
        return list(reply["pools"])

    # ------------------------------------------------------------ metrics exporter lease

    async def claim_exporter(self, replica: str, ttl_ms: int) -> bool:
        """Takes or renews the exporter lease; True if ``replica`` holds it now."""
        return (await self._call("exporter_claim", [keys.EXPORTER], {"replica": replica, "ttl_ms": ttl_ms}))["holder"]

    async def release_exporter(self, replica: str) -> bool:
        return (await self._call("exporter_release", [keys.EXPORTER], {"replica": replica}))["released"]

    async def now_ms(self) -> int:
        """Redis's clock in milliseconds."""
        sec, usec = await self.redis.time()
        return int(sec) * 1000 + int(usec) // 1000

    # ------------------------------------------------------------ reads

    async def pool_ids(self, *, cached: bool = False) -> list[str]:
        """The registered pools, sorted. ``cached``: the list this replica read at most
        ``POOL_LIST_TTL`` seconds ago (its own registrations refresh it at once), for the
        hot paths (placement, the reaper) that would otherwise read the registry's shard on
        every create; a pool another replica registers (or drains) is seen within that time.
        A pool leaves the registry when it is drained (``unregister_pool``). While the registry's Redis (shard) is unreachable, ``cached``
        keeps the list it had (and does not wait more than ``POOL_LIST_WAIT`` for a new
        one), so the pools on the other shards go on being served."""
        now = time.monotonic()
        stale = self._pool_list if cached else None
        if stale is not None and now - stale[0] < POOL_LIST_TTL:
            return stale[1]
        seen = self._registry_changes
        try:
            read = self._read_registry()
            ids, draining = await (asyncio.wait_for(read, POOL_LIST_WAIT) if stale is not None else read)
        except (*REDIS_DOWN, asyncio.TimeoutError):
            if stale is not None:
                # The registry's shard is away: the pools known so far, for another while.
                self._pool_list = (now, stale[1])
                return stale[1]
            raise
        if self._registry_changes == seen:
            self._pool_list, self._draining = (now, ids), draining
        else:       # (read before a change of this replica's: not kept, read again next time)
            self._pool_list = (-math.inf, ids)
        return ids

    async def _read_registry(self) -> tuple[list[str], set[str]]:
        """The registry, sorted, and the draining set."""
        members = await self.redis.smembers(keys.POOLS)
        draining = {m.decode() for m in await self.redis.smembers(keys.DRAINING)}
        return sorted(m.decode() for m in members), draining

    async def generation(self, pool_id: str) -> int:
        """The pool's generation as last recorded (a script run now may begin a new one:
        ``scripts/lib/generation.lua``); 0 for an unregistered pool."""
        raw = await self.redis.hget(keys.pool_key(pool_id, "meta"), "generation")
        return int(raw) if raw else 0

    async def version(self, pool_id: str) -> int:
        """The pool's change counter (``state.version``): the serial of grants of what a
        caller holds now (``kvservice/common/grants.py``)."""
        raw = await self.redis.hget(keys.pool_key(pool_id, "state"), "version")
        return int(raw) if raw else 0

    async def grant_key(self, pool_id: str) -> tuple[int, bytes]:
        """The pool's epoch and that epoch's grant key (b"": none, an unregistered pool)."""
        epoch, key = await self.redis.hmget(keys.pool_key(pool_id, "meta"), ["epoch", "grant_key"])
        return int(epoch or 0), bytes.fromhex(key.decode()) if key else b""

    async def pool_meta(self, pool_id: str) -> dict[str, str] | None:
        raw = await self.redis.hgetall(keys.pool_key(pool_id, "meta"))
        if not raw or b"epoch" not in raw or b"num_blocks" not in raw:
            return None
        return {k.decode(): v.decode() for k, v in raw.items()}

    @staticmethod
    def _queue_counts(pipe: Any, pool_id: str) -> None:
        k = {name: keys.pool_key(pool_id, name) for name in keys.POOL_KEY_NAMES}
        pipe.hgetall(k["meta"])
        pipe.hget(k["state"], "fresh")
        pipe.llen(k["free"])
        pipe.zcard(k["evict"])
        pipe.hlen(k["ref"])
        pipe.hlen(k["seqs"])
        pipe.zcard(k["leases"])
        pipe.hlen(k["reserve"])
        pipe.hgetall(k["stats"])
        for tier in ("host", "disk"):
            pipe.zcard(k[f"{tier}:lru"])
            pipe.zcard(k[f"{tier}:pend"])

    @staticmethod
    def _counts(results: list[Any]) -> dict[str, Any] | None:
        meta, fresh, nfree, nevict, nref, nseqs, nleases, nreserved, stats, *tiers = results
        if not meta or b"num_blocks" not in meta:
            return None
        meta = {a.decode(): b.decode() for a, b in meta.items()}
        return {
            "meta": meta,
            "num_free_blocks": nfree + int(meta["num_blocks"]) - int(fresh or 0),
            "num_evictable_blocks": nevict,
            "num_used_blocks": nref,
            "num_sequences": nseqs,
            "num_leases": nleases,
            "num_reserved_blocks": nreserved,
            "stats": {a.decode(): int(b) for a, b in stats.items()},
            "tiers": {"host": tiers[0:2], "disk": tiers[2:4]},     # ready, pending entries
        }

    async def pool_counts(self, pool_id: str) -> dict[str, Any] | None:
        """Meta, set sizes and counters of one pool, read atomically."""
        async with self.redis.pipeline(transaction=True) as pipe:
            self._queue_counts(pipe, pool_id)
            return self._counts(await pipe.execute())

    async def tenant_holdings(self, pool_id: str, tenant: str) -> tuple[int, int, int]:
        """What a tenant holds in a pool (``scripts/lib/held.lua``): blocks, sequences, leases."""
        raw = await self.redis.hget(keys.pool_key(pool_id, "held"), f"T:{tenant}")
        if not raw:
            return 0, 0, 0
        blocks, sequences, leases = (int(x) for x in raw.split())
        return blocks, sequences, leases

    async def count_failure(self, pool_id: str) -> None:
        await self.redis.hincrby(keys.pool_key(pool_id, "stats"), "allocation_failures", 1)

    async def get_sequence(self, pool_id: str, n: int) -> tuple[int | None, dict[str, Any] | None]:
        """The pool's current epoch and the sequence record (or None)."""
        tabs = keys.pool_key(pool_id, "tabs")
        for _ in range(5):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hget(keys.pool_key(pool_id, "meta"), "epoch")
                pipe.hget(keys.pool_key(pool_id, "seqs"), str(n))
                pipe.hget(tabs, str(n))
                epoch, meta, first = await pipe.execute()
            if not meta:
                return (int(epoch) if epoch else None), None
            rec = parse_record(meta, first)
            if rec["num_blocks"] <= PAGE:
                return int(epoch), rec
            # A long table: every page, and the record again to see that it did not change.
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hget(keys.pool_key(pool_id, "seqs"), str(n))
                pipe.hmget(tabs, page_fields(n, rec["num_blocks"]))
                again, pages = await pipe.execute()
            if again == meta:
                rec["block_table"] = blocks_of(b"".join(p or b"" for p in pages))
                return int(epoch), rec
        raise errors.Unavailable(f"sequence {n} of pool {pool_id} changed during each read; retry")

    async def snapshot(self, pool_id: str, *, piece: int = 1024, attempts: int = 20) -> dict[str, Any] | None:
        """Every allocation key of one pool and its counts (for the audit): a pool of at most
        ``ONE_READ_ENTRIES`` entries in one transaction; a larger one in pieces of
        about ``piece`` entries (HSCAN, ZSCAN, LRANGE: no command holds Redis long), as one
        consistent state: the pool's epoch and change counter (``state.version``, which
        every script that changes the pool raises) are read before and after, and the read
        starts over when they moved. After ``attempts`` reads, a small pool
        (``SMALL_POOL_ENTRIES``) is read in one transaction; a larger one raises
        Unavailable (busy: retry later)."""
        k = {name: keys.pool_key(pool_id, name) for name in keys.POOL_KEY_NAMES}
        r = self.redis

        async def stamp() -> tuple[Any, Any]:
            async with r.pipeline(transaction=True) as pipe:
                pipe.hget(k["meta"], "epoch")
                pipe.hget(k["state"], "version")
                return tuple(await pipe.execute())

        async def scanned(scan: Any, key: str) -> dict[bytes, Any]:
            """HSCAN or ZSCAN to the end (an entry seen twice, as a scan may, counts once)."""
            out: dict[bytes, Any] = {}
            cursor = 0
            while True:
                cursor, part = await scan(key, cursor, count=piece)
                out.update(part)
                if not cursor:
                    return out

        async def hash_of(key: str) -> dict[bytes, bytes]:
            return await scanned(r.hscan, key)

        async def zset_of(key: str) -> list[tuple[bytes, float]]:
            return list((await scanned(r.zscan, key)).items())

        async def list_of(key: str) -> list[bytes]:
            out: list[bytes] = []
            while True:
                part = await r.lrange(key, len(out), len(out) + piece - 1)
                out += part
                if len(part) < piece:
                    return out

        async def size() -> int:
            async with r.pipeline(transaction=True) as pipe:
                for name in POOL_KEY_SIZES:
                    getattr(pipe, POOL_KEY_SIZES[name])(k[name])
                return sum(await pipe.execute())

        async def whole() -> list[Any]:
            """The pool in one transaction: its 16 keys, then its counts."""
            async with r.pipeline(transaction=True) as pipe:
                for name, how in (("meta", "h"), ("state", "h"), ("free", "l"), ("evict", "z"), ("ref", "h"),
                                  ("h2b", "h"), ("b2h", "h"), ("seqs", "h"), ("leases", "z"), ("lseq", "z"),
                                  ("stats", "h"), ("tabs", "h"), ("reserve", "h"), ("journal", "h"), ("held", "h"),
                                  ("pins", "h")):
                    if how == "h":
                        pipe.hgetall(k[name])
                    elif how == "l":
                        pipe.lrange(k[name], 0, -1)
                    else:
                        pipe.zrange(k[name], 0, -1, withscores=True)
                self._queue_counts(pipe, pool_id)
                res = await pipe.execute()
            res[9] = [m for m, _ in res[9]]
            return res

        # A small pool (most of them) in one transaction; a large one in pieces.
        read = await whole() if await size() <= ONE_READ_ENTRIES else None
        for _ in range(attempts if read is None else 0):
            before = await stamp()
            if before[0] is None:
                return None
            meta, state = await hash_of(k["meta"]), await hash_of(k["state"])
            free, evict = await list_of(k["free"]), await zset_of(k["evict"])
            ref, h2b, b2h, seqs = [await hash_of(k[n]) for n in ("ref", "h2b", "b2h", "seqs")]
            leases, lseq = await zset_of(k["leases"]), [m for m, _ in await zset_of(k["lseq"])]
            stats, tabs, reserve, journal, held, pins = [await hash_of(k[n]) for n in (
                "stats", "tabs", "reserve", "journal", "held", "pins")]
            async with r.pipeline(transaction=True) as pipe:
                self._queue_counts(pipe, pool_id)
                counts = await pipe.execute()
            if await stamp() == before:
                read = [meta, state, free, evict, ref, h2b, b2h, seqs, leases, lseq, stats, tabs, reserve, journal,
                        held, pins, *counts]
                break
        else:
            if read is None:
                # Busy throughout: a small pool is read in one transaction instead (a few ms
                # of Redis); a large one waits for a quieter moment.
                entries = await size()
                if entries > SMALL_POOL_ENTRIES:
                    raise errors.Unavailable(f"pool {pool_id} changed during each of {attempts} reads of its state "
                                             f"({entries} entries: read in pieces; retry when it is quieter)")
                read = await whole()
        meta, state, free, evict, ref, h2b, b2h, seqs, leases, lseq, stats, tabs, reserve, journal, held, pins = read[:16]
        counts = read[16:]
        if not meta or b"num_blocks" not in meta:
            return None
        # (decoded in a thread: a large pool's entries would hold the event loop)
        return await asyncio.to_thread(_decoded_snapshot, meta, state, free, evict, ref, h2b, b2h, seqs, leases,
                                       lseq, stats, tabs, reserve, journal, held, pins, self._counts(counts))


#: How a pool key's size is read (the audit's fallback for a small busy pool).
POOL_KEY_SIZES = {"free": "llen", "evict": "zcard", "ref": "hlen", "h2b": "hlen", "b2h": "hlen", "seqs": "hlen",
                  "leases": "zcard", "lseq": "zcard", "tabs": "hlen", "reserve": "hlen", "journal": "hlen",
                  "held": "hlen", "pins": "hlen"}
#: A pool this small (entries in all) is read in one transaction when it is too busy to be read
#: in pieces: a few ms of Redis.
SMALL_POOL_ENTRIES = 20_000
#: A pool this small is read in one transaction at once (well under a millisecond of Redis).
ONE_READ_ENTRIES = 2_048


def _decoded_snapshot(meta: Any, state: Any, free: Any, evict: Any, ref: Any, h2b: Any, b2h: Any, seqs: Any,
                      leases: Any, lseq: Any, stats: Any, tabs: Any, reserve: Any, journal: Any, held: Any,
                      pins: Any, counts: Any) -> dict[str, Any]:
    """``Store.snapshot``'s pieces, decoded (the leases in deadline order)."""
    def s(x: bytes) -> str:
        return x.decode()

    tables = join_pages(tabs)

    return {
        "meta": {s(a): s(b) for a, b in meta.items()},
        "state": {s(a): int(b) for a, b in state.items() if a in (b"fresh", b"clock", b"admitted")},
        # sequence -> (lease, blocks admitted and not taken yet) of each run (scripts/stage.lua)
        "runs": {int(a[4:]): (s(b.split()[0]), int(b.split()[1])) for a, b in state.items() if a.startswith(b"run:")},
        "version": int(state.get(b"version", 0)),
        "free": [int(b) for b in free],
        # (block -> LRU clock, unordered: a sort of a large evictable set, one C-level
        # call, would hold the interpreter lock for tens of ms beside the serving loop)
        "evict": {int(m): sc for m, sc in evict},
        "ref": {int(a): int(b) for a, b in ref.items()},
        "h2b": {s(a): int(b) for a, b in h2b.items()},
        "b2h": {int(a): s(b) for a, b in b2h.items()},
        "seqs": {int(a): parse_record(b, tables.get(a)) for a, b in seqs.items()},
        "leases": {s(m): sc for m, sc in sorted(leases, key=lambda x: (x[1], x[0]))},
        "lseq": sorted(s(m) for m in lseq),
        "stats": {s(a): int(b) for a, b in stats.items()},
        "reserve": [(s(lease), int(b)) for b, lease in reserve.items()],
        # lease -> (last journal entry applied, reserve size as counted)
        "journal": {s(a): tuple(int(x) for x in b.split()) for a, b in journal.items()},
        # "L:<lease>" -> (tenant, blocks, sequences); "T:<tenant>" -> (blocks, sequences, leases)
        "held": {s(a): tuple(x if i == 0 and s(a).startswith("L:") else int(x)
                             for i, x in enumerate(s(b).split())) for a, b in held.items()},
        # read pins (scripts/lib/pins.lua): pin id -> (deadline ms, [(kind, index)]); the
        # counts per "<kind>:<index>"; the earliest deadline
        "pins": {s(a)[2:]: (int(s(b).split()[0]), [(x[0], int(x[2:])) for x in s(b).split()[1:]])
                 for a, b in pins.items() if a.startswith(b"p:")},
        "pin_counts": {s(a): int(b) for a, b in pins.items() if a[:2] in (b"b:", b"h:", b"d:")},
        "pin_next": int(pins[b"next"]) if b"next" in pins else None,
        "counts": counts,
    }


def _explained(name: str, exc: ResponseError) -> ResponseError:
    """The same Redis error, its ``user_script:<line>`` mapped to the script's file and line."""
    return type(exc)(lua.SCRIPTS[name].explain(str(exc)))
