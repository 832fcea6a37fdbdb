"""The engine over SmolLM2 workers whose device pools are far smaller than the working
set, with lower tiers (DESIGN §12): a multi-turn workload's greedy outputs equal
transformers', its prompts are loaded rather than recomputed; a host-tier block with a
flipped byte fails its load and is recomputed; a disk tier outlives its worker."""

from __future__ import annotations

import os
import re
import urllib.request

import pytest
import torch

from helpers import wait_for
from kvservice.engine import Engine, Request
from kvservice.engine.text import Message
from kvservice.tools.launcher import Stack
from worker import weights

NAME = "smollm2-135m"
STEPS = 8
ATOL = 1e-3
#: SmolLM2's block of 16 tokens: 2 (K, V) x 30 layers x 3 KV heads x 16 x 64 x 4 bytes.
BLOCK_BYTES = 2 * 30 * 3 * 16 * 64 * 4
SYSTEMS = ["You are a careful assistant for a public library. Answer in plain words, at most two sentences, and "
           "say so when you do not know. Never invent titles, authors or dates; suggest asking a librarian instead.",
           "You are a terse assistant for a bicycle repair shop. Give the one most likely cause and the one next "
           "step. Mention safety first when brakes or wheels are involved, and keep every answer short."]
QUESTIONS = ["What should I read after a long novel about the sea?", "Which tools do I need to fix a flat tyre?",
             "How do I find a book whose title I forgot?", "Why does my chain skip when I pedal hard?",
             "Can I renew a loan twice in a row?", "The brakes squeal in the rain; is that dangerous?",
             "Where are the old newspapers kept?", "How tight should the spokes of a rear wheel be?"]
FOLLOW_UPS = ["Thank you. And if that does not help at all, what would you suggest instead of it?",
              "Could you say that again in simpler words for a child of ten years?"]


@pytest.fixture(scope="module")
def reference(smollm2_cache):
    return weights.load(NAME)


def _metric(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.split()[-1])
    return total


def _turns(engine: Engine, reference, conversations: int, turns: int, check=None) -> list:
    """Runs ``turns`` rounds of ``conversations`` chats (shared system prompts); each turn's
    prompt is the previous one, its answer and a new question. Every answer is checked
    against transformers' greedy ``generate``. Returns the reports."""
    tok = engine.tokenizer
    prompts = [tok.chat_prompt([Message("system", SYSTEMS[i % 2]), Message("user", QUESTIONS[i % len(QUESTIONS)])])
               for i in range(conversations)]
    reports = []
    for t in range(turns):
        if check is not None:
            check(t)
        report = engine.run([Request(p, max_new_tokens=STEPS, ignore_eos=True, request_id=f"c{i}t{t}")
                             for i, p in enumerate(prompts)])
        assert report.failed == 0
        for p, c in zip(prompts, report.completions):
            with torch.inference_mode():
                out = reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                         do_sample=False, max_new_tokens=STEPS, eos_token_id=None, pad_token_id=2,
                                         output_logits=True, return_dict_in_generate=True)
            assert c.outputs[0] == out.sequences[0, len(p):].tolist(), c.request_id
            got = torch.tensor([list(row) for row in c.logits[0]])
            torch.testing.assert_close(got, torch.stack([x[0] for x in out.logits]).float(), atol=ATOL, rtol=0)
        reports.append(report)
        follow = FOLLOW_UPS[t % len(FOLLOW_UPS)]
        prompts = [p + c.outputs[0] + tok.encode(f"\nuser: {follow}\nassistant:")
                   for p, c in zip(prompts, report.completions)]
    return reports


