"""/metrics of a real local deployment (``kvservice up``: an embedded Redis, an allocator
and two model workers, each its own process): the pool gauges equal what the audit
counts, and every counter moves by exactly what the workload implies.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families
from helpers import wait_for

from kvservice import errors
from kvservice.client import Client
from kvservice.common.security import ClientCredentials
from kvservice.engine import Engine, Request
from kvservice.tools.launcher import AllocatorProcess
from kvservice.allocator.embedded import EmbeddedRedis, terminate
from kvservice.common.metrics import CATALOGUE, sample_names

pytestmark = [pytest.mark.timeout(300), pytest.mark.e2e]
NUM_BLOCKS, BS, LAYERS = 64, 16, 2   # tiny-llama has 2 layers
POOLS = ("worker-0", "worker-1")


def scrape(url: str) -> dict[str, dict[frozenset, float]]:
    """Sample name -> {frozenset of label items: value}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, dict[frozenset, float]] = defaultdict(dict)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name][frozenset(s.labels.items())] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when the series does not exist yet)."""
    return m.get(name, {}).get(frozenset(labels.items()), 0.0)


def pool_value(m: dict, short: str, pool: str) -> float:
    return value(m, f"kvservice_{short}", pool=pool)


class Up:
    """``python -m kvservice up`` as a child process; its addresses parsed from what it prints."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvservice", "up", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if line.startswith("ready:"):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(180) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("kvservice up did not get ready:\n" + "\n".join(self.lines))
        text = "\n".join(self.lines)
        self.target = re.search(r"point clients and engines at (\S+?);", text).group(1)
        self.metrics = {name: url for name, url in re.findall(r"^\s+(\S+)\s.*metrics (http://\S+/metrics)\)",
                                                               text, re.M)}
        # The stack's throwaway credentials: its admin may grant a lease for any tenant it names.
        creds = re.search(r"TLS \+ auth credentials in (\S+):", text).group(1)
        self.admin = ClientCredentials(ca=f"{creds}/ca.pem", cert=f"{creds}/admin.pem", key=f"{creds}/admin-key.pem")
        # (an engine reads and writes K/V: a tenant's credentials; an admin's are for operations)
        self.engine = ClientCredentials(ca=f"{creds}/ca.pem", cert=f"{creds}/engine.pem",
                                        key=f"{creds}/engine-key.pem")

    def stop(self) -> None:
        terminate(self.proc, 30)


@pytest.fixture(scope="module")
def up():
    u = Up("--workers", "2", "--model", "tiny-llama", "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BS),
           "--host-tier-gb", "0.01")
    try:
        yield u
    finally:
        u.stop()


def test_up_prints_the_metrics_endpoint_of_every_process(up):
    assert set(up.metrics) == {"allocator", *POOLS}, up.lines
    for url in up.metrics.values():
        assert urllib.request.urlopen(url, timeout=10).status == 200


def test_allocator_exports_the_pool_series_of_the_catalogue(up):
    m = scrape(up.metrics["allocator"])
    assert value(m, "kvservice_pool_exporter") == 1
    assert value(m, "kvservice_redis_up") == 1
    wanted = {n for spec in CATALOGUE if spec.source == "exporter" for n in spec.sample_names}
    for name in wanted:
        assert {dict(k)["pool"] for k in m.get(name, {})} == set(POOLS), name
    assert set(m) <= sample_names(), set(m) - sample_names()
    for pool in POOLS:
        assert pool_value(m, "pool_capacity_blocks", pool) == NUM_BLOCKS
        assert pool_value(m, "pool_block_size_tokens", pool) == BS
        assert 0 <= pool_value(m, "pool_heartbeat_age_seconds", pool) < 30


