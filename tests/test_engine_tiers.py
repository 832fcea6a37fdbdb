"""The engine over workers whose device pools are far smaller than the working set, with
lower tiers (DESIGN §12): a multi-turn workload's greedy outputs equal transformers', its
prompts are loaded rather than recomputed; a host-tier block with a flipped byte fails its
load and is recomputed (over SmolLM2); a disk tier outlives its worker. (The engines keep
to each pool's own cache, fetches off: the tiers alone are under test. The tests of the
tiers' mechanisms run a seeded preset, ``chats.TINY``: the same paths at a fraction of
SmolLM2's compute.)"""

from __future__ import annotations

import os
import re

import pytest

from chats import BLOCK_BYTES, NAME, TINY, metric, turns
from helpers import wait_for
from kvservice.engine import Engine
from kvservice.tools.launcher import Stack
from worker import weights

pytestmark = pytest.mark.e2e

# (session scope: loaded once by each test process that needs it, a few seconds, so that
# the tests that need nothing else of the module run in any process: tests/scheduling.py)
@pytest.fixture(scope="session")
def reference(smollm2_cache):
    return weights.load(NAME)


@pytest.fixture(scope="session")
def tiny():
    return TINY.reference()


def test_small_device_pools_with_a_host_tier_equal_transformers_and_compute_fewer_prompt_tokens(tiny):
    reference = tiny
    with Stack(2, model=TINY.name, block_size=16, num_blocks=24,
               worker_args=("--host-tier-gb", TINY.tier_gb(271))) as stack, \
            Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True, fetch=False) as engine:
        reports = turns(engine, reference, conversations=8, turns=4)
        prompt = [sum(c.num_prompt_tokens for c in r.completions) for r in reports]
        # The working set (every conversation's last prompt) is well beyond the device pools.
        assert prompt[-1] / 16 > 1.5 * 2 * 24, prompt
        later = reports[1:]
        loaded = sum(r.loaded_blocks for r in later)
        computed = sum(r.prefill_tokens for r in later)
        print(f"turns 2-3: {sum(prompt[1:])} prompt tokens, {computed} computed, {loaded} blocks loaded; "
              f"offloaded {sum(r.offloaded_blocks for r in reports)}")
        assert loaded > 0 and sum(r.load_failures for r in reports) == 0
        assert computed < 0.5 * sum(prompt[1:])
        moved = sum(metric(w.metrics_url, "kvservice_worker_tier_moved_blocks_total", src="host", dst="device")
                    for w in stack.workers)
        assert moved == loaded
        assert stack.audit().ok


