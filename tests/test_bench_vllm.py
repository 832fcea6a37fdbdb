"""``kvservice bench-vllm`` refuses bad arguments before it starts anything (its figures come
from real vLLM instances: tests/test_vllm.py runs it, ``make test-vllm``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args, message", [
    (["--samples", "0"], "must be positive"),
    (["--prefix-tokens", "4000"], "must fit vLLM's 4096-token context"),
    (["--vllm-python", "/nonexistent/python"], "/nonexistent/python does not exist (make vllm builds it)"),
])
def test_bench_vllm_refuses_bad_arguments(args, message):
    out = subprocess.run([sys.executable, "-m", "kvservice", "bench-vllm", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
