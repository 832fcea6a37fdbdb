"""A worker's Prometheus metrics: RPC latency, kernel latency, pool size, tokens computed.

The names come from ``kvservice.common.metrics.CATALOGUE``. Kernels are timed by ``TimedBackend``,
a wrapper around the pool's backend: wall time around each call on the CPU; on a GPU a
pair of CUDA events around the launch, read back once the events have completed (no
synchronisation is added to the data path).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterable

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from kvservice.common.metrics import KERNEL_BUCKETS, RPC_BUCKETS, MetricsInterceptor, family, histogram
from worker.pool import KVPool

TIER_NAMES = {0: "device", 1: "host", 2: "disk"}

KERNELS = ("reshape_and_cache", "paged_attention", "copy_blocks")
#: Kernel timings waiting for their CUDA events; beyond this, the oldest is read back synchronously.
MAX_PENDING = 4096


class TimedBackend:
    """A ``KVBackend`` whose kernels report ``observe(kernel, seconds)``; everything else passes through."""

    def __init__(self, inner: Any, observe: Callable[[str, float], None], device: torch.device) -> None:
        self.inner = inner
        self.name = inner.name
        self.observe = observe
        self.cuda = device.type == "cuda"
        self._pending: deque[tuple[str, Any, Any]] = deque()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def _timed(self, kernel: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.inner, kernel)
        if not self.cuda:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.observe(kernel, time.perf_counter() - start)
            return out
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = fn(*args, **kwargs)
        end.record()
        self._pending.append((kernel, begin, end))
        self.drain()
        return out

    def drain(self) -> None:
        """Observes every timing whose events have completed (and the oldest ones beyond MAX_PENDING)."""
        while self._pending and (len(self._pending) > MAX_PENDING or self._pending[0][2].query()):
            kernel, begin, end = self._pending.popleft()
            end.synchronize()
            self.observe(kernel, begin.elapsed_time(end) / 1000)

    def reshape_and_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("reshape_and_cache", *args, **kwargs)

    def paged_attention(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("paged_attention", *args, **kwargs)

    def copy_blocks(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("copy_blocks", *args, **kwargs)


class WorkerMetrics:
    """The metrics of one worker, in their own registry; ``attach`` times the pool's kernels."""

    def __init__(self, pool_id: str, pool: KVPool, runner: Any = None, fence: Any = None) -> None:
        self.pool_id = pool_id
        self.pool = pool
        self.runner = runner
        self.fence = fence          # (worker.fence.LeaseFence: its refused writes)
        self.tiers = None           # (worker.tiers.Tiers: blocks moved between tiers)
        self.sources = None         # (worker.transfer.Sources: blocks moved between workers)
        self.store = None           # (worker.store.StoreCounts: blocks written and read by store clients)
        self.registry = CollectorRegistry()
        self.rpc_seconds = histogram("rpc_duration_seconds", self.registry, RPC_BUCKETS)
        self.kernel_seconds = histogram("worker_kernel_duration_seconds", self.registry, KERNEL_BUCKETS)
        self.interceptor = MetricsInterceptor(self.rpc_seconds)
        self.registry.register(self)

    def attach(self) -> None:
        """Wraps the pool's backend so that every kernel call is timed."""
        if not isinstance(self.pool.backend, TimedBackend):
            self.pool.backend = TimedBackend(self.pool.backend, self.observe_kernel, self.pool.device)

    def observe_kernel(self, kernel: str, seconds: float) -> None:
        self.kernel_seconds.labels(self.pool_id, kernel, self.pool.backend.name).observe(seconds)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        labels = [self.pool_id]
        for short, value in (("worker_pool_bytes", self.pool.pool_bytes),
                             ("worker_pool_blocks", self.pool.shape.num_blocks),
                             ("worker_forward_tokens_total", self.runner.num_tokens if self.runner else 0)):
            f = family(short)
            f.add_metric(labels, float(value))
            yield f
        tiers = getattr(self, "tiers", None)        # (worker.tiers.Tiers, when the pool has any)
        if tiers is not None:
            for short, counts in (("worker_tier_moved_blocks_total", tiers.moved),
                                  ("worker_tier_moved_bytes_total", tiers.moved_bytes),
                                  ("worker_tier_failed_moves_total", tiers.failed)):
                f = family(short)
                for (src, dst), n in sorted(counts.items()):
                    f.add_metric([self.pool_id, TIER_NAMES[src], TIER_NAMES[dst]], float(n))
                yield f
        sources = self.sources
        if sources is not None:
            for short, inbound, outbound in (("worker_transfer_blocks_total", sources.fetched, sources.served_blocks),
                                             ("worker_transfer_bytes_total", sources.fetched_bytes,
                                              sources.served_bytes)):
                f = family(short)
                f.add_metric([self.pool_id, "in"], float(inbound))
                f.add_metric([self.pool_id, "out"], float(outbound))
                yield f
            f = family("worker_transfer_failed_blocks_total")
            f.add_metric(labels, float(sources.failed))
            yield f
            f = family("worker_transfer_staged_fetches_total")
            f.add_metric(labels, float(sources.staging.staged if sources.staging is not None else 0))
            yield f
        store = self.store
        if store is not None:
            f = family("worker_store_blocks_total")
            f.add_metric([self.pool_id, "in"], float(store.written_blocks))
            f.add_metric([self.pool_id, "out"], float(store.read_blocks))
            yield f
        rights = self.fence.rights if self.fence is not None else None
        if rights is not None:
            f = family("worker_grants_total")
            f.add_metric([self.pool_id, "refused"], float(rights.refused))
            f.add_metric([self.pool_id, "denied"], float(rights.denied))
            yield f
        f = family("worker_refused_writes_total")
        for reason, n in sorted((self.fence.refused if self.fence is not None else {}).items()):
            f.add_metric([self.pool_id, reason], float(n))
        yield f
