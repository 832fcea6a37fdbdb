"""Fetches between workers (DESIGN §13) through the engine over two workers: each
conversation's turns alternate between the workers; every answer equals transformers'
(tokens, and logits within 1e-3), and from the second turn on a turn computes only what
the last one did not hold (its new question, the last answer's partial block), the rest
fetched from the other worker; without fetches the second turn computes its whole prompt.
The source worker killed mid-run: its blocks are recomputed, nothing wrong is served, and
no pin outlives its deadline. Prefill and decode on two SmolLM2 workers; the tests of the
fetches' mechanisms on a seeded preset (``chats.TINY``: the same paths at a fraction of
SmolLM2's compute)."""

from __future__ import annotations

import pytest

from chats import NAME, STEPS, TINY, assert_greedy, chat_prompt, encode, metric, turns
from kvservice.engine import Engine
from kvservice.tools.launcher import Stack
from worker import weights

pytestmark = pytest.mark.e2e

#: Distinct system prompts of about 530 tokens each (33 blocks): each turn's new tokens
#: are a small part of its prompt.
DOCUMENTS = [" ".join(f"Rule {k} of branch {b}: a member may borrow {k % 7 + 1} items from shelf {k * 3 + b}, "
                      f"returned within {k % 4 + 1} weeks, or pay {k % 5 + 1} coins." for k in range(16))
             for b in range(6)]
BLOCK = 16


# (session scope: loaded once by each test process that needs it, a few seconds, so that
# the tests that need nothing else of the module run in any process: tests/scheduling.py)
@pytest.fixture(scope="session")
def reference(smollm2_cache):
    return weights.load(NAME)


@pytest.fixture(scope="session")
def tiny():
    return TINY.reference()


@pytest.fixture(scope="module")
def stack():
    with Stack(2, model=TINY.name, block_size=BLOCK, num_blocks=512) as s:
        yield s


def _alternate(stack):
    pools = [w.pool_id for w in stack.workers]
    return lambda conversation, turn: pools[(conversation + turn) % 2]


def _computed(report) -> float:
    prompt = sum(c.num_prompt_tokens for c in report.completions)
    return report.prefill_tokens / prompt


def _not_held(last, report) -> int:
    """The prompt tokens of ``report``'s turn that the last turn did not leave in full
    blocks: a turn's prompt is the last one's, its answer and a new question, and the
    last turn wrote the KV of its prompt and of every answer token but the last."""
    return sum(c.num_prompt_tokens - BLOCK * ((p.num_prompt_tokens + STEPS - 1) // BLOCK)
               for p, c in zip(last.completions, report.completions))


def test_turns_alternating_between_workers_fetch_their_history_and_equal_transformers(stack, tiny):
    reference = tiny
    with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as engine:
        reports = turns(engine, reference, conversations=2, turns=4, pool=_alternate(stack), systems=DOCUMENTS[:2])
    shares = [_computed(r) for r in reports]
    fetched = sum(r.fetched_blocks for r in reports)
    print(f"computed share of each turn's prompt tokens: {[f'{x:.3f}' for x in shares]}; "
          f"{fetched} blocks fetched, {sum(r.fetch_failures for r in reports)} failed")
    assert shares[0] == 1.0
    # from the second turn on, only what the last turn did not hold is computed
    assert [r.prefill_tokens for r in reports[1:]] == [_not_held(a, b) for a, b in zip(reports, reports[1:])]
    assert all(x <= 0.10 for x in shares[1:]), shares
    assert fetched > 0 and sum(r.fetch_failures for r in reports) == 0
    moved_in = sum(metric(w.metrics_url, "kvservice_worker_transfer_blocks_total", direction="in")
                   for w in stack.workers)
    assert moved_in == fetched
    assert stack.audit().ok


def test_without_fetches_the_second_turn_computes_its_whole_prompt(stack, tiny):
    reference = tiny
    with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True, fetch=False) as engine:
        reports = turns(engine, reference, conversations=2, turns=2, pool=_alternate(stack), systems=DOCUMENTS[2:])
    shares = [_computed(r) for r in reports]
    print(f"without fetches, computed share of each turn's prompt tokens: {[f'{x:.3f}' for x in shares]}")
    assert shares == [1.0, 1.0] and sum(r.fetched_blocks for r in reports) == 0


def test_blocks_not_written_yet_are_not_fetched(stack, tiny):
    """Blocks get their hashes at create, before a forward writes them. Three requests on a
    new system prompt: the first and second (which extends the first's prompt) on worker 0
    in one step; the second reads the first's blocks, so its prompt waits a step, and its
    own blocks stay unwritten meanwhile. The third (the second's prompt and more, on worker
    1) is created in that next step, before that forward: the blocks that live sequences
    hold in worker 0 are not offered for a fetch (scripts/pin.lua), so worker 1 computes
    the prompt, and every answer equals transformers'."""
    reference = tiny
    from kvservice.engine import Request

    pools = [w.pool_id for w in stack.workers]
    with Engine(stack.target, credentials=stack.credentials("engine")) as engine:
        tok = engine.tokenizer
    first = chat_prompt(tok, DOCUMENTS[4], "Which shelf holds rule 3?")
    second = first + encode(tok, " The rules of branch 4 apply to every member, old and new alike.")
    third = second + encode(tok, " How many coins for rule 9?" * 3)
    # (the first two prompts fill a step's prompt budget: the third waits for the next step)
    with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True,
                max_prefill_tokens=len(first) + len(second)) as engine:
        report = engine.run([Request(p, max_new_tokens=STEPS, ignore_eos=True, request_id=f"r{i}", pool=pool)
                             for i, (p, pool) in enumerate([(first, pools[0]), (second, pools[0]),
                                                            (third, pools[1])])])
    assert report.failed == 0
    for p, c in zip([first, second, third], report.completions):
        assert_greedy(reference, p, c)
    assert report.fetched_blocks == 0 and report.prefill_tokens >= len(first) + len(third)
    assert stack.audit().ok