def _check_gauges_equal_audit(up, client: Client) -> dict[str, dict[str, float]]:
    m = scrape(up.metrics["allocator"])
    audit = client.audit()
    assert audit.ok, list(audit.problems)
    seen = {}
    for p in audit.pools:
        got = {f: pool_value(m, short, p.pool_id) for f, short in (
            ("num_blocks", "pool_capacity_blocks"), ("num_free_blocks", "pool_free_blocks"),
            ("num_evictable_blocks", "pool_evictable_blocks"), ("num_used_blocks", "pool_used_blocks"),
            ("num_sequences", "pool_sequences"), ("num_leases", "pool_leases"))}
        assert got == {f: getattr(p, f) for f in got}, p.pool_id
        assert pool_value(m, "pool_usage_ratio", p.pool_id) == pytest.approx(p.num_used_blocks / p.num_blocks)
        assert got["num_free_blocks"] + got["num_evictable_blocks"] + got["num_used_blocks"] == got["num_blocks"]
        seen[p.pool_id] = got
    assert set(seen) == set(POOLS)
    return seen


def test_pool_gauges_equal_the_audit_as_sequences_come_and_go(up):
    with Client(up.target, credentials=up.admin, tenant="gauges", keepalive=False) as c:
        before = _check_gauges_equal_audit(up, c)
        a = c.create(list(range(1000, 1040)), pool="worker-0")      # 3 blocks
        b = c.create(list(range(2000, 2017)), pool="worker-1")      # 2 blocks
        kid = a.fork([7])                                           # CoW of a's last block: +1
        during = _check_gauges_equal_audit(up, c)
        assert during["worker-0"]["num_used_blocks"] == before["worker-0"]["num_used_blocks"] + 4
        assert during["worker-1"]["num_used_blocks"] == before["worker-1"]["num_used_blocks"] + 2
        assert during["worker-0"]["num_sequences"] == before["worker-0"]["num_sequences"] + 2
        c.step(frees=[a, b, kid])
        after = _check_gauges_equal_audit(up, c)
        for pool in POOLS:
            assert after[pool]["num_used_blocks"] == before[pool]["num_used_blocks"]
        # a's two full blocks and b's one stay cached (evictable) after the free.
        assert after["worker-0"]["num_evictable_blocks"] >= before["worker-0"]["num_evictable_blocks"] + 2
        assert after["worker-1"]["num_evictable_blocks"] >= before["worker-1"]["num_evictable_blocks"] + 1


def _delta(before: dict, after: dict, short: str, pool: str) -> float:
    return pool_value(after, short, pool) - pool_value(before, short, pool)


def test_allocator_counters_move_by_what_the_workload_implies(up):
    url, pool = up.metrics["allocator"], "worker-1"
    m0 = scrape(url)
    c = Client(up.target, credentials=up.admin, tenant="counters", keepalive=False)
    try:
        m1 = scrape(url)
        assert value(m1, "kvservice_leases_granted_total") - value(m0, "kvservice_leases_granted_total") == 1
        # (the module's other tests, in any order, may have left cached blocks: what the
        # free list cannot give is evicted)
        free = c.pool_stats(pool).num_free_blocks
        rpcs = c.rpc_count
        prompt = list(range(5000, 5040))                     # 40 tokens: 2 full blocks + 8
        a = c.create(prompt, pool=pool)                      # 3 fresh blocks
        kid = a.fork()                                       # shares all 3
        kid.append([1])                                      # last block shared: CoW, +1 block
        again = c.create(prompt, pool=pool)                  # hits 32 tokens, +1 block for the last 8
        with pytest.raises(errors.ResourceExhausted):
            c.create(list(range(NUM_BLOCKS * BS + 1)), pool=pool)   # 65 blocks: more than the pool
        c.step(frees=[a, kid, again])
        steps = c.rpc_count - rpcs
        m2 = scrape(url)
    finally:
        c.close()
    expected = {"pool_sequences_created_total": 3, "pool_sequences_freed_total": 3,
                "pool_allocated_blocks_total": 3 + 1 + 1, "pool_cow_copies_total": 1,
                "pool_prefix_queried_tokens_total": 80, "pool_prefix_hit_tokens_total": 32,
                "pool_allocation_failures_total": 1, "pool_evictions_total": max(0, 5 - free)}
    assert {k: _delta(m1, m2, k, pool) for k in expected} == expected
    for k in expected:
        assert _delta(m1, m2, k, "worker-0") == 0, k
    step_ok = {"service": "kvservice.v1.Allocator", "method": "Step", "code": "OK"}
    step_full = {**step_ok, "code": "RESOURCE_EXHAUSTED"}
    name = "kvservice_rpc_duration_seconds_count"
    assert value(m2, name, **step_full) - value(m1, name, **step_full) == 1
    assert value(m2, name, **step_ok) - value(m1, name, **step_ok) == steps - 1
    scripts = value(m2, "kvservice_script_duration_seconds_count", script="step") - \
        value(m1, "kvservice_script_duration_seconds_count", script="step")
    assert scripts >= steps


