"""Prometheus metrics of allocator replicas, workers and the HTTP API (prometheus-client).

Every metric the project exports is declared once, in ``CATALOGUE``: the allocator and
the worker build their metrics from it, ``docs/operations.md`` lists it, and the tests
check the shipped dashboard against it. Names follow Prometheus conventions: one prefix
(``kvservice_``), base units (seconds, bytes, blocks, tokens), ``_total`` on counters,
0–1 ratios.

The allocator's metrics (and the exporter lease that keeps the pool series from doubling
over replicas) are in ``kvservice.allocator.metrics``; the worker's in ``worker.metrics``.

Core code never touches Prometheus: the interceptor times RPCs, the store reports script
durations through a callback, and the collector reads the allocator's own results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

import grpc
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvservice.common.interceptor import UnaryInterceptor

disable_created_metrics()

PREFIX = "kvservice"
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SCRIPT_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
KERNEL_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                  0.05, 0.1, 0.25, 1.0, 5.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric.

    ``name`` is the family name (a counter's samples add ``_total``, which the name
    already carries here); ``source`` says who exports it: ``allocator`` (every replica),
    ``exporter`` (the replica holding the exporter lease), ``worker``, ``both``
    (allocator replicas and workers), ``api`` (the HTTP API, ``kvservice api``), ``events``
    (the pools' KV event publisher, ``kvservice events``) or ``router`` (the KV event
    router, ``kvservice router``).
    """

    name: str
    kind: str
    labels: tuple[str, ...]
    help: str
    source: str

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The names that appear in ``/metrics`` and PromQL."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _m(name: str, kind: str, labels: tuple[str, ...], source: str, help: str) -> MetricSpec:
    return MetricSpec(f"{PREFIX}_{name}", kind, labels, help, source)


