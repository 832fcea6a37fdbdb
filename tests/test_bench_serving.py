"""``kvservice bench-serving`` drives a real local stack (SmolLM2 workers and the HTTP API)
with the official ``openai`` client, streaming, and reports real figures: every request's
tokens, times to first token, the shared system prompt's cached tokens. No assertion on
speed: the measured numbers, beside vLLM's, live in docs/engine.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.tools.bench_serving import report

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(300), pytest.mark.e2e]


def test_bench_serving_streams_concurrent_chats_through_the_http_api():
    out = subprocess.run([sys.executable, "-m", "kvservice", "bench-serving", "--requests", "3", "--max-tokens", "5",
                          "--workers", "1", "--kv-gib", "1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    fig = json.loads(out.stdout)
    assert fig["tokens"] == 3 * 5 and fig["tok_per_s"] > 0 and fig["wall_s"] > 0
    assert 0 < fig["ttft_p50_s"] <= fig["ttft_max_s"] <= fig["wall_s"]
    # (the warm-up request cached the system prompt's full blocks)
    assert fig["prompt_tokens"] > 100 and fig["cached_tokens_p50"] >= 96
    assert 0 < fig["itl_p50_s"] <= fig["itl_max_s"] <= fig["wall_s"]
    assert "vllm_tok_per_s" not in fig and "| kvservice (1 worker, both) |" in report(fig)


def test_bench_serving_refuses_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "kvservice", "bench-serving", "--requests", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must be positive" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvservice", "bench-serving", "--workers", "2", "--roles", "prefill"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--roles needs one of both, prefill, decode per worker (2)" in out.stderr