def test_evictions_count_cached_blocks_taken_for_new_prompts(up):
    url, pool = up.metrics["allocator"], "worker-1"
    with Client(up.target, credentials=up.admin, tenant="evict", keepalive=False) as c:
        # A cached block (a full prompt block, freed), whatever the module's other tests left.
        c.step(frees=[c.create(list(range(90_000, 90_000 + BS + 1)), pool=pool)])
        c.flush()
        assert wait_for(lambda: pool_value(scrape(url), "pool_evictable_blocks", pool) >= 1)
        m1 = scrape(url)
        free = int(pool_value(m1, "pool_free_blocks", pool))
        big = c.create(list(range(100_000, 100_000 + (free + 1) * BS)), pool=pool)   # one block too many
        m2 = scrape(url)
        c.step(frees=[big])
    assert _delta(m1, m2, "pool_evictions_total", pool) == 1
    assert _delta(m1, m2, "pool_allocated_blocks_total", pool) == free + 1
    assert pool_value(m2, "pool_free_blocks", pool) == 0


def test_an_expired_lease_is_counted_as_expired_and_reaped(up):
    url, pool = up.metrics["allocator"], "worker-0"
    m1 = scrape(url)
    c = Client(up.target, credentials=up.admin, tenant="expiring", lease_ttl=0.2, keepalive=False)
    c.create(list(range(300, 340)), pool=pool)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m2 = scrape(url)
        if _delta(m1, m2, "pool_leases_expired_total", pool) >= 1:
            break
        time.sleep(0.2)
    c.close(revoke=False)
    assert _delta(m1, m2, "pool_leases_expired_total", pool) == 1
    assert _delta(m1, m2, "pool_sequences_reaped_total", pool) == 1
    assert _delta(m1, m2, "pool_sequences_freed_total", pool) == 1


def test_engine_run_moves_worker_and_pool_counters_consistently(up):
    urls = up.metrics
    before = {name: scrape(u) for name, u in urls.items()}
    system = list(range(10, 42))                               # 32 tokens: two full blocks, shared
    requests = [Request(system + [100 + i, 200 + i, 300 + i], max_new_tokens=5, n=1 + (i % 2), seed=i)
                for i in range(6)]
    with Engine(up.target, credentials=up.engine) as engine:
        report = engine.run(requests)
    after = {name: scrape(u) for name, u in urls.items()}
    assert report.failed == 0 and report.preemptions == 0 and report.requests == 6
    alloc0, alloc1 = before["allocator"], after["allocator"]
    assert sum(_delta(alloc0, alloc1, "pool_prefix_hit_tokens_total", p) for p in POOLS) == report.prefix_hit_tokens
    assert report.prefix_hit_tokens > 0
    assert sum(_delta(alloc0, alloc1, "pool_cow_copies_total", p) for p in POOLS) == report.cow_copies
    samples = sum(r.n for r in requests)
    forward_tokens = 0.0
    for pool in POOLS:
        w0, w1 = before[pool], after[pool]
        forward_tokens += _delta(w0, w1, "worker_forward_tokens_total", pool)
        fwd = {"service": "kvservice.v1.Worker", "method": "Forward", "code": "OK"}
        calls = value(w1, "kvservice_rpc_duration_seconds_count", **fwd) - \
            value(w0, "kvservice_rpc_duration_seconds_count", **fwd)
        for kernel in ("paged_attention", "reshape_and_cache"):
            labels = {"pool": pool, "kernel": kernel, "backend": "torch"}
            launches = value(w1, "kvservice_worker_kernel_duration_seconds_count", **labels) - \
                value(w0, "kvservice_worker_kernel_duration_seconds_count", **labels)
            assert launches == LAYERS * calls, (pool, kernel)
        assert value(w1, "kvservice_worker_pool_blocks", pool=pool) == NUM_BLOCKS
        assert set(w1) <= sample_names("worker") | sample_names("both")
    # Prompts once (minus cache hits), then every generated token but each sample's last.
    assert forward_tokens == report.prefill_tokens + report.tokens - samples
    with Client(up.target, credentials=up.admin, tenant="audit", keepalive=False) as c:
        gauges = _check_gauges_equal_audit(up, c)
    assert all(g["num_used_blocks"] == 0 for g in gauges.values())