def test_a_prompt_its_worker_never_wrote_leaves_no_hash(stack, tiny):
    """A create's blocks get their hashes once the forward has written them. Worker 0
    stopped (SIGSTOP) as a prompt is created there: its step fails past the deadline, the
    request is computed on worker 1 instead, and the blocks worker 0 never wrote were never
    announced: no create hits them there and none fetches them (worker 0, running again,
    would serve whatever they hold), with nothing to forget."""
    reference = tiny
    import os
    import signal

    from kvservice.client import Client
    from kvservice.engine import Request

    stopped = stack.workers[0]
    with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True, timeout=15.0) as engine:
        prompt = chat_prompt(engine.tokenizer, DOCUMENTS[5], "Which rules cover shelf 12?")
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            report = engine.run([Request(prompt, max_new_tokens=STEPS, ignore_eos=True, pool=stopped.pool_id)])
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
    print(f"worker failures {report.worker_failures}, fetched {report.fetched_blocks}, "
          f"{report.prefill_tokens} prompt tokens computed")
    assert report.failed == 0 and report.worker_failures >= 1 and report.fetched_blocks == 0
    assert_greedy(reference, prompt, report.completions[0])
    with Client(stack.target, credentials=stack.credentials("engine")) as c:
        s = c.create(prompt, pool=stopped.pool_id)
        assert s.num_cached_tokens == 0
        s.free()
    assert metric(stack.allocator.metrics_url, "kvservice_pool_forgotten_blocks_total", pool=stopped.pool_id) == 0
    assert stack.audit().ok


def test_a_source_killed_mid_fetch_is_recomputed_and_leaves_no_pin(tiny):
    """Each conversation's turn 1 on one worker, turn 2 on the other; worker 0 stopped
    (SIGSTOP) as turn 2 starts, so the fetch of worker 1 from it waits on it, and SIGKILLed
    a moment later. The blocks that did not arrive are recomputed (and the turn that was to
    run on worker 0 runs on worker 1): every answer equals transformers'."""
    reference = tiny
    import os
    import signal
    import threading
    import time

    from helpers import sync_redis
    from kvservice.allocator import keys

    with Stack(2, model=TINY.name, block_size=BLOCK, num_blocks=512) as stack, \
            Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as engine:
        source = stack.workers[0]

        def check(turn: int) -> None:
            if turn == 1:
                os.kill(source.proc.pid, signal.SIGSTOP)
                threading.Timer(1.5, source.kill).start()

        started = time.monotonic()
        reports = turns(engine, reference, conversations=2, turns=2, check=check, pool=_alternate(stack),
                        systems=DOCUMENTS[:2])
        took = time.monotonic() - started
        failed = reports[1].fetch_failures
        print(f"turn 2: {failed} fetches failed and were recomputed ({_computed(reports[1]):.3f} of the prompt "
              f"computed); {took:.1f} s in all")
        assert failed > 0 and reports[1].fetched_blocks == 0
        assert 0 < metric(stack.workers[1].metrics_url, "kvservice_worker_transfer_failed_blocks_total") <= failed
        with sync_redis(stack.redis.admin_url) as r:        # (released by the engine once the fetch ran)
            assert r.hgetall(keys.pool_key(source.pool_id, "pins")) == {}
        assert stack.audit(stack.workers[1].pool_id).ok


def test_disaggregated_prefill_and_decode_equal_transformers(reference):
    """A prefill worker and a decode worker: every prompt is computed on the first, its
    sequence then moves to the second (its blocks fetched), which decodes it; the answers
    equal transformers'."""
    with Stack(2, model=NAME, block_size=BLOCK, num_blocks=512, roles=("prefill", "decode")) as stack, \
            Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as engine:
        reports = turns(engine, reference, conversations=2, turns=2, systems=DOCUMENTS[:2])
        moved = [r.migrated_sequences for r in reports]
        print(f"disaggregated: {moved} sequences moved from the prefill to the decode worker, "
              f"{sum(r.fetched_blocks for r in reports)} blocks fetched")
        assert moved == [2, 2] and all(r.fetch_failures == 0 for r in reports)
        # The decode worker computed no prompt: it fed one token per sequence and step.
        fed = [metric(w.metrics_url, "kvservice_worker_forward_tokens_total") for w in stack.workers]
        prompt_tokens = sum(c.num_prompt_tokens for r in reports for c in r.completions)
        assert fed[0] >= sum(r.prefill_tokens for r in reports) and fed[1] <= 2 * 2 * STEPS, (fed, prompt_tokens)
        assert stack.audit().ok
