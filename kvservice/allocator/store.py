"""The Redis layer: runs the Lua scripts and reads state; knows nothing of gRPC.

Every mutation is one registered script (EVALSHA, reloaded on NOSCRIPT by redis-py);
reads that must be consistent are one MULTI/EXEC. Script error codes become
``kvservice.errors`` exceptions here.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvservice import errors
from kvservice.allocator import keys, lua

#: Internal script codes that the allocator handles itself (never reach a client).
STALE_EPOCH = "STALE_EPOCH"


class ScriptError(Exception):
    """An internal script code that the caller is expected to handle."""

    def __init__(self, code: str, reply: dict[str, Any]) -> None:
        super().__init__(reply.get("msg", code))
        self.code = code
        self.reply = reply


def decode_reply(raw: bytes | str, *, internal: tuple[str, ...] = ()) -> dict[str, Any]:
    """Parses a script's JSON reply; raises the matching domain error for ``err``."""
    reply = json.loads(raw)
    code = reply.get("err") if isinstance(reply, dict) else None
    if code is None:
        return reply
    if code in internal:
        raise ScriptError(code, reply)
    if code == "RESOURCE_EXHAUSTED":
        raise errors.ResourceExhausted(reply["msg"], needed=int(reply.get("needed", 0)),
                                       available=int(reply.get("available", 0)))
    cls = errors.BY_CODE_NAME.get(code)
    if cls is None:
        raise RuntimeError(f"unexpected script reply: {reply}")
    raise cls(reply["msg"])


def blocks_of(table: str | bytes) -> list[int]:
    """A stored block table (6 hex digits per block id) as a list of ids."""
    if isinstance(table, bytes):
        table = table.decode()
    return [int(table[i:i + 6], 16) for i in range(0, len(table), 6)]


def parse_record(meta: bytes | str, table: bytes | str | None) -> dict[str, Any]:
    """A sequence record ``{l, t, c, k, h, b}`` from its ``seqs`` and ``tabs`` entries."""
    if isinstance(meta, bytes):
        meta = meta.decode()
    lease, t, c, k, h = meta.split(" ")
    return {"l": lease, "t": int(t), "c": int(c), "k": int(k), "h": h, "b": blocks_of(table or "")}


