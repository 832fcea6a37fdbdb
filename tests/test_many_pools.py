"""``kvservice many-pools`` runs end to end on a private Redis with real allocator processes
and reports real figures: ListPools and the audit at three sizes (every pool listed, every
audit clean), an idle replica's CPU, the workload's operations and the script calls Redis
timed. No assertion on speed: the measured numbers live in docs/operations.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.tools.manypools import report, verdicts

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(180), pytest.mark.e2e]


def test_many_pools_measures_listing_the_audit_an_idle_replica_and_the_scripts():
    out = subprocess.run([sys.executable, "-m", "kvservice", "many-pools", "--pools", "40", "--idle-seconds", "1",
                          "--load-seconds", "1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    fig = json.loads(out.stdout)
    assert [row["pools"] for row in fig["sizes"]] == [10, 20, 40]
    for row in fig["sizes"]:
        assert row["list_pools_s"] > 0 and row["audit_s"] > 0 and row["audit_problems"] == 0
    assert 0 <= fig["idle_cpu"] < 1
    assert fig["load_ops"] > 0 and fig["scripts"]["calls"] > fig["load_ops"] / 2
    assert set(fig["verdicts"]) == {"idle_cpu", "scripts_within_bound", "list_pools_linear", "audit_linear",
                                    "audit_clean"}
    assert fig["verdicts"] == verdicts(fig) and fig["verdicts"]["audit_clean"]
    assert "[many-pools] an idle replica over 40 pools" in out.stderr
    text = report(fig)
    assert "| 40 | " in text and "An idle replica over 40 pools" in text


def test_many_pools_refuses_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "kvservice", "many-pools", "--pools", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--pools must be at least 4" in out.stderr
