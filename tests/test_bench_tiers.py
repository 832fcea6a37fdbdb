"""``kvservice bench-tiers`` runs a multi-turn chat workload over real SmolLM2 workers with
small device pools, with the lower tiers off and on, and reports real figures. No
assertion on speed: the measured numbers live in docs/benchmark.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.tools.bench_tiers import report

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(400), pytest.mark.e2e]


def test_bench_tiers_prints_one_run_per_configuration(smollm2_cache):
    # Short system prompts and answers (8 tokens), pools of 24 blocks: between two turns of a
    # chat the seven other chats' turns go through the pools, so that its blocks were evicted
    # (and copied down).
    out = subprocess.run([sys.executable, "-m", "kvservice", "bench-tiers", "--conversations", "8", "--turns", "2",
                          "--systems", "2", "--system-tokens", "40,60", "--max-tokens", "8", "--num-blocks", "24",
                          "--concurrency", "2", "--configs", "off,host", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=380)
    assert out.returncode == 0, out.stderr[-3000:]
    fig = json.loads(out.stdout)
    off, host = fig["runs"]
    keys = {"tiers", "prompt_tokens", "recomputed_prompt_tokens", "ttft_p50_ms", "ttft_p99_ms", "loaded_blocks",
            "load_failures", "offloaded_blocks", "filled_blocks", "working_set_blocks", "device_blocks",
            "floor_prompt_tokens"}
    assert keys <= set(off) and (off["tiers"], host["tiers"]) == ("off", "host")
    assert off["prompt_tokens"] == host["prompt_tokens"] > 0           # (the same workload)
    assert off["loaded_blocks"] == off["offloaded_blocks"] == 0
    assert host["loaded_blocks"] > 0 and host["load_failures"] == 0 and host["offloaded_blocks"] > 0
    assert host["recomputed_prompt_tokens"] < off["recomputed_prompt_tokens"]
    # (the floor: what one unbounded cache would compute; at least each chat's first message)
    assert off["floor_prompt_tokens"] == host["floor_prompt_tokens"]
    assert 8 * 15 < host["floor_prompt_tokens"] <= host["recomputed_prompt_tokens"]
    assert host["working_set_blocks"] > host["device_blocks"]
    assert 0 < off["ttft_p50_ms"] <= off["ttft_p99_ms"]
    assert "host+disk" not in report(fig) and "host " in report(fig)


def test_bench_tiers_refuses_bad_arguments():
    for args in (["--configs", "off,nvme"], ["--turns", "0"]):
        out = subprocess.run([sys.executable, "-m", "kvservice", "bench-tiers", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