# ------------------------------------------------------------ several replicas


def test_only_one_replica_exports_the_pool_series_and_another_takes_over():
    redis = EmbeddedRedis(port=0).start()
    replicas = [AllocatorProcess(redis.url, args=("--metrics-exporter-ttl", "2")).start() for _ in range(2)]
    c = Client(replicas[0].target, tenant="replicas", lease_ttl=3600, keepalive=False)
    try:
        c.register_pool("shared", num_blocks=32)
        c.create(list(range(20)), pool="shared")          # 2 blocks
        scrapes = [scrape(r.metrics_url) for r in replicas]
        exporters = [value(m, "kvservice_pool_exporter") for m in scrapes]
        assert sorted(exporters) == [0, 1]
        holder = exporters.index(1)
        other = 1 - holder
        assert "kvservice_pool_used_blocks" not in scrapes[other]
        # Summed over replicas, as a dashboard does, nothing doubles.
        assert sum(pool_value(m, "pool_used_blocks", "shared") for m in scrapes) == 2
        assert sum(pool_value(m, "pool_capacity_blocks", "shared") for m in scrapes) == 32
        replicas[holder].kill()                          # no graceful release: the lease must expire
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            m = scrape(replicas[other].metrics_url)
            if value(m, "kvservice_pool_exporter") == 1:
                break
            time.sleep(0.2)
        assert value(m, "kvservice_pool_exporter") == 1
        assert pool_value(m, "pool_used_blocks", "shared") == 2
    finally:
        c.close(revoke=False)                                # its replica may be gone
        for r in replicas:
            r.stop()
        redis.stop()


def test_a_replica_stopped_gracefully_hands_the_exporter_lease_over_at_once():
    redis = EmbeddedRedis(port=0).start()
    first = AllocatorProcess(redis.url, args=("--metrics-exporter-ttl", "3600")).start()
    second = AllocatorProcess(redis.url, args=("--metrics-exporter-ttl", "3600")).start()
    try:
        assert value(scrape(first.metrics_url), "kvservice_pool_exporter") == 1
        assert value(scrape(second.metrics_url), "kvservice_pool_exporter") == 0
        first.stop()
        assert value(scrape(second.metrics_url), "kvservice_pool_exporter") == 1
    finally:
        first.stop()
        second.stop()
        redis.stop()


def test_metrics_port_minus_one_turns_the_endpoint_off():
    with AllocatorProcess(args=("--metrics-port", "-1")) as a:
        assert a.metrics_port == -1
        with Client(a.target, keepalive=False) as c:
            assert list(c.pools()) == []                     # serving, with a fresh embedded Redis
        assert "metrics on" not in a.log()


def test_bad_metrics_port_is_refused_with_the_field_named():
    out = subprocess.run([sys.executable, "-m", "kvservice", "serve", "--metrics-port", "70000"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "metrics_port must be in -1..65535" in out.stderr
