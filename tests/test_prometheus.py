"""A real Prometheus scrapes a real local stack through the shipped configuration.

``deploy/prometheus/prometheus.yml`` is loaded as it ships; only its scrape targets (the
compose names) become the local processes' metrics ports, and the intervals 1 s. Then
the pool series that Prometheus stores must equal what the allocator reports, the
workers' and the HTTP API's series must be there, every query of the shipped dashboard
must return data,
every shipped rule must evaluate without error and every query of docs/operations.md
must run.

Skipped when the ``prometheus`` binary is not on PATH (``.ci/run`` installs Debian's
package).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvservice.client import Client
from kvservice.allocator.embedded import terminate
from kvservice.engine import Engine, Request
from kvservice.tools.launcher import Stack

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvservice.json"
OPERATIONS = ROOT / "docs" / "operations.md"
POOLS = ("worker-0", "worker-1")
#: Upper bound of every wait on Prometheus (start, scrapes, rule evaluation).
WAIT = 60.0

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("prometheus") is None,
                       reason="the prometheus binary is not on PATH (.ci/run installs Debian's prometheus package)"),
    pytest.mark.e2e,
]


class Prometheus:
    """A ``prometheus`` process on a free loopback port, with its log in a file."""

    def __init__(self, config: Path, data: Path, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = reply.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
            if not body.startswith(b"{"):
                raise
        return json.loads(body) if body.startswith(b"{") else body.decode()

    def query(self, expr: str) -> list[dict]:
        """The result of an instant query; a query error fails the test."""
        reply = self.get("/api/v1/query", query=expr)
        assert reply["status"] == "success", f"{expr}: {reply.get('errorType')}: {reply.get('error')}"
        return reply["data"]["result"]

    def wait(self, what: str, check: Callable[[], tuple[bool, Any]]) -> Any:
        """Polls ``check`` (ok, detail) until ok, at most ``WAIT`` seconds."""
        deadline = time.monotonic() + WAIT
        detail: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            try:
                ok, detail = check()
            except (urllib.error.URLError, ConnectionError) as exc:
                ok, detail = False, exc
            if ok:
                return detail
            time.sleep(0.5)
        targets = self._targets()
        pytest.fail(f"{what}: not within {WAIT:.0f}s; last seen: {detail}\ntargets: {targets}\n"
                    f"prometheus log:\n{self.log()}")

    def _targets(self) -> Any:
        try:
            return [(t["labels"].get("job"), t["scrapeUrl"], t["health"], t["lastError"])
                    for t in self.get("/api/v1/targets")["data"]["activeTargets"]]
        except Exception as exc:  # noqa: BLE001 - only for a failure message
            return exc

    def stop(self) -> None:
        terminate(self.proc, 15)


def local_config(stack: Stack, path: Path) -> Path:
    """The shipped configuration with the local metrics ports as targets and 1 s intervals."""
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {"kvservice-allocator": [f"127.0.0.1:{stack.allocator.metrics_port}"],
               "kvservice-worker": [f"127.0.0.1:{w.metrics_port}" for w in stack.workers],
               "kvservice-api": [f"127.0.0.1:{stack.api.port}"]}
    jobs = [job["job_name"] for job in config["scrape_configs"]]
    assert sorted(jobs) == sorted(targets), f"the shipped configuration has the jobs {jobs}"
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
        job["scrape_interval"] = "1s"
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str((PROMETHEUS.parent / f).resolve()) for f in config.get("rule_files", [])]
    path.write_text(yaml.safe_dump(config))
    return path


def _complete_over_http(stack: Stack, prompt: list[int], max_tokens: int) -> dict:
    """One /v1/completions call to the stack's HTTP API (token ids: tiny-llama has no tokenizer)."""
    body = json.dumps({"model": stack.api.model, "prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"{stack.api.url}/completions", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {stack.api_key}"})
    with urllib.request.urlopen(req, timeout=60) as reply:
        return json.loads(reply.read())


