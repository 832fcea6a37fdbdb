"""``kvservice shards`` runs end to end on a real local Redis Cluster and reports real
figures: every shard served script calls and spent CPU, the shares add up, the one
shard's calls are the step calls its callers made, the capacity follows from them, and
the WAIT part timed calls with and without WAIT on a primary with a replica, every WAIT
acknowledged (no assertion on speed: the measured numbers live in docs/operations.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.cli import build_parser
from kvservice.tools.shardcalls import MODES
from kvservice.tools.shards import CAPACITY_SHARDS, deviation, efficiency, main, report

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(180), pytest.mark.e2e]


def _children() -> set[int]:
    out: set[int] = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
                out |= {int(c) for c in f.read().split()}
        except OSError:
            pass
    return out


def test_shards_measures_every_shard_one_shard_s_ceiling_and_the_capacity(capsys):
    before = _children()
    args = build_parser().parse_args(["shards", "--pools", "24", "--seconds", "3", "--clients", "2",
                                      "--single-seconds", "2", "--callers", "8", "--pool-blocks", "4096",
                                      "--wait-seconds", "2", "--json"])
    assert main(args) == 0
    out = capsys.readouterr()
    assert _children() <= before, "a process the command started outlived it"
    assert "[shards] workload" in out.err and "[shards] one shard" in out.err and "[shards] what WAIT" in out.err
    fig = json.loads(out.out)

    balance = fig["balance"]
    shards = balance["shards"]
    assert len(shards) == 3 and len({s["shard"] for s in shards}) == 3
    assert sum(s["pools"] for s in shards) == 24
    for s in shards:
        assert s["script_calls"] > 0 and s["cpu_s"] > 0 and s["keys"] > 0, s
        assert s["cpu_ms_per_1k_calls"] == pytest.approx(s["cpu_s"] * 1e6 / s["script_calls"])
    for share in ("calls_share", "cpu_share"):
        assert sum(s[share] for s in shards) == pytest.approx(1.0)
        assert all(0 < s[share] < 1 for s in shards)
    assert balance["calls_deviation"] == pytest.approx(deviation([s["calls_share"] for s in shards]))
    assert balance["holds"] == (max(balance["calls_deviation"], balance["cpu_deviation"])
                                <= balance["target_deviation"])
    assert balance["efficiency"] == pytest.approx(efficiency([s["cpu_share"] for s in shards]))
    assert balance["engine_steps"] > 0 and balance["rpcs"] > 0 and balance["syncs"] > 0   # both SDK modes ran
    assert balance["audit_ok"] is True

    single = fig["single_shard"]
    assert single["shard"] in {s["shard"] for s in shards}
    assert single["calls_per_s"] > 0 and single["cpu_us_per_call"] > 0 and single["failed_calls"] == 0
    # Every script call the shard counted is a step call of the callers (those in flight
    # when the counters were read aside).
    assert abs(single["script_calls"] - single["step_calls"]) <= 2 * single["callers"]
    assert 15 <= single["sequences_per_call"] <= 16
    assert single["ceiling_calls_per_s"] == pytest.approx(1e6 / single["cpu_us_per_call"])
    assert single["tokens_per_call"] == pytest.approx(16 * single["sequences_per_call"])

    rows = fig["capacity"]
    assert [r["shards"] for r in rows] == list(CAPACITY_SHARDS)
    assert rows[0]["efficiency"] == balance["efficiency"] and rows[0]["efficiency_source"] == "measured"
    for r in rows:
        assert 0 < r["efficiency"] <= 1 and 0 < r["scaled_efficiency"] <= 1
        assert r["calls_per_s"] == pytest.approx(r["shards"] * single["ceiling_calls_per_s"] * r["efficiency"])
        assert r["tokens_per_s"] == pytest.approx(r["calls_per_s"] * single["tokens_per_call"])
    # With pools growing with the shards, the capacity grows with them.
    scaled = [r["scaled_calls_per_s"] for r in rows]
    assert scaled == sorted(scaled) and scaled[0] < scaled[-1]
    assert any("one core per shard" in a for a in fig["assumptions"])

    wait = fig["wait"]
    assert wait["shard"] != wait["replica"] and wait["wait_replicas"] == 1 and wait["callers"] == 8
    for m in MODES:
        w = wait[m]
        assert w["latency_calls"] > 10 and w["concurrent_calls"] > 10, (m, w)
        assert 0 < w["p50_us"] <= w["p99_us"] and w["mean_us"] > 0, (m, w)
        assert w["calls_per_s"] > 0 and w["cpu_us_per_call"] > 0 and 0 < w["redis_cpu_share"] < 1.5, (m, w)
        assert w["calls_per_s"] == pytest.approx(w["concurrent_calls"] / w["concurrent_seconds"])
        assert w["replica_cpu_us_per_call"] > 0 and w["client_cpu_us_per_call"] > 0, (m, w)
        assert w["ceiling_calls_per_s"] == pytest.approx(1e6 / w["cpu_us_per_call"])
    # Every WAIT was acknowledged, and the primary ran one WAIT per step call of the
    # store with WAIT (and none for the store without it: its calls outnumber them).
    assert wait["shortfalls"] == 0 and wait["wait"]["shortfalls"] == wait["no_wait"]["shortfalls"] == 0
    assert wait["wait_calls"] == wait["wait"]["step_calls"] > 0
    assert wait["wait_commands"] == wait["wait_calls"]
    assert wait["added_p50_us"] == pytest.approx(wait["wait"]["p50_us"] - wait["no_wait"]["p50_us"])
    assert wait["throughput_ratio"] == pytest.approx(wait["wait"]["calls_per_s"] / wait["no_wait"]["calls_per_s"])
    assert wait["ceiling_ratio"] == pytest.approx(wait["wait"]["ceiling_calls_per_s"]
                                                   / wait["no_wait"]["ceiling_calls_per_s"])
    assert any("part 4 measures what it costs" in a for a in fig["assumptions"])

    text = report(fig)
    assert "| shard | pools | script calls | share of calls |" in text
    assert ("target (within 15% across 3 shards) holds" in text) == balance["holds"]
    assert text.count("\n| 12 |") == 1 and "Assumptions:" in text
    assert "### 4. What WAIT costs" in text and "| figure | no WAIT | WAIT 1 replica | WAIT adds |" in text
    assert "0 fell short of 1 replica within 1000 ms" in text and "What it means: WAIT buys durability" in text
    # Without part 4 (--skip-wait), the report has none of it.
    assert "### 4." not in report(fig | {"wait": None})


def test_shards_help_and_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "kvservice", "shards", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "--pools" in out.stdout and "--single-seconds" in out.stdout
    assert "--wait-seconds" in out.stdout and "--skip-wait" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvservice", "shards", "--pool-blocks", "2048"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "too few" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvservice", "shards", "--wait-seconds", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "--wait-seconds must be > 0" in out.stderr
