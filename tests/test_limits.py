"""``kvservice limits``: the worst allowed call of each script, timed by Redis itself."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from kvservice.allocator.config import Settings
from kvservice.tools.limits import TARGET_MS, measure, table


def test_every_script_s_worst_call_is_timed_and_grows_with_its_limit():
    small = Settings(max_blocks_per_call=64, max_prompt_tokens=1024, max_items_per_call=16, max_forks_per_sequence=4,
                     max_forks_per_call=16, max_fork_refs_per_call=64, max_sequence_blocks=64, max_release_per_call=64,
                     max_journal_entries=64)
    large = small.replace(max_blocks_per_call=2048, max_prompt_tokens=32768, max_items_per_call=256,
                          max_forks_per_sequence=64, max_forks_per_call=512, max_fork_refs_per_call=16384,
                          max_sequence_blocks=2048, max_release_per_call=4096, max_journal_entries=512)
    few, many = (asyncio.run(measure(s, progress=lambda m: None)) for s in (small, large))
    assert [r.script for r in few] == ["step"] * 5 + ["sync"] * 4 + ["probe", "reap", "audit", "audit"]
    for r in few + many:
        assert r.ms > 0, f"{r.script}: {r.call} was not seen in the SLOWLOG"
    # A larger limit allows a longer call: the fork row (16 children x 4 blocks vs 512 x 32) most of all.
    assert many[3].ms > 10 * few[3].ms
    text = table(many)
    assert "worst allowed call" in text and f"OVER {TARGET_MS}" in text


def test_limits_takes_the_allocator_s_flags():
    out = subprocess.run([sys.executable, "-m", "kvservice", "limits", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--max-blocks-per-call" in out.stdout
