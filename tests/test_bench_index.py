"""``kvservice bench-index`` on a private Redis, small: it ingests what it publishes over ZMQ
and finds every looked-up prompt's prefix (the figures for a million blocks are in
docs/integrations.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def test_bench_index_ingests_and_looks_up():
    out = subprocess.run([sys.executable, "-m", "kvservice", "bench-index", "--blocks", "20000", "--lookups", "20",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    fig = json.loads(out.stdout)
    assert fig["blocks"] == 20000 - 20000 % (4 * 16) and fig["events"] * 16 == fig["blocks"]
    assert fig["events_per_s"] > 0 and 0 < fig["lookup_p50_us"] <= fig["lookup_p99_us"] and fig["lookups"] == 20


def test_bench_index_refuses_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "kvservice", "bench-index", "--blocks", "100"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--blocks is too few" in out.stderr
