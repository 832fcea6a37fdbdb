"""``kvservice bench-transfer`` moves blocks between two real SmolLM2 workers and streams
the same bytes over plain gRPC, and reports real figures. No assertion on speed: the
measured numbers live in docs/benchmark.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.tools.bench_transfer import report

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(300), pytest.mark.e2e]


def test_bench_transfer_prints_the_rates_of_one_run_shared_memory_and_stream(smollm2_cache):
    out = subprocess.run([sys.executable, "-m", "kvservice", "bench-transfer", "--batch-mib", "2", "--rounds", "2",
                          "--num-blocks", "8", "--chunk-kib", "512", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    fig = json.loads(out.stdout)
    assert fig["blocks_per_batch"] == 2 and fig["bytes_per_block"] == 737_280      # (SmolLM2's blocks of 16)
    assert fig["bytes_moved"] == 2 * 2 * 737_280 and fig["chunk_bytes"] == 512 << 10
    for key in ("gbps", "grpc_stream_gbps", "memcpy_gbps", "stream_gbps", "stream_grpc_stream_gbps"):
        assert fig[key] > 0, key
    assert fig["ratio"] == pytest.approx(fig["gbps"] / fig["grpc_stream_gbps"], abs=0.01)
    assert fig["stream_ratio"] == pytest.approx(fig["stream_gbps"] / fig["stream_grpc_stream_gbps"], abs=0.01)
    text = report(fig)
    assert "blocks moved" in text and "raw gRPC stream" in text and "in the stream" in text
    # (the bench itself fails unless the first stack's fetches went through shared memory
    # and the second's did not: its stderr says which ran)
    assert "through a staging file in shared memory" in out.stderr and "the blocks in the stream" in out.stderr


def test_bench_transfer_refuses_bad_arguments():
    for args in (["--chunk-kib", "8"], ["--rounds", "0"]):
        out = subprocess.run([sys.executable, "-m", "kvservice", "bench-transfer", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr


def test_bench_transfer_says_when_a_batch_does_not_fit_the_pools(smollm2_cache):
    out = subprocess.run([sys.executable, "-m", "kvservice", "bench-transfer", "--batch-mib", "64", "--num-blocks",
                          "8"], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert out.returncode == 1 and "raise --num-blocks" in out.stderr, out.stderr[-2000:]