def connect(url: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio Redis client for ``redis://``, ``rediss://`` or ``unix://`` URLs."""
    return aioredis.Redis.from_url(url, decode_responses=False, health_check_interval=30, **kwargs)


class Store:
    """Allocator state in one Redis (or one Redis Cluster: every call names one slot)."""

    def __init__(self, redis: aioredis.Redis, observe: Callable[[str, float], None] | None = None) -> None:
        self.redis = redis
        #: Called with (script name, seconds) after every script call (metrics hook).
        self.observe = observe
        self._step = redis.register_script(lua.STEP)
        self._reap = redis.register_script(lua.REAP)
        self._register = redis.register_script(lua.REGISTER)
        self._probe = redis.register_script(lua.PROBE)
        self._touch = redis.register_script(lua.LEASE_TOUCH)
        self._grant = redis.register_script(lua.LEASE_GRANT)
        self._keepalive = redis.register_script(lua.LEASE_KEEPALIVE)
        self._attach = redis.register_script(lua.LEASE_ATTACH)
        self._revoke = redis.register_script(lua.LEASE_REVOKE)
        self._heartbeat = redis.register_script(lua.HEARTBEAT)
        self._claim = redis.register_script(lua.EXPORTER_CLAIM)
        self._release = redis.register_script(lua.EXPORTER_RELEASE)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> None:
        await self.redis.ping()

    async def _call(self, name: str, script: Any, keys_: list[str], args: list[Any]) -> Any:
        """One script call, timed for ``observe``."""
        start = time.perf_counter()
        try:
            return await script(keys=keys_, args=args)
        finally:
            if self.observe is not None:
                self.observe(name, time.perf_counter() - start)

    async def _pipelined(self, name: str, pipe: Any, count: int, **kwargs: Any) -> list[Any]:
        """Executes a pipeline of ``count`` calls of one script; each is observed with the pipeline's time."""
        start = time.perf_counter()
        try:
            return await pipe.execute(**kwargs)
        finally:
            if self.observe is not None:
                elapsed = time.perf_counter() - start
                for _ in range(count):
                    self.observe(name, elapsed)

    # ------------------------------------------------------------ pool scripts

    @staticmethod
    def _pool_args(pool_id: str, request_id: str = "") -> list[str]:
        """The pool keys plus the request key, as idempotent scripts take them."""
        return keys.pool_keys(pool_id) + [keys.request_key(pool_id, request_id)]

    async def register_pool(self, payload: dict[str, Any]) -> dict[str, Any]:
        pool_id = payload["pool"]
        await self.redis.sadd(keys.POOLS, pool_id)
        raw = await self._call("register", self._register, self._pool_args(pool_id, payload["rid"]),
                               [json.dumps(payload)])
        return decode_reply(raw)

    async def step(self, payloads: list[dict[str, Any]]) -> list[dict[str, Any] | Exception]:
        """Runs one step script per pool (pipelined); returns each pool's reply or error.

        Each payload is ``{"pool", "rid", "header": dict, "argv": [str]}`` (see ``lua.STEP``).
        """
        if len(payloads) == 1:
            p = payloads[0]
            raws = [await self._call("step", self._step, self._pool_args(p["pool"], p["rid"]),
                                     [json.dumps(p["header"]), *p["argv"]])]
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                for p in payloads:
                    await self._step(keys=self._pool_args(p["pool"], p["rid"]),
                                     args=[json.dumps(p["header"]), *p["argv"]], client=pipe)
                raws = await self._pipelined("step", pipe, len(payloads), raise_on_error=False)
        out: list[dict[str, Any] | Exception] = []
        for raw in raws:
            if isinstance(raw, (RedisConnectionError, RedisTimeoutError)):
                raise raw
            if isinstance(raw, Exception):
                out.append(raw)
                continue
            try:
                out.append(decode_reply(raw, internal=(STALE_EPOCH, "LEASE_UNKNOWN")))
            except Exception as exc:  # noqa: BLE001 - handed back per pool
                out.append(exc)
        return out

    async def reap(self, pool_id: str, *, force_lease: str = "", max_leases: int = 16,
                   max_seqs: int = 512, tombstone_ms: int = 3_600_000) -> dict[str, Any]:
        payload = {"pool": pool_id, "force_lease": force_lease, "max_leases": max_leases,
                   "max_seqs": max_seqs, "tombstone_ms": tombstone_ms}
        raw = await self._call("reap", self._reap, keys.pool_keys(pool_id), [json.dumps(payload)])
        return decode_reply(raw)

    async def heartbeat(self, pool_id: str, epoch: int) -> dict[str, Any]:
        raw = await self._call("heartbeat", self._heartbeat, [keys.pool_key(pool_id, "meta")], [pool_id, epoch])
        return decode_reply(raw)

    async def probe(self, pool_id: str, epoch: int, hashes: list[str]) -> dict[str, Any]:
        raw = await self._call("probe", self._probe, keys.pool_keys(pool_id),
                               [json.dumps({"pool": pool_id, "e": epoch, "hs": hashes})])
        return decode_reply(raw)

    # ------------------------------------------------------------ lease scripts

    async def grant_lease(self, payload: dict[str, Any]) -> dict[str, Any]:
        raw = await self._call("lease_grant", self._grant, keys.lease_keys(payload["lease"]), [json.dumps(payload)])
        return decode_reply(raw)

    async def keep_alive(self, lease_id: str, tombstone_ms: int) -> dict[str, Any]:
        raw = await self._call("lease_keepalive", self._keepalive, keys.lease_keys(lease_id),
                               [json.dumps({"lease": lease_id, "tombstone_ms": tombstone_ms})])
        reply = decode_reply(raw)
        pools = [p.decode() if isinstance(p, bytes) else p for p in (reply.get("pools") or [])]
        if pools:
            async with self.redis.pipeline(transaction=False) as pipe:
                for pool_id in pools:
                    await self._touch(keys=[keys.pool_key(pool_id, "leases")],
                                      args=[lease_id, reply["deadline"]], client=pipe)
                await self._pipelined("lease_touch", pipe, len(pools))
        reply["pools"] = pools
        return reply

    async def attach_lease(self, lease_id: str, pools: list[str], tombstone_ms: int) -> dict[str, Any]:
        raw = await self._call("lease_attach", self._attach, keys.lease_keys(lease_id),
                               [json.dumps({"lease": lease_id, "pools": pools, "tombstone_ms": tombstone_ms})])
        return decode_reply(raw)

    async def revoke_lease(self, lease_id: str) -> list[str]:
        raw = await self._call("lease_revoke", self._revoke, keys.lease_keys(lease_id), [json.dumps({"lease": lease_id})])
        return list(decode_reply(raw).get("pools") or [])

    # ------------------------------------------------------------ metrics exporter lease

    async def claim_exporter(self, replica: str, ttl_ms: int) -> bool:
        """Takes or renews the exporter lease; True if ``replica`` holds it now."""
        return bool(await self._call("exporter_claim", self._claim, [keys.EXPORTER], [replica, ttl_ms]))

    async def release_exporter(self, replica: str) -> bool:
        return bool(await self._call("exporter_release", self._release, [keys.EXPORTER], [replica]))

    async def now_ms(self) -> int:
        """Redis's clock in milliseconds."""
        sec, usec = await self.redis.time()
        return int(sec) * 1000 + int(usec) // 1000

    # ------------------------------------------------------------ reads

    async def pool_ids(self) -> list[str]:
        return sorted(m.decode() for m in await self.redis.smembers(keys.POOLS))

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
        pipe.hgetall(k["stats"])

    @staticmethod
    def _counts(results: list[Any]) -> dict[str, Any] | None:
        meta, fresh, nfree, nevict, nref, nseqs, nleases, stats = results
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
            "stats": {a.decode(): int(b) for a, b in stats.items()},
        }

    async def pool_counts(self, pool_id: str) -> dict[str, Any] | None:
        """Meta, set sizes and counters of one pool, read atomically."""
        async with self.redis.pipeline(transaction=True) as pipe:
            self._queue_counts(pipe, pool_id)
            return self._counts(await pipe.execute())

    async def count_failure(self, pool_id: str) -> None:
        await self.redis.hincrby(keys.pool_key(pool_id, "stats"), "allocation_failures", 1)

    async def get_sequence(self, pool_id: str, n: int) -> tuple[int | None, dict[str, Any] | None]:
        """The pool's current epoch and the sequence record (or None)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(keys.pool_key(pool_id, "meta"), "epoch")
            pipe.hget(keys.pool_key(pool_id, "seqs"), str(n))
            pipe.hget(keys.pool_key(pool_id, "tabs"), str(n))
            epoch, meta, tab = await pipe.execute()
        return (int(epoch) if epoch else None), (parse_record(meta, tab) if meta else None)

    async def snapshot(self, pool_id: str) -> dict[str, Any] | None:
        """Every allocation key of one pool and its counts, read in one transaction (for the audit)."""
        k = {name: keys.pool_key(pool_id, name) for name in keys.POOL_KEY_NAMES}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(k["meta"])
            pipe.hgetall(k["state"])
            pipe.lrange(k["free"], 0, -1)
            pipe.zrange(k["evict"], 0, -1, withscores=True)
            pipe.hgetall(k["ref"])
            pipe.hgetall(k["h2b"])
            pipe.hgetall(k["b2h"])
            pipe.hgetall(k["seqs"])
            pipe.zrange(k["leases"], 0, -1, withscores=True)
            pipe.zrange(k["lseq"], 0, -1)
            pipe.hgetall(k["stats"])
            pipe.hgetall(k["tabs"])
            self._queue_counts(pipe, pool_id)
            res = await pipe.execute()
        meta, state, free, evict, ref, h2b, b2h, seqs, leases, lseq, stats, tabs = res[:12]
        if not meta or b"num_blocks" not in meta:
            return None

        def s(x: bytes) -> str:
            return x.decode()

        return {
            "meta": {s(a): s(b) for a, b in meta.items()},
            "state": {s(a): int(b) for a, b in state.items()},
            "free": [int(b) for b in free],
            "evict": [(int(m), sc) for m, sc in evict],
            "ref": {int(a): int(b) for a, b in ref.items()},
            "h2b": {s(a): int(b) for a, b in h2b.items()},
            "b2h": {int(a): s(b) for a, b in b2h.items()},
            "seqs": {int(a): parse_record(b, tabs.get(a)) for a, b in seqs.items()},
            "leases": {s(m): sc for m, sc in leases},
            "lseq": [s(m) for m in lseq],
            "stats": {s(a): int(b) for a, b in stats.items()},
            "counts": self._counts(res[12:]),
        }