def run_workload(stack: Stack) -> None:
    """Shared prompts (prefix-cache hits), parallel samples (fork and copy-on-write), and
    model steps on the workers; the same prompts through the HTTP API; everything is freed
    at the end."""
    rng = random.Random(7)
    system = [rng.randrange(512) for _ in range(40)]
    requests = [Request(system + [rng.randrange(512) for _ in range(rng.randrange(3, 20))],
                        max_new_tokens=4, request_id=f"r{i}") for i in range(6)]
    requests.append(Request(system + [1, 2, 3], max_new_tokens=6, n=2, temperature=0.8, seed=3, request_id="n2"))
    with Engine(stack.target, credentials=stack.credentials()) as engine:
        engine.run(requests)
        engine.run(requests[:3])
    for r in requests[:3]:
        reply = _complete_over_http(stack, r.prompt, 4)
        assert reply["usage"]["completion_tokens"] == 4, reply


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A stack that ran a workload and holds one sequence in each pool, scraped by a
    Prometheus; yields (stack, prometheus, the pools' stats from the allocator)."""
    tmp = tmp_path_factory.mktemp("prometheus")
    stack = Stack(2, model="tiny-llama", num_blocks=64, http_port=0, worker_args=("--host-tier-gb", "0.05"))
    prom = client = None
    try:
        stack.start()
        assert stack.allocator.metrics_port > 0, "the allocator serves no /metrics"
        assert all(w.metrics_port > 0 for w in stack.workers), "a worker serves no /metrics"
        assert stack.api is not None and stack.api_key, "the stack serves no HTTP API (with a key)"
        prom = Prometheus(local_config(stack, tmp / "prometheus.yml"), tmp / "data", tmp / "prometheus.log")
        prom.wait("prometheus ready", lambda: (prom.get("/-/ready") is not None, "not ready"))
        run_workload(stack)
        client = Client(stack.target, tenant="prometheus-test", lease_ttl=30, credentials=stack.credentials("admin"))
        held = [client.create(list(range(1, 41)), pool="worker-0"),     # 3 blocks of 16
                client.create(list(range(100, 170)), pool="worker-1")]   # 5 blocks
        audit = client.audit()
        assert audit.ok, list(audit.problems)
        stats = {pool: client.pool_stats(pool) for pool in POOLS}
        yield stack, prom, stats
        for seq in held:
            seq.free()
    finally:
        if client is not None:
            client.close()
        if prom is not None:
            prom.stop()
        stack.stop()


def by_pool(result: list[dict]) -> dict[str, float]:
    return {r["metric"].get("pool"): float(r["value"][1]) for r in result}


def test_pool_usage_ratio_in_prometheus_is_what_the_allocator_reports(scraped):
    _, prom, stats = scraped
    expected = {pool: s.num_used_blocks / s.num_blocks for pool, s in stats.items()}
    assert all(0 < v < 1 for v in expected.values()), expected
    assert expected == pytest.approx({pool: s.usage for pool, s in stats.items()})
    seen = prom.wait("kvservice_pool_usage_ratio of each pool equal to used / capacity", lambda: (
        (got := by_pool(prom.query("sum by (pool) (kvservice_pool_usage_ratio)"))) == pytest.approx(expected), got))
    assert set(seen) == set(POOLS)
    # One replica exports the pool series, as the exporter lease promises.
    assert by_pool(prom.query("sum(kvservice_pool_exporter)")) == {None: 1.0}
    for metric, field in (("kvservice_pool_used_blocks", "num_used_blocks"),
                          ("kvservice_pool_capacity_blocks", "num_blocks"),
                          ("kvservice_pool_prefix_hit_tokens_total", "prefix_hit_tokens"),
                          ("kvservice_pool_cow_copies_total", "cow_copies"),
                          ("kvservice_pool_sequences_created_total", "sequences_created")):
        want = {pool: float(getattr(s, field)) for pool, s in stats.items()}
        prom.wait(f"{metric} equal to the pool stats' {field} {want}", lambda metric=metric, want=want: (
            (got := by_pool(prom.query(f"sum by (pool) ({metric})"))) == want, got))
    assert sum(s.prefix_hit_tokens for s in stats.values()) > 0, "the workload hit no cached prefix"
    assert sum(s.cow_copies for s in stats.values()) > 0, "the workload made no copy-on-write copy"


def test_worker_metrics_reach_prometheus(scraped):
    _, prom, stats = scraped
    capacity = {pool: float(s.num_blocks) for pool, s in stats.items()}
    prom.wait("kvservice_worker_pool_blocks of each worker equal to its pool's capacity", lambda: (
        (got := by_pool(prom.query("sum by (pool) (kvservice_worker_pool_blocks)"))) == capacity, got))
    pool_bytes = by_pool(prom.query("sum by (pool) (kvservice_worker_pool_bytes)"))
    assert set(pool_bytes) == set(POOLS) and all(v > 0 for v in pool_bytes.values()), pool_bytes
    kernels = prom.wait("kernel timings from the workers", lambda: (
        (got := {r["metric"]["kernel"]: float(r["value"][1]) for r in prom.query(
            "sum by (kernel) (kvservice_worker_kernel_duration_seconds_count)")}).get("paged_attention", 0) > 0, got))
    assert kernels.get("reshape_and_cache", 0) > 0, kernels
    tokens = prom.query("sum(kvservice_worker_forward_tokens_total)")
    assert tokens and float(tokens[0]["value"][1]) > 0, tokens
    forward = prom.query('sum(kvservice_rpc_duration_seconds_count{service="kvservice.v1.Worker", method="Forward"})')
    assert forward and float(forward[0]["value"][1]) > 0, forward


def test_api_metrics_reach_prometheus(scraped):
    _, prom, _ = scraped
    got = prom.wait("kvservice_api_requests_total of the HTTP completions", lambda: (
        (got := {(r["metric"]["endpoint"], r["metric"]["status"]): float(r["value"][1])
                 for r in prom.query("sum by (endpoint, status) (kvservice_api_requests_total)")})
        .get(("completions", "200"), 0) >= 3, got))
    assert set(got) == {("completions", "200")}, got
    tokens = prom.query("sum(kvservice_api_generation_tokens_total)")
    assert tokens and float(tokens[0]["value"][1]) == 12, tokens
    assert prom.query('sum(kvservice_api_time_to_first_token_seconds_count{endpoint="completions"})')
    waiting = prom.query("sum(kvservice_api_requests_waiting)")
    assert waiting and float(waiting[0]["value"][1]) == 0, waiting


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for top in dash["panels"] for p in (top, *top.get("panels", []))]
    return [(f"{p['title']} ({t['refId']})", t["expr"].replace("$__rate_interval", "1m").replace("$pool", ".*"))
            for p in panels for t in p.get("targets", [])]


