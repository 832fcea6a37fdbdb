"""``kvservice bench`` runs end to end and reports every figure (no assertion on speed:
timed tests flake; the measured numbers live in docs/benchmark.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REQUIRED = ("floor_us", "step_p50_us", "step_p99_us", "alloc_us_per_token",
            "create_cold_2k_us", "create_cached_2k_us", "fork_us", "free_us", "script_rpc_us",
            "script_rpc_p99_us", "decode_free_all_us", "inproc_us_per_token", "inproc_step_p50_us",
            "inproc_step_p99_us", "client_cpu_us_per_token")
ROOT = Path(__file__).resolve().parent.parent


def test_bench_json_has_every_figure():
    proc = subprocess.run(
        [sys.executable, "-m", "kvservice", "bench", "--sequences", "16", "--steps", "40",
         "--repeat", "10", "--json"],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fig = json.loads(proc.stdout)
    for key in REQUIRED:
        assert key in fig, f"missing {key}"
        assert isinstance(fig[key], (int, float)) and fig[key] > 0, f"{key} = {fig[key]!r}"
    # The journaled SDK (the default): the decode steps' changes go through the journal.
    assert 0 <= fig["sync_rpcs_per_step"] == fig["rpcs_per_step"] <= 1
    assert fig["journal_lag_p99_ms"] >= fig["journal_lag_p50_ms"] > 0
    assert 0 < fig["reserved_unused_p99_share"] < 1
    assert fig["floor_us"] >= fig["grpc_rtt_us"] and fig["floor_us"] >= fig["redis_ping_us"]
    assert fig["script_rpc_p99_us"] >= fig["script_rpc_us"]
    assert fig["audit_ok"] is True
    assert 0 <= fig["sync_rpcs_per_step"] <= fig["rpcs_per_step"]
    assert set(fig["targets"]) == {"step_p99_us", "alloc_us_per_token", "sync_rpcs_per_step", "create_cached_2k_us",
                                   "journal_lag_p99_ms", "reserved_unused_p99_share"}
    assert fig["targets"]["alloc_us_per_token"]["limit"] == 1.2 * fig["inproc_us_per_token"]
    assert fig["targets_met"] in (True, False)


def test_bench_remote_measures_the_step_path():
    proc = subprocess.run(
        [sys.executable, "-m", "kvservice", "bench", "--sequences", "16", "--steps", "40", "--repeat", "10",
         "--json", "--remote"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fig = json.loads(proc.stdout)
    # Block-boundary crossings are spread over the steps: some RPC most steps, never more than one.
    assert 0 < fig["rpcs_per_step"] <= 1 and fig["sync_rpcs_per_step"] == fig["rpcs_per_step"]
    assert "journal_lag_p99_ms" not in fig and "journal_lag_p99_ms" not in fig["targets"]
    assert fig["audit_ok"] is True


def test_bench_long_reports_the_long_sequence_figures():
    proc = subprocess.run([sys.executable, "-m", "kvservice", "bench", "--long", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fig = json.loads(proc.stdout)
    for key in ("append_us_per_token_1k", "append_us_per_token_128k", "create_1m_ms", "create_cached_1m_ms",
                "local_append_us_per_token_1k", "local_append_us_per_token_128k", "fork_1m_ms", "free_1m_ms"):
        assert isinstance(fig[key], (int, float)) and fig[key] > 0, f"{key} = {fig.get(key)!r}"
    assert fig["create_cached_1m_hit_tokens"] == (1 << 20) - 16     # (every block but the last)
    assert set(fig["targets"]) == {"append_us_per_token_128k", "local_append_us_per_token_128k"}
    assert fig["targets"]["append_us_per_token_128k"]["limit"] == 1.2 * fig["append_us_per_token_1k"]
    assert fig["audit_ok"] is True


def test_bench_target_needs_redis_url():
    proc = subprocess.run([sys.executable, "-m", "kvservice", "bench", "--target", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "--redis-url" in proc.stderr


def test_percentile_is_the_nearest_rank():
    from kvservice.tools.bench import percentile

    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 50.0 and percentile(xs, 99) == 99.0 and percentile(xs, 100) == 100.0