def _flip_a_byte_in_every_entry(worker, entries: int) -> int:
    """Flips one byte in the middle of each of a worker's host-tier entries, in the
    process's memory (/proc/<pid>/mem, as a bit flip in RAM would), at the address its
    log gives. Returns the entries hit."""
    at = re.search(r"a host tier of (\d+) blocks \(\S+ MB at (0x[0-9a-f]+)\)", worker.log())
    assert at and int(at.group(1)) == entries, worker.log()
    base = int(at.group(2), 16)
    with open(f"/proc/{worker.proc.pid}/mem", "r+b", buffering=0) as mem:
        for e in range(entries):
            mem.seek(base + e * BLOCK_BYTES + BLOCK_BYTES // 2)
            byte = mem.read(1)
            mem.seek(base + e * BLOCK_BYTES + BLOCK_BYTES // 2)
            mem.write(bytes([byte[0] ^ 0x40]))
    return entries


def test_a_flipped_byte_in_a_host_tier_block_fails_its_load_which_is_recomputed(reference):
    host_entries = int(0.2e9) // BLOCK_BYTES
    with Stack(1, model=NAME, block_size=16, num_blocks=24, worker_args=("--host-tier-gb", "0.2")) as stack, \
            Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True, fetch=False) as engine:
        worker = stack.workers[0]

        def corrupt(turn: int) -> None:
            if turn == 2:          # (the host tier holds the first turns' evicted blocks by now)
                _flip_a_byte_in_every_entry(worker, host_entries)
        reports = turns(engine, reference, conversations=6, turns=3, check=corrupt)
        failures = reports[2].load_failures
        # (every entry stored before the flip fails; entries stored after it load)
        assert failures > 0 and sum(r.load_failures for r in reports[:2]) == 0
        assert metric(worker.metrics_url, "kvservice_worker_tier_failed_moves_total", src="host",
                       dst="device") == failures
        assert wait_for(lambda: metric(stack.allocator.metrics_url, "kvservice_pool_tier_load_failures_total",
                                        tier="host") == failures)
        assert stack.audit().ok


def test_a_worker_killed_while_offloading_leaves_no_hit_on_an_unconfirmed_entry(tiny, tmp_path):
    """After each step (once armed) both workers are stopped; if the next step's orders
    leave copies pending (the workers cannot run them), both are SIGKILLed with those copies
    unconfirmed and started again (new epochs); otherwise they go on. Every output still
    equals transformers', and no later load fails (a hit on an entry the new process never
    wrote would: "never stored")."""
    import signal
    import threading

    from kvservice.client import Client
    reference = tiny
    args = ("--host-tier-gb", TINY.tier_gb(27), "--disk-tier-dir", str(tmp_path), "--disk-tier-gb", TINY.tier_gb(271))
    killed: list[int] = []
    watchers: list[threading.Thread] = []
    armed = threading.Event()
    with Stack(2, model=TINY.name, block_size=16, num_blocks=24, worker_args=args,
               allocator_args=("--placement-silence", "2")) as stack, \
            Client(stack.target, credentials=stack.credentials("admin")) as admin:

        def pending() -> int:
            return sum(t.num_pending_blocks for w in stack.workers for t in admin.pool_stats(w.pool_id).tiers)

        def watch() -> None:
            # (the next step's create or append orders its copies within milliseconds of
            # the last step's end; a step that orders none is let go after half a second)
            if wait_for(lambda: pending() > 0, timeout=0.5):
                killed.append(pending())
                armed.clear()
                for w in stack.workers:
                    w.kill()
                for w in stack.workers:
                    w.start()
            else:
                for w in stack.workers:
                    os.kill(w.proc.pid, signal.SIGCONT)

        def after_step(progress) -> None:
            if armed.is_set() and not killed:
                for w in stack.workers:
                    os.kill(w.proc.pid, signal.SIGSTOP)
                watchers.append(threading.Thread(target=watch, daemon=True))
                watchers[-1].start()

        with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True, fetch=False,
                    progress=after_step) as engine:
            reports = turns(engine, reference, conversations=8, turns=4,
                             check=lambda turn: armed.set() if turn == 2 else None)
        for t in watchers:            # (the workers it restarted are serving again)
            t.join(timeout=60)
        assert killed and killed[0] > 0, "no worker was killed with copies pending"
        assert sum(r.worker_failures for r in reports) >= 1
        assert sum(r.loaded_blocks for r in reports[3:]) > 0
        assert sum(r.load_failures for r in reports) == 0
        for w in stack.workers:
            assert metric(w.metrics_url, "kvservice_worker_tier_failed_moves_total") == 0
        assert wait_for(lambda: pending() == 0)
        assert stack.audit().ok


def test_disk_tier_entries_survive_a_restart_of_their_worker(tiny, tmp_path):
    from kvservice.client import Client
    reference = tiny
    args = ("--host-tier-gb", TINY.tier_gb(6), "--disk-tier-dir", str(tmp_path), "--disk-tier-gb", TINY.tier_gb(271))
    with Stack(1, model=TINY.name, block_size=16, num_blocks=24, worker_args=args) as stack, \
            Client(stack.target, credentials=stack.credentials("admin")) as admin:
        worker = stack.workers[0]

        def tiers() -> dict:
            return {t.tier: t for t in admin.pool_stats(worker.pool_id).tiers}
        with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True, fetch=False) as engine:
            turns(engine, reference, conversations=16, turns=3)    # (the first turns' blocks go down)
        assert wait_for(lambda: all(t.num_pending_blocks == 0 for t in tiers().values()))
        on_disk = tiers()["disk"].num_used_blocks
        assert on_disk > 0 and tiers()["host"].num_used_blocks > 0
        epoch = admin.pool_stats(worker.pool_id).epoch
        worker.stop()
        worker.start()
        assert admin.pool_stats(worker.pool_id).epoch == epoch + 1
        after = tiers()
        assert after["disk"].num_used_blocks == on_disk and after["host"].num_used_blocks == 0
        with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True, fetch=False) as engine:
            report = turns(engine, reference, conversations=16, turns=1)[0]
        assert report.loaded_blocks > 0 and report.load_failures == 0
        assert metric(worker.metrics_url, "kvservice_worker_tier_moved_blocks_total", src="disk",
                       dst="device") == report.loaded_blocks
        assert tiers()["disk"].hit_tokens == 16 * report.loaded_blocks
        assert stack.audit().ok