POOL = ("pool",)
CATALOGUE: tuple[MetricSpec, ...] = (
    # --- every process that serves gRPC
    _m("rpc_duration_seconds", "histogram", ("service", "method", "code"), "both",
       "Time to handle one gRPC call, by service, method and status code."),
    # --- every allocator replica
    _m("script_duration_seconds", "histogram", ("script",), "allocator",
       "Time of one Lua script call as this replica sees it (pipelined calls: the pipeline's time)."),
    _m("leases_granted_total", "counter", (), "allocator", "Leases granted by this replica."),
    _m("pool_exporter", "gauge", (), "allocator",
       "1 if this replica holds the exporter lease and exports the kvservice_pool_* series, else 0."),
    _m("redis_up", "gauge", (), "allocator", "1 if the last metrics collection reached Redis, else 0."),
    # --- pool state, from Redis, exported by the exporter-lease holder only
    _m("pool_capacity_blocks", "gauge", POOL, "exporter", "Blocks in the pool (num_blocks)."),
    _m("pool_free_blocks", "gauge", POOL, "exporter", "Blocks on the free list (never used or released uncached)."),
    _m("pool_evictable_blocks", "gauge", POOL, "exporter",
       "Blocks with no owner that still hold a cached prefix (reusable, evicted LRU-first)."),
    _m("pool_used_blocks", "gauge", POOL, "exporter", "Blocks referenced by at least one block table."),
    _m("pool_reserved_blocks", "gauge", POOL, "exporter",
       "Blocks held in leases' reserves: owned by a lease, in no block table yet."),
    _m("pool_usage_ratio", "gauge", POOL, "exporter", "Used blocks / capacity, 0-1."),
    _m("pool_sequences", "gauge", POOL, "exporter", "Live sequences in the pool."),
    _m("pool_leases", "gauge", POOL, "exporter", "Leases holding sequences in the pool."),
    _m("pool_block_size_tokens", "gauge", POOL, "exporter", "Token slots per block."),
    _m("pool_epoch", "gauge", POOL, "exporter", "The pool's epoch (changes when its worker registers again)."),
    _m("pool_heartbeat_age_seconds", "gauge", POOL, "exporter",
       "Seconds since the pool's worker last sent a heartbeat (Redis clock); since registration before the first."),
    _m("pool_prefix_queried_tokens_total", "counter", POOL, "exporter",
       "Prompt tokens of created sequences (every create looks its prompt up in the prefix cache)."),
    _m("pool_prefix_hit_tokens_total", "counter", POOL, "exporter", "Prompt tokens served from the prefix cache."),
    _m("pool_evictions_total", "counter", POOL, "exporter", "Cached blocks evicted to make room."),
    _m("pool_cow_copies_total", "counter", POOL, "exporter", "Copy-on-write block copies handed to workers."),
    _m("pool_allocation_failures_total", "counter", POOL, "exporter",
       "Calls refused with RESOURCE_EXHAUSTED (not enough free + evictable blocks)."),
    _m("pool_allocated_blocks_total", "counter", POOL, "exporter", "Fresh blocks handed out (free list or eviction)."),
    _m("pool_sequences_created_total", "counter", POOL, "exporter", "Sequences created (forks included)."),
    _m("pool_sequences_freed_total", "counter", POOL, "exporter", "Sequences freed (reaped ones included)."),
    _m("pool_leases_expired_total", "counter", POOL, "exporter", "Expired leases swept from the pool."),
    _m("pool_sequences_reaped_total", "counter", POOL, "exporter", "Sequences freed because their lease expired."),
    _m("pool_journal_entries_total", "counter", POOL, "exporter",
       "Journal entries (clients' local changes) applied by Sync."),
    _m("pool_journal_batches_total", "counter", POOL, "exporter", "Syncs that carried journal entries for the pool."),
    _m("pool_journal_resent_entries_total", "counter", POOL, "exporter",
       "Journal entries received again after they were applied (resends after a lost reply; skipped)."),
    _m("pool_journal_gaps_total", "counter", POOL, "exporter",
       "Journal batches not applied because they started after a gap (the client resends)."),
    _m("pool_journal_resyncs_total", "counter", POOL, "exporter",
       "Resyncs: a client's whole state, sent after the pool lost journal entries it had acknowledged."),
    _m("pool_sequences_lost_total", "counter", POOL, "exporter",
       "Sequences a resync could not keep (their blocks may be another lease's): the engine recomputes them."),
    _m("pool_generations_total", "counter", POOL, "exporter",
       "Generations the pool began in its life: one per registration, one each time the Redis serving it "
       "restarted or failed over (its state may have rolled back: every lease there resynchronises)."),
    _m("pool_fetched_blocks_total", "counter", POOL, "exporter",
       "Blocks of creates here filled from another pool's worker (a prefix cached there, fetched, not recomputed)."),
    _m("pool_fetch_pins_total", "counter", POOL, "exporter",
       "Read pins taken on this pool's blocks and tier entries for fetches by other pools' workers."),
    _m("pool_fetch_pinned_blocks_total", "counter", POOL, "exporter",
       "Blocks and tier entries of this pool pinned for fetches by other pools' workers."),
    _m("pool_fetch_pins_expired_total", "counter", POOL, "exporter",
       "Read pins released at their deadline rather than by their fetch's settlement (a fetch lost with its engine)."),
    _m("pool_forgotten_blocks_total", "counter", POOL, "exporter",
       "Cached blocks whose hash was dropped because their content is not what it says (a prompt a failed step never "
       "wrote, a failed load or fetch; SettleTiers forget and unwritten)."),
    # --- lower tiers (DESIGN §12), per pool and tier (host, disk), from Redis, exported by the exporter
    _m("pool_tier_capacity_blocks", "gauge", ("pool", "tier"), "exporter", "Entries (blocks) of the pool's tier."),
    _m("pool_tier_used_blocks", "gauge", ("pool", "tier"), "exporter",
       "Entries of the tier that hold a confirmed block (usable by a prefix hit)."),
    _m("pool_tier_pending_blocks", "gauge", ("pool", "tier"), "exporter",
       "Entries of the tier whose copy was ordered and not confirmed yet (never a hit)."),
    _m("pool_tier_hit_tokens_total", "counter", ("pool", "tier"), "exporter",
       "Prompt tokens served by loads from the tier (not recomputed)."),
    _m("pool_tier_blocks_in_total", "counter", ("pool", "tier"), "exporter",
       "Blocks ordered copied down into the tier (device -> host on eviction, host -> disk)."),
    _m("pool_tier_blocks_out_total", "counter", ("pool", "tier"), "exporter",
       "Blocks ordered loaded from the tier into the device (prefix hits)."),
    _m("pool_tier_confirmed_total", "counter", ("pool", "tier"), "exporter",
       "Copies into the tier confirmed by the worker (pending -> ready)."),
    _m("pool_tier_load_failures_total", "counter", ("pool", "tier"), "exporter",
       "Loads from the tier whose bytes failed their checksum or hash (entry dropped, tokens recomputed)."),
    _m("pool_tier_failed_copies_total", "counter", ("pool", "tier"), "exporter",
       "Copies into the tier that failed (entry dropped)."),
    _m("pool_tier_lost_copies_total", "counter", ("pool", "tier"), "exporter",
       "Copies into the tier never confirmed within a minute (a worker or client died): entry taken back."),
    _m("pool_tier_evictions_total", "counter", ("pool", "tier"), "exporter",
       "Ready entries of the tier reused for other blocks (LRU)."),
    _m("pool_tier_offload_lag_seconds_total", "counter", ("pool", "tier"), "exporter",
       "Time from ordering a copy into the tier to its confirmation, summed over the confirmed copies "
       "(divide by kvservice_pool_tier_confirmed_total: the mean offload lag)."),
    # --- workers
    _m("worker_pool_bytes", "gauge", POOL, "worker", "Bytes of device memory held by the worker's K/V pool."),
    _m("worker_pool_blocks", "gauge", POOL, "worker", "Blocks in the worker's K/V pool."),
    _m("worker_kernel_duration_seconds", "histogram", ("pool", "kernel", "backend"), "worker",
       "Time of one kernel launch on the worker's device, by kernel and backend (cuda or torch)."),
    _m("worker_forward_tokens_total", "counter", POOL, "worker", "Tokens computed by Forward (prefill and decode)."),
    _m("worker_tier_moved_blocks_total", "counter", ("pool", "src", "dst"), "worker",
       "Blocks moved between the device and the lower tiers by MoveBlocks, by source and destination tier."),
    _m("worker_tier_moved_bytes_total", "counter", ("pool", "src", "dst"), "worker",
       "Bytes moved between the device and the lower tiers by MoveBlocks."),
    _m("worker_tier_failed_moves_total", "counter", ("pool", "src", "dst"), "worker",
       "MoveBlocks orders that failed (a load whose checksum or hash did not match, an unreadable entry)."),
    _m("worker_transfer_blocks_total", "counter", ("pool", "direction"), "worker",
       "Blocks moved between workers: fetched into this pool (direction in, FetchBlocks) or served from it to another "
       "worker (out, PullBlocks)."),
    _m("worker_transfer_bytes_total", "counter", ("pool", "direction"), "worker",
       "Bytes of the blocks moved between workers, by direction (in, out)."),
    _m("worker_transfer_failed_blocks_total", "counter", POOL, "worker",
       "Blocks a FetchBlocks did not write: the source could not read them, their checksum did not match, or the "
       "transfer failed (its source died, stalled or refused)."),
    _m("worker_transfer_staged_fetches_total", "counter", POOL, "worker",
       "FetchBlocks whose blocks came through a staging file in shared memory (a source on this machine) rather than "
       "in the stream."),
    _m("worker_store_blocks_total", "counter", ("pool", "direction"), "worker",
       "Blocks store clients moved: written into this pool (direction in, WriteBlocks) or read from it (out, "
       "ReadBlocks)."),
    _m("worker_grants_total", "counter", ("pool", "result"), "worker",
       "Grants (worker/rights.py): refused (a bad signature, another pool, epoch, generation or tenant: the call "
       "carrying it is refused), and calls denied (PERMISSION_DENIED) for a block that no grant gives their lease."),
    _m("worker_refused_writes_total", "counter", ("pool", "reason"), "worker",
       "Writes (WriteKV, CopyBlocks, Forward, MoveBlocks, FetchBlocks, WriteBlocks) refused: LEASE_EXPIRED (a dead "
       "lease's), ROLLED_BACK (of another generation than the pool's: a writer that has not resynchronised since its "
       "Redis restarted or failed over)."),
    # --- the OpenAI-compatible HTTP API (kvservice api)
    _m("api_requests_total", "counter", ("endpoint", "status"), "api",
       "Requests answered, by endpoint (completions, chat) and HTTP status (499: the client went away)."),
    _m("api_time_to_first_token_seconds", "histogram", ("endpoint",), "api",
       "From a request's arrival to its first generated token."),
    _m("api_inter_token_latency_seconds", "histogram", ("endpoint",), "api",
       "Between two consecutive tokens of one sample."),
    _m("api_e2e_request_latency_seconds", "histogram", ("endpoint",), "api",
       "From a request's arrival to its last token."),
    _m("api_prompt_tokens_total", "counter", (), "api", "Prompt tokens of finished requests."),
    _m("api_generation_tokens_total", "counter", (), "api", "Tokens generated for finished requests (all samples)."),
    _m("api_cached_prompt_tokens_total", "counter", (), "api",
       "Prompt tokens of finished requests served by the prefix cache (usage.prompt_tokens_details.cached_tokens)."),
    _m("api_requests_running", "gauge", (), "api", "Requests with sequences in the KV pools."),
    _m("api_requests_waiting", "gauge", (), "api", "Requests waiting for KV blocks or a sequence slot."),
    # --- the pools' KV event publisher (kvservice events)
    _m("events_published_total", "counter", ("pool",), "events",
       "KV event batches published, by pool (the topic)."),
    _m("events_replays_served_total", "counter", (), "events",
       "Replay requests the publisher's replay socket answered."),
    # --- the KV event router (kvservice router)
    _m("events_ingested_total", "counter", ("instance",), "router", "KV events applied to the index, by instance."),
    _m("events_dropped_batches_total", "counter", ("instance",), "router",
       "Event batches an instance published that the router missed and its replay socket no longer had (the "
       "instance's entries are then dropped)."),
    _m("events_replay_requests_total", "counter", ("instance",), "router",
       "Replay requests sent to an instance's replay socket (a gap in its sequence numbers)."),
    _m("events_restarts_total", "counter", ("instance",), "router",
       "Publishers seen numbering their batches from the start again (a restarted instance: its entries dropped)."),
    _m("index_blocks", "gauge", ("instance",), "router", "Blocks the index knows an instance holds (any medium)."),
    _m("route_lookup_seconds", "histogram", (), "router", "Time to rank the instances for one prompt."),
    _m("routed_requests_total", "counter", ("instance", "reason"), "router",
       "Prompts routed, by the instance chosen and why: cache (it caches part of the prompt) or load (none does)."),
)
BY_NAME = {m.name: m for m in CATALOGUE}
#: Pool-stat counters in Redis (``PoolStats`` fields) -> catalogue names.
POOL_COUNTERS = {
    "prefix_queried_tokens": "pool_prefix_queried_tokens_total",
    "prefix_hit_tokens": "pool_prefix_hit_tokens_total",
    "evictions": "pool_evictions_total",
    "cow_copies": "pool_cow_copies_total",
    "allocation_failures": "pool_allocation_failures_total",
    "blocks_allocated": "pool_allocated_blocks_total",
    "sequences_created": "pool_sequences_created_total",
    "sequences_freed": "pool_sequences_freed_total",
    "leases_expired": "pool_leases_expired_total",
    "sequences_reaped": "pool_sequences_reaped_total",
    "journal_entries": "pool_journal_entries_total",
    "journal_batches": "pool_journal_batches_total",
    "journal_resent_entries": "pool_journal_resent_entries_total",
    "journal_gaps": "pool_journal_gaps_total",
    "journal_resyncs": "pool_journal_resyncs_total",
    "sequences_lost": "pool_sequences_lost_total",
    "generations": "pool_generations_total",
    "fetched_blocks": "pool_fetched_blocks_total",
    "fetch_pins": "pool_fetch_pins_total",
    "fetch_pinned_blocks": "pool_fetch_pinned_blocks_total",
    "fetch_pins_expired": "pool_fetch_pins_expired_total",
    "forgotten_blocks": "pool_forgotten_blocks_total",
}
POOL_GAUGES = {
    "num_blocks": "pool_capacity_blocks",
    "num_free_blocks": "pool_free_blocks",
    "num_evictable_blocks": "pool_evictable_blocks",
    "num_used_blocks": "pool_used_blocks",
    "num_reserved_blocks": "pool_reserved_blocks",
    "usage": "pool_usage_ratio",
    "num_sequences": "pool_sequences",
    "num_leases": "pool_leases",
}


