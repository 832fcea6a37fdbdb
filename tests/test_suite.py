"""The suite's own scheduling (tests/scheduling.py) under the flags ``make test`` passes
pytest-xdist, on a small tree in two processes: the tests that share a module's fixture run
in one process that sets it up once, the others spread over both, and the tests marked
``e2e`` start first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

TREE = {
    "pytest.ini": "[pytest]\nmarkers =\n    e2e: starts real processes\n",
    "conftest.py": 'pytest_plugins = ["scheduling"]\n',
    "test_tree.py": '''
import os
import time

import pytest


def note(what):
    with open(os.environ["SUITE_LOG"], "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {what}\\n")


@pytest.fixture(scope="module")
def servers():
    note("setup")
    yield


@pytest.mark.parametrize("arch", range(4))
def test_shared(servers, arch):
    note(f"shared {arch}")
    time.sleep(0.1)


@pytest.mark.parametrize("k", range(8))
def test_alone(k):
    note(f"alone {k}")
    time.sleep(0.3)


@pytest.mark.e2e
def test_process():
    note("e2e")
''',
}


def _make_flags() -> list[str]:
    """The xdist flags of the Makefile's ``test`` target, with two processes."""
    line = next(x for x in (TESTS.parent / "Makefile").read_text().splitlines() if x.startswith("XDIST :="))
    return line.split(":=", 1)[1].replace("$(PYTEST_WORKERS)", "2").split()


def test_make_test_runs_a_module_s_shared_tests_in_one_process_and_spreads_the_rest(tmp_path):
    for name, text in TREE.items():
        (tmp_path / name).write_text(text)
    log = tmp_path / "log.txt"
    env = {**os.environ, "SUITE_LOG": str(log), "PYTHONPATH": str(TESTS)}
    run = subprocess.run([sys.executable, "-m", "pytest", *_make_flags(), "-p", "no:randomly", "-p", "no:cacheprovider",
                          "-q", "test_tree.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"\b13 passed\b", run.stdout), run.stdout
    lines = [x.split(" ", 1) for x in log.read_text().splitlines()]
    setups = [w for w, what in lines if what == "setup"]
    assert len(setups) == 1, f"the module fixture was set up by {setups}: its group was split"
    assert {w for w, what in lines if what.startswith("shared")} == set(setups)
    assert {w for w, what in lines if what.startswith("alone")} == {"gw0", "gw1"}
    first = {}
    for w, what in lines:
        first.setdefault(w, what)
    assert "e2e" in first.values(), first