def test_small_device_pools_with_a_host_tier_equal_transformers_and_compute_fewer_prompt_tokens(reference):
    with Stack(2, model=NAME, block_size=16, num_blocks=24, worker_args=("--host-tier-gb", "0.2")) as stack, \
            Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as engine:
        reports = _turns(engine, reference, conversations=8, turns=4)
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
        moved = sum(_metric(w.metrics_url, "kvservice_worker_tier_moved_blocks_total", src="host", dst="device")
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
            Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as engine:
        worker = stack.workers[0]

        def corrupt(turn: int) -> None:
            if turn == 2:          # (the host tier holds the first turns' evicted blocks by now)
                _flip_a_byte_in_every_entry(worker, host_entries)
        reports = _turns(engine, reference, conversations=6, turns=3, check=corrupt)
        failures = reports[2].load_failures
        # (every entry stored before the flip fails; entries stored after it load)
        assert failures > 0 and sum(r.load_failures for r in reports[:2]) == 0
        assert _metric(worker.metrics_url, "kvservice_worker_tier_failed_moves_total", src="host",
                       dst="device") == failures
        assert wait_for(lambda: _metric(stack.allocator.metrics_url, "kvservice_pool_tier_load_failures_total",
                                        tier="host") == failures)
        assert stack.audit().ok


def test_a_worker_killed_while_offloading_leaves_no_hit_on_an_unconfirmed_entry(reference, tmp_path):
    """After each step (once armed) both workers are stopped; if the next step's orders
    leave copies pending (the workers cannot run them), both are SIGKILLed with those copies
    unconfirmed and started again (new epochs); otherwise they go on. Every output still
    equals transformers', and no later load fails (a hit on an entry the new process never
    wrote would: "never stored")."""
    import signal
    import threading

    from kvservice.client import Client
    args = ("--host-tier-gb", "0.02", "--disk-tier-dir", str(tmp_path), "--disk-tier-gb", "0.2")
    killed: list[int] = []
    armed = threading.Event()
    with Stack(2, model=NAME, block_size=16, num_blocks=24, worker_args=args,
               allocator_args=("--placement-silence", "2")) as stack, \
            Client(stack.target, credentials=stack.credentials("admin")) as admin:

        def pending() -> int:
            return sum(t.num_pending_blocks for w in stack.workers for t in admin.pool_stats(w.pool_id).tiers)

        def watch() -> None:
            if wait_for(lambda: pending() > 0, timeout=2):
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
                threading.Thread(target=watch, daemon=True).start()

        with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True,
                    progress=after_step) as engine:
            reports = _turns(engine, reference, conversations=12, turns=4,
                             check=lambda turn: armed.set() if turn == 2 else None)
        assert killed and killed[0] > 0, "no worker was killed with copies pending"
        assert sum(r.worker_failures for r in reports) >= 1
        assert sum(r.loaded_blocks for r in reports[3:]) > 0
        assert sum(r.load_failures for r in reports) == 0
        for w in stack.workers:
            assert _metric(w.metrics_url, "kvservice_worker_tier_failed_moves_total") == 0
        assert wait_for(lambda: pending() == 0)
        assert stack.audit().ok


def test_disk_tier_entries_survive_a_restart_of_their_worker(reference, tmp_path):
    from kvservice.client import Client
    args = ("--host-tier-gb", "0.005", "--disk-tier-dir", str(tmp_path), "--disk-tier-gb", "0.2")
    with Stack(1, model=NAME, block_size=16, num_blocks=24, worker_args=args) as stack, \
            Client(stack.target, credentials=stack.credentials("admin")) as admin:
        worker = stack.workers[0]

        def tiers() -> dict:
            return {t.tier: t for t in admin.pool_stats(worker.pool_id).tiers}
        with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as engine:
            _turns(engine, reference, conversations=16, turns=3)    # (the first turns' blocks go down)
        assert wait_for(lambda: all(t.num_pending_blocks == 0 for t in tiers().values()))
        on_disk = tiers()["disk"].num_used_blocks
        assert on_disk > 0 and tiers()["host"].num_used_blocks > 0
        epoch = admin.pool_stats(worker.pool_id).epoch
        worker.stop()
        worker.start()
        assert admin.pool_stats(worker.pool_id).epoch == epoch + 1
        after = tiers()
        assert after["disk"].num_used_blocks == on_disk and after["host"].num_used_blocks == 0
        with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as engine:
            report = _turns(engine, reference, conversations=16, turns=1)[0]
        assert report.loaded_blocks > 0 and report.load_failures == 0
        assert _metric(worker.metrics_url, "kvservice_worker_tier_moved_blocks_total", src="disk",
                       dst="device") == report.loaded_blocks
        assert tiers()["disk"].hit_tokens == 16 * report.loaded_blocks
        assert stack.audit().ok