def spec(short: str) -> MetricSpec:
    """The catalogue entry of ``kvservice_<short>``."""
    return BY_NAME[f"{PREFIX}_{short}"]


def sample_names(source: str | None = None) -> set[str]:
    """Every sample name the code exports (of one source, or all)."""
    return {n for m in CATALOGUE if source in (None, m.source) for n in m.sample_names}


def histogram(short: str, registry: CollectorRegistry, buckets: Iterable[float]) -> Histogram:
    """The catalogue's histogram ``kvservice_<short>`` registered in ``registry``."""
    m = spec(short)
    assert m.kind == "histogram", m
    return Histogram(m.name, m.help, m.labels, registry=registry, buckets=tuple(buckets))


def family(short: str, value: float | None = None) -> Metric:
    """A gauge or counter family for a custom collector (``value`` for label-less ones)."""
    m = spec(short)
    cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
    name = m.name[: -len("_total")] if m.kind == "counter" else m.name
    if value is not None:
        return cls(name, m.help, value=value)
    return cls(name, m.help, labels=m.labels)


# ------------------------------------------------------------------ RPC latency


class MetricsInterceptor(UnaryInterceptor):
    """Times every unary call into ``kvservice_rpc_duration_seconds{service, method, code}``.

    Put it first in the server's interceptor list, so that it also sees the status that
    the error interceptor aborts with.
    """

    def __init__(self, rpc_seconds: Histogram) -> None:
        self.rpc_seconds = rpc_seconds

    def wrap(self, inner: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
        service, _, name = method.lstrip("/").rpartition("/")
        observe = self.rpc_seconds

        async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            code = grpc.StatusCode.UNKNOWN
            try:
                reply = await inner(request, context)
                code = context.code() or grpc.StatusCode.OK
                return reply
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                label = code.name if isinstance(code, grpc.StatusCode) else str(code)
                observe.labels(service, name, label).observe(time.perf_counter() - start)

        return timed


# ------------------------------------------------------------------ HTTP endpoint


class MetricsServer:
    """``/metrics`` of one registry over HTTP, in a daemon thread (``port`` 0: any free port)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self.server.server_port

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
