"""End to end: the engine over real processes (an embedded Redis, or a local Redis
Cluster; an allocator, two model workers), checked against the same model run by Hugging
Face in this process.

After every test the allocator's audit is clean and every block is free again.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
import torch
from worker_helpers import transformers_twin

from kvservice.client import Client
from kvservice.engine import Engine, Request
from kvservice.tools.launcher import Stack
from worker.model import build_model

MODEL, SEED, BS = "tiny-llama", 0, 16
#: float32 logits of the paged step against Hugging Face's own forward pass.
LOGITS_ATOL = 1e-3

pytestmark = [pytest.mark.timeout(240), pytest.mark.e2e]


@pytest.fixture(scope="module", params=["redis", "cluster"])
def stack(request):
    """Two workers with 128 blocks each, over one Redis, then over a local Redis Cluster of
    3 primaries (+ a replica each)."""
    with Stack(2, model=MODEL, model_seed=SEED, block_size=BS, num_blocks=128,
               redis_cluster=3 if request.param == "cluster" else 0) as s:
        yield s


@pytest.fixture(scope="module")
def small_stack():
    """One worker with 10 blocks (160 tokens): too small for the workload at once."""
    with Stack(1, model=MODEL, model_seed=SEED, block_size=BS, num_blocks=10) as s:
        yield s


@pytest.fixture(scope="module")
def model():
    m = transformers_twin(build_model(MODEL, SEED))
    m.generation_config.eos_token_id = None   # generate exactly max_new_tokens
    m.generation_config.pad_token_id = 0
    return m


def _check_clean(stack: Stack) -> None:
    # (the stack's admin: it may audit, and grant a lease for any tenant it names)
    with Client(stack.target, tenant="audit", keepalive=False, credentials=stack.credentials("admin")) as c:
        audit = c.audit()
        assert audit.ok, list(audit.problems)
        used = {p.pool_id: c.pool_stats(p.pool_id).num_used_blocks for p in c.pools()}
        assert all(u == 0 for u in used.values()), used


@pytest.fixture(autouse=True)
def clean_after(request):
    yield
    for name in ("stack", "small_stack"):
        if name in request.fixturenames:
            _check_clean(request.getfixturevalue(name))


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(512) for _ in range(length)]


def _hf_greedy(model, prompt: list[int], k: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=k)
    return out[0, len(prompt):].tolist()


def test_greedy_generation_matches_hf_generate_token_for_token_and_logits(stack, model):
    rng = random.Random(1)
    lengths = [1, 5, 16, 17, 33, 47, 64, 90]          # up to six blocks
    k = 8
    requests = [Request(_prompt(rng, n), max_new_tokens=k, request_id=f"g{n}") for n in lengths]
    with Engine(stack.target, credentials=stack.credentials(), return_logits=True) as engine:
        report = engine.run(requests)
    assert report.requests == len(lengths) and report.tokens == k * len(lengths)
    assert report.steps <= k + 3                       # run together, not one after another
    for req, done in zip(requests, report.completions):
        (tokens,) = done.outputs
        assert tokens == _hf_greedy(model, req.prompt, k), req.request_id
        with torch.no_grad():
            ref = model(torch.tensor([req.prompt + tokens[:-1]])).logits[0, len(req.prompt) - 1:]
        got = torch.tensor([list(row) for row in done.logits[0]])
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=LOGITS_ATOL, rtol=0), (got - ref).abs().max()


@pytest.mark.parametrize("prompt_len", [37, 32])   # a partial last block, and full blocks only
def test_parallel_sampling_children_match_independent_runs_and_share_blocks(stack, prompt_len):
    rng = random.Random(2)
    prompt, k, n = _prompt(rng, prompt_len), 20, 4
    with Engine(stack.target, credentials=stack.credentials()) as engine:
        forked = engine.run([Request(prompt, max_new_tokens=k, n=n, temperature=0.9, seed=11)])
        alone = engine.run([Request(prompt, max_new_tokens=k, temperature=0.9, seed=11 + i) for i in range(n)])
    outputs = forked.completions[0].outputs
    assert outputs == [c.outputs[0] for c in alone.completions]
    assert len({tuple(o) for o in outputs}) == n       # the seeds differ, so do the samples
    # Minimum: the prompt's blocks, one copy-on-write copy of its partial last block per
    # child, and each branch's new blocks after the prompt.
    prompt_blocks, final_blocks = math.ceil(len(prompt) / BS), math.ceil((len(prompt) + k - 1) / BS)
    copies = n - 1 if len(prompt) % BS else 0
    expected = prompt_blocks + copies + n * (final_blocks - prompt_blocks)
    assert forked.cow_copies == copies
    assert forked.peak_blocks == expected == {37: 10, 32: 10}[prompt_len]
    unshared = n * final_blocks                       # four independent prompts
    assert forked.peak_unshared_blocks == unshared
    assert forked.sharing_saving == pytest.approx(1 - expected / unshared) and forked.sharing_saving > 0


def test_second_run_hits_the_prefix_cache_and_skips_those_tokens(stack, model):
    rng = random.Random(3)
    system = _prompt(rng, 70)                           # four full blocks and a bit
    requests = [Request(system + _prompt(rng, rng.randrange(3, 30)), max_new_tokens=6) for _ in range(5)]
    with Engine(stack.target, credentials=stack.credentials()) as engine:
        first = engine.run(requests)
        second = engine.run(requests)
    total = sum(len(r.prompt) for r in requests)
    assert first.prefill_tokens == total - first.prefix_hit_tokens
    assert second.prefix_hit_tokens >= 5 * 64           # every request hits at least the system blocks
    assert second.prefill_tokens == total - second.prefix_hit_tokens < first.prefill_tokens
    assert all(c.num_cached_tokens >= 64 for c in second.completions)
    got = [c.outputs[0] for c in second.completions]
    assert got == [c.outputs[0] for c in first.completions]
    assert got == [_hf_greedy(model, r.prompt, 6) for r in requests]


def test_a_small_pool_completes_everything_by_waiting_and_preempting(stack, small_stack):
    rng = random.Random(4)
    requests = [Request(_prompt(rng, rng.randrange(20, 40)), max_new_tokens=40, request_id=f"p{i}")
                for i in range(5)]
    requests.append(Request(_prompt(rng, 30), max_new_tokens=30, n=2, temperature=0.7, seed=5, request_id="s"))
    with Engine(stack.target, credentials=stack.credentials()) as engine:
        roomy = engine.run(requests)
    with Engine(small_stack.target, credentials=small_stack.credentials()) as engine:
        tight = engine.run(requests)
        too_big = engine.run([Request(_prompt(rng, 200), max_new_tokens=4, request_id="huge")])
    assert roomy.preemptions == 0 and tight.failed == 0
    assert tight.preemptions >= 1 and tight.peak_blocks <= 10
    assert [c.outputs for c in tight.completions] == [c.outputs for c in roomy.completions]
    (c,) = too_big.completions
    assert too_big.failed == 1 and c.outputs == [[]] and "largest pool has 10" in c.error


def test_local_mode_decodes_without_allocator_calls_and_matches_the_step_path(stack):
    rng = random.Random(5)
    requests = [Request(_prompt(rng, n), max_new_tokens=40, request_id=f"d{n}") for n in (5, 20)]
    requests.append(Request(_prompt(rng, 37), max_new_tokens=40, n=3, temperature=0.8, seed=9, request_id="f"))
    runs = {}
    for local in (True, False):
        calls: list[int] = []     # the client's RPCs on the engine's thread, after each step
        engine = Engine(stack.target, credentials=stack.credentials(), local=local, progress=lambda p: calls.append(engine.client.rpc_count))
        with engine:
            report = engine.run(requests)
        # Every create and fork is done by step 3; then the samples only decode, crossing
        # two block boundaries each (the Step path calls the allocator for them).
        runs[local] = report, calls[-1] - calls[3]
    (local, local_calls), (remote, remote_calls) = runs[True], runs[False]
    assert [c.outputs for c in local.completions] == [c.outputs for c in remote.completions]
    assert (local.cow_copies, local.peak_blocks, local.tokens) == (remote.cow_copies, remote.peak_blocks, remote.tokens)
    assert local.cow_copies == 2 and local.preemptions == remote.preemptions == 0
    assert remote_calls >= 4
    assert local_calls <= 1      # at most a reserve refill that the background one had not made yet


def test_demo_json_prints_the_seven_figures():
    """With tiny-llama (no tokenizer, no end of sequence) every sample takes its
    max_new_tokens."""
    out = subprocess.run([sys.executable, "-m", "kvservice", "demo", "--json", "--quiet", "--model", "tiny-llama",
                          "--requests", "8", "--max-new-tokens", "8"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    keys = {"requests", "tokens", "peak_blocks", "kv_utilization", "prefix_hit_tokens", "cow_copies",
            "sharing_saving"}
    assert keys <= set(report)
    assert report["requests"] == 8
    assert report["tokens"] == 8 * (6 * 1 + 2 * 4)       # requests 3 and 7 take four samples
    assert report["peak_blocks"] > 0 and report["prefix_hit_tokens"] > 0 and report["cow_copies"] > 0
    assert 0 < report["kv_utilization"] <= 1 and 0 < report["sharing_saving"] < 1


@pytest.mark.parametrize("stack", ["redis"], indirect=True)   # (one Redis: its keys rolled back in one MULTI)
def test_requests_whose_sequences_are_lost_in_a_rollback_are_recomputed_to_the_same_outputs(stack):
    """Redis loses the writes of a few steps (its keys put back as they were, in one
    transaction): the SDK resyncs, the sequences it cannot keep are reported lost, and the
    engine recomputes their requests as after a preemption; the outputs do not change."""
    import redis as redis_py
    from test_resync import dump, restore

    rng = random.Random(6)
    # 40 steps of 5 samples between the dump and the rollback: ~12 blocks grown, in two
    # pools whose reserves hold 4 each, so some grown blocks were granted after the dump.
    requests = [Request(_prompt(rng, n), max_new_tokens=64, request_id=f"r{n}") for n in (9, 21, 30)]
    requests.append(Request(_prompt(rng, 17), max_new_tokens=64, n=2, temperature=0.9, seed=3, request_id="s"))
    with Engine(stack.target, credentials=stack.credentials()) as engine:
        reference = engine.run(requests)
    r = redis_py.Redis.from_url(stack.redis.admin_url)   # (DUMP and RESTORE: an admin's)
    saved: dict = {}

    def roll_back(p) -> None:
        if p.step == 4:
            engine.client.flush()
            saved.update(dump(r))
        elif p.step == 44:
            engine.client.flush()          # acknowledged: then lost
            restore(r, saved)

    engine = Engine(stack.target, credentials=stack.credentials(), progress=roll_back)
    with engine:
        report = engine.run(requests)
        assert engine.client.resync_count >= 1
    r.close()
    assert reference.preemptions == 0
    assert report.failed == 0 and report.preemptions >= 1      # the lost ones, recomputed
    assert [c.outputs for c in report.completions] == [c.outputs for c in reference.completions]


def test_a_request_past_8192_tokens_runs_on_the_long_preset_and_matches_hf_logits():
    """A prompt of 9,000 tokens (563 blocks of 16: a create larger than one allocator call,
    staged in bounded calls) plus 8 new tokens, on ``tiny-llama-long`` (131,072 positions):
    the engine's logits at every step are Hugging Face's forward pass over the same tokens,
    and its greedy tokens their argmax."""
    rng = random.Random(9)
    prompt = _prompt(rng, 9000)
    k = 8
    with Stack(1, model="tiny-llama-long", model_seed=SEED, block_size=BS, num_blocks=700) as s:
        with Engine(s.target, credentials=s.credentials(), return_logits=True) as engine:
            report = engine.run([Request(prompt, max_new_tokens=k, request_id="long")])
        _check_clean(s)
    (tokens,) = report.completions[0].outputs
    assert len(prompt) + len(tokens) > 8192 and len(tokens) == k
    got = torch.tensor([list(row) for row in report.completions[0].logits[0]])
    m = transformers_twin(build_model("tiny-llama-long", SEED))
    with torch.no_grad():
        ref = m(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=LOGITS_ATOL, rtol=0), (got - ref).abs().max()
    assert tokens == ref.argmax(-1).tolist()


@pytest.mark.parametrize("cut", [False, True], ids=["restart", "last-second-lost"])
def test_requests_survive_a_redis_restart_and_one_that_forgets_its_last_second(cut):
    """The stack's Redis (AOF on) SIGKILLed mid-run and started again from its AOF, whole or
    cut back by its last second (an OS crash under appendfsync everysec): the pools begin a
    new generation, the workers refuse the engine's steps of the old one until its client
    has resynchronised, the sequences the pool cannot prove are recomputed as after a
    preemption, and the outputs do not change."""
    import os
    import time

    rng = random.Random(7)
    requests = [Request(_prompt(rng, n), max_new_tokens=48, request_id=f"r{n}") for n in (9, 21, 30, 40)]
    requests.append(Request(_prompt(rng, 17), max_new_tokens=48, n=2, temperature=0.9, seed=3, request_id="s"))
    with Stack(2, model=MODEL, model_seed=SEED, block_size=BS, num_blocks=64, redis_fsync="everysec") as stack:
        with Engine(stack.target, credentials=stack.credentials()) as engine:
            reference = engine.run(requests)
        aof = os.path.join(stack.redis.data_dir, "appendonly.aof")
        mark: dict = {}

        def crash(p) -> None:
            if p.step == 6:
                engine.client.flush()
                time.sleep(0.05)            # (written out: the everysec buffer is flushed at once here)
                mark["size"] = os.path.getsize(aof)
            elif p.step == 30:
                engine.client.flush()
                stack.redis.kill()
                mark["cut"] = os.path.getsize(aof) - mark["size"]
                if cut:
                    with open(aof, "r+b") as f:
                        f.truncate(mark["size"])
                stack.redis.start()

        engine = Engine(stack.target, credentials=stack.credentials(), progress=crash)
        with engine:
            report = engine.run(requests)
            assert engine.client.resync_count >= 1
        _check_clean(stack)
    assert report.failed == 0
    # (what the cut loses is 24 steps of writes; the sequences a resync cannot keep, if
    # any, are recomputed as after a preemption)
    assert mark["cut"] > 0
    assert [c.outputs for c in report.completions] == [c.outputs for c in reference.completions]


def test_requests_survive_a_worker_killed_mid_run_and_its_restart():
    """A worker SIGKILLed mid-run: the engine's step to it fails, its requests are
    recomputed from their tokens so far on the other worker (placement puts the silent
    pool last), the other worker's requests go on, and every output equals a run without
    the kill. The worker started again registers a new epoch; a step that still names the
    old one is refused (EPOCH_CHANGED) and recomputed too; then both workers serve."""
    import time

    rng = random.Random(11)
    requests = [Request(_prompt(rng, n), max_new_tokens=40, request_id=f"r{i}")
                for i, n in enumerate((9, 21, 30, 40, 12, 25))]
    with Stack(2, model=MODEL, model_seed=SEED, block_size=BS, num_blocks=64,
               allocator_args=("--placement-silence", "2")) as stack:
        with Engine(stack.target, credentials=stack.credentials()) as engine:
            reference = engine.run(requests)
            assert {s.pool for s in engine._live.values()} == set()   # (all freed)
        victim = stack.workers[1]

        def kill(p) -> None:
            if p.step == 5:
                victim.kill()

        with Engine(stack.target, credentials=stack.credentials(), progress=kill) as engine:
            report = engine.run(requests)
            assert report.failed == 0 and report.worker_failures >= 1
            assert [c.outputs for c in report.completions] == [c.outputs for c in reference.completions]
            _check_clean(stack)
            victim.start()
            time.sleep(2.5)     # (its first heartbeats: placement no longer puts it last)
            again = engine.run(requests)
        _check_clean(stack)
    assert again.failed == 0
    assert [c.outputs for c in again.completions] == [c.outputs for c in reference.completions]