def test_every_dashboard_query_returns_data_from_the_stack(scraped):
    _, prom, _ = scraped
    queries = _dashboard_queries()
    assert queries

    def check() -> tuple[bool, list[str]]:
        empty = [where for where, expr in queries if not prom.query(expr)]
        return not empty, empty

    prom.wait("every dashboard query returning data (empty ones listed)", check)


def test_every_shipped_rule_evaluates_without_error(scraped):
    _, prom, _ = scraped

    def check() -> tuple[bool, list]:
        rules = [r for g in prom.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        bad = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        return bool(rules) and not bad, bad or rules

    prom.wait("every rule of deploy/prometheus/rules.yml evaluated with health ok", check)


def test_operations_doc_queries_run_on_prometheus(scraped):
    _, prom, _ = scraped
    blocks = re.findall(r"```promql\n(.*?)```", OPERATIONS.read_text(), re.DOTALL)
    queries = [" ".join(ln for ln in q.splitlines() if not ln.lstrip().startswith("#"))
               for block in blocks for q in re.split(r"\n\s*\n", block)]
    queries = [q for q in queries if q.strip()]
    assert queries
    for q in queries:
        prom.query(q)    # a query error fails here
    # (the first scrapes may not have happened yet when this test runs first in the module)
    prom.wait("a replica exporting the pool series (kvservice_pool_exporter == 1)",
              lambda: (bool(prom.query("kvservice_pool_exporter == 1")), "none"))
