"""The HTTP API's Prometheus metrics (``/metrics`` on the API's port), declared in
``kvservice.common.metrics.CATALOGUE``: what serving operators watch.

Time to first token runs from the request's arrival to its first generated token (any
sample); inter-token latency is the gap between two tokens of one sample; end-to-end
latency runs from arrival to the completion. Running and waiting requests are read from
the engine at each scrape.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvservice.common.metrics import histogram, spec

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _counter(short: str, registry: CollectorRegistry) -> Counter:
    m = spec(short)
    return Counter(m.name[: -len("_total")], m.help, m.labels, registry=registry)


def _gauge(short: str, registry: CollectorRegistry) -> Gauge:
    m = spec(short)
    return Gauge(m.name, m.help, m.labels, registry=registry)


class ApiMetrics:
    """The API's series in ``registry``; ``start(endpoint)`` times one request."""

    def __init__(self, registry: CollectorRegistry, engine) -> None:
        self.ttft = histogram("api_time_to_first_token_seconds", registry, TTFT_BUCKETS)
        self.itl = histogram("api_inter_token_latency_seconds", registry, ITL_BUCKETS)
        self.e2e = histogram("api_e2e_request_latency_seconds", registry, E2E_BUCKETS)
        self.requests = _counter("api_requests_total", registry)
        self.prompt_tokens = _counter("api_prompt_tokens_total", registry)
        self.generation_tokens = _counter("api_generation_tokens_total", registry)
        self.cached_tokens = _counter("api_cached_prompt_tokens_total", registry)
        _gauge("api_requests_running", registry).set_function(lambda: engine.num_running)
        _gauge("api_requests_waiting", registry).set_function(lambda: engine.num_waiting)

    def start(self, endpoint: str) -> "Timing":
        return Timing(self, endpoint)

    def refused(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()


class Timing:
    """One request's clock."""

    __slots__ = ("m", "endpoint", "t0", "first", "last", "ended")

    def __init__(self, m: ApiMetrics, endpoint: str) -> None:
        self.m, self.endpoint, self.t0 = m, endpoint, time.monotonic()
        self.first = False
        self.last: dict[int, float] = {}
        self.ended = False

    def output(self, out) -> None:
        if not out.token_ids:
            return
        now = time.monotonic()
        if not self.first:
            self.first = True
            self.m.ttft.labels(self.endpoint).observe(now - self.t0)
        if out.index in self.last:
            self.m.itl.labels(self.endpoint).observe((now - self.last[out.index]) / len(out.token_ids))
        self.last[out.index] = now

    def done(self, completion, status: int) -> None:
        if self.ended:
            return
        self.ended = True
        m = self.m
        m.e2e.labels(self.endpoint).observe(time.monotonic() - self.t0)
        m.requests.labels(self.endpoint, str(status)).inc()
        m.prompt_tokens.inc(completion.num_prompt_tokens)
        m.cached_tokens.inc(completion.num_cached_tokens)
        m.generation_tokens.inc(sum(len(o) for o in completion.outputs))

    def cancelled(self) -> None:
        if not self.ended:
            self.ended = True
            self.m.requests.labels(self.endpoint, "499").inc()   # the client closed the request
