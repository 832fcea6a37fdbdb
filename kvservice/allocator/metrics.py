"""The metrics of an allocator replica: RPC and script latency, and the pool series.

Pool metrics come from Redis, the single source of truth, and would double if every
replica exported them. Scheme: the replicas share an **exporter lease** in Redis
(``kvs:exporter``, claimed and renewed by a Lua script whenever a replica is scraped,
with a TTL of ``metrics_exporter_ttl`` seconds). Only the holder exports the
``kvservice_pool_*`` series; the others export ``kvservice_pool_exporter 0``. If the holder
dies, another scraped replica takes over once the lease expires. So ``sum by (pool)``
over all replicas is always right.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from typing import Any, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from kvservice.common.metrics import (POOL_COUNTERS, POOL_GAUGES, RPC_BUCKETS, SCRIPT_BUCKETS, MetricsInterceptor,
                                      family, histogram)

log = logging.getLogger(__name__)


def replica_id() -> str:
    """A name for this process in the exporter lease: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class AllocatorMetrics:
    """The metrics of one allocator replica, in their own registry.

    Args:
        allocator: read for the pool series (``list_pools``) and ``leases_granted``.
        loop: the event loop the allocator runs on (collection runs there).
        exporter_ttl: seconds the exporter lease lasts without a scrape.
    """

    def __init__(self, allocator: Any, loop: asyncio.AbstractEventLoop, exporter_ttl: float) -> None:
        self.registry = CollectorRegistry()
        self.rpc_seconds = histogram("rpc_duration_seconds", self.registry, RPC_BUCKETS)
        self.script_seconds = histogram("script_duration_seconds", self.registry, SCRIPT_BUCKETS)
        self.interceptor = MetricsInterceptor(self.rpc_seconds)
        self.collector = PoolCollector(allocator, loop, exporter_ttl)
        self.registry.register(self.collector)

    def observe_script(self, script: str, seconds: float) -> None:
        self.script_seconds.labels(script).observe(seconds)


class PoolCollector:
    """Collects the pool series from Redis at scrape time, if this replica is the exporter."""

    TIMEOUT = 5.0

    def __init__(self, allocator: Any, loop: asyncio.AbstractEventLoop, exporter_ttl: float) -> None:
        self.allocator = allocator
        self.loop = loop
        self.ttl_ms = max(1, int(exporter_ttl * 1000))
        self.replica = replica_id()

    def describe(self) -> list[Metric]:
        return []

    async def _read(self) -> tuple[bool, list[Any], int]:
        store = self.allocator.store
        if not await store.claim_exporter(self.replica, self.ttl_ms):
            return False, [], 0
        return True, await self.allocator.list_pools(), await store.now_ms()

    async def release(self) -> None:
        """Gives the exporter lease up (on shutdown), so another replica takes over at once."""
        await self.allocator.store.release_exporter(self.replica)

    def collect(self) -> Iterable[Metric]:
        yield family("leases_granted_total", self.allocator.leases_granted)
        try:
            future = asyncio.run_coroutine_threadsafe(self._read(), self.loop)
            exporter, pools, now_ms = future.result(self.TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail because Redis is down
            log.warning("metrics: cannot read the pools from Redis: %s", exc)
            yield family("redis_up", 0)
            yield family("pool_exporter", 0)
            return
        yield family("redis_up", 1)
        yield family("pool_exporter", 1 if exporter else 0)
        if not exporter:
            return
        out = {short: family(short) for short in (*POOL_GAUGES.values(), *POOL_COUNTERS.values(),
                                                  "pool_block_size_tokens", "pool_epoch",
                                                  "pool_heartbeat_age_seconds")}
        for info in pools:
            labels = [info.pool_id]
            for field, short in POOL_GAUGES.items():
                out[short].add_metric(labels, float(info.stats.get(field, 0)))
            for field, short in POOL_COUNTERS.items():
                out[short].add_metric(labels, float(info.stats.get(field, 0)))
            out["pool_block_size_tokens"].add_metric(labels, info.geometry.block_size)
            out["pool_epoch"].add_metric(labels, info.epoch)
            seen = info.last_heartbeat_ms or info.registered_at_ms
            out["pool_heartbeat_age_seconds"].add_metric(labels, max(0, now_ms - seen) / 1000)
        yield from out.values()
        yield from tier_families(pools)


#: TierStats field -> metric (per pool and tier).
TIER_SERIES = {"num_blocks": "pool_tier_capacity_blocks", "num_used_blocks": "pool_tier_used_blocks",
               "num_pending_blocks": "pool_tier_pending_blocks", "hit_tokens": "pool_tier_hit_tokens_total",
               "blocks_in": "pool_tier_blocks_in_total", "blocks_out": "pool_tier_blocks_out_total",
               "confirmed": "pool_tier_confirmed_total", "load_failures": "pool_tier_load_failures_total",
               "failed_copies": "pool_tier_failed_copies_total", "lost_copies": "pool_tier_lost_copies_total",
               "evictions": "pool_tier_evictions_total"}


def tier_families(pools: list[Any]) -> Iterable[Metric]:
    """The lower tiers' series of every pool that has them."""
    out = {short: family(short) for short in (*TIER_SERIES.values(), "pool_tier_offload_lag_seconds_total")}
    for info in pools:
        for t in info.stats.get("tiers", ()):
            labels = [info.pool_id, t["tier"]]
            for field, short in TIER_SERIES.items():
                out[short].add_metric(labels, float(t[field]))
            out["pool_tier_offload_lag_seconds_total"].add_metric(labels, t["offload_lag_ms_sum"] / 1000)
    yield from out.values()
