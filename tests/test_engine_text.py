"""The engine over two real SmolLM2 workers: its greedy tokens and logits equal
transformers' ``generate`` on the same weights (the oracle), it stops at end-of-sequence
and at stop strings, samples reproducibly with top-p / top-k, and serves online (submit,
stream, cancel: the blocks come back)."""

from __future__ import annotations

import urllib.request

import pytest
from helpers import used_blocks, wait_for
import torch

from chats import greedy
from kvservice.engine import Engine, EngineBusy, Request, RequestError
from kvservice.engine.text import Message, StopMatcher
from kvservice.tools.launcher import Stack, usable_cores
from worker import weights

pytestmark = pytest.mark.e2e

NAME = "smollm2-135m"
STEPS = 10
#: Logits of the engine (paged attention, batched over two workers) vs transformers' (one
#: prompt at a time, contiguous): float32 through 30 layers.
ATOL = 1e-3


@pytest.fixture(scope="module")
def stack(smollm2_cache):
    with Stack(2, model=NAME, block_size=16, num_blocks=256) as s:
        yield s


# (session scope: loaded once by each test process that needs it, a few seconds, so that
# the tests that need nothing else of the module run in any process: tests/scheduling.py)
@pytest.fixture(scope="session")
def reference(smollm2_cache):
    return weights.load(NAME)


@pytest.fixture(scope="module")
def engine(stack):
    with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as e:
        yield e


def _prompts(tok) -> list[tuple[str, list[int]]]:
    system = Message("system", "You are a helpful assistant. Answer briefly and accurately; say when you do not "
                               "know. Use plain words, no lists, and never more than two sentences.")
    long_text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
                 "combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
                 "wine. Within fifty years presses were at work in more than two hundred cities across Europe, "
                 "and the number of books grew from thousands to millions. Cheaper books spread literacy, carried the "
                 "arguments of the Reformation and let scientists compare and correct each other's results, which "
                 "many historians count among the roots of the modern world. Summarise this in one sentence:")
    chats = [[Message("user", "Hi")],
             [system, Message("user", "What is the capital of France?")],
             [system, Message("user", "Name three colours of the rainbow.")],
             [Message("user", "Write a haiku about the sea.")]]
    raw = ["Hello", "The capital of France is", "def fibonacci(n):", long_text]
    out = [(f"chat {i}", tok.chat_prompt(c)) for i, c in enumerate(chats)]
    out += [(f"raw {i}", tok.encode(t)) for i, t in enumerate(raw)]
    return out


def _assert_equal_to_transformers(engine: Engine, reference, prompts: list[tuple[str, list[int]]]) -> None:
    """The engine's greedy tokens equal transformers' ``generate``, its logits within ATOL."""
    report = engine.run([Request(p, max_new_tokens=STEPS, ignore_eos=True, request_id=name) for name, p in prompts])
    assert report.failed == 0
    worst = 0.0
    for (name, prompt), c in zip(prompts, report.completions):
        expected, want = greedy(reference, prompt, STEPS)
        assert c.outputs[0] == expected, f"{name} ({len(prompt)} tokens)"
        got = torch.tensor([list(row) for row in c.logits[0]])
        worst = max(worst, float((got - want).abs().max()))
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
    print(f"largest logit difference: {worst:.2e} (tolerance {ATOL})")


def test_greedy_tokens_and_logits_over_two_workers_equal_transformers_generate(stack, engine, reference):
    prompts = _prompts(engine.tokenizer)
    lengths = sorted(len(p) for _, p in prompts)
    assert lengths[0] == 1 and lengths[-1] >= 90 and len(prompts) >= 8, lengths
    _assert_equal_to_transformers(engine, reference, prompts)
    # both workers computed: the prompts were spread over the two pools
    for w in stack.workers:
        text = urllib.request.urlopen(w.metrics_url, timeout=10).read().decode()
        tokens = [float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("kvservice_worker_forward_tokens_total")]
        assert tokens and tokens[0] > 0, w.pool_id


def test_greedy_tokens_and_logits_over_one_worker_equal_transformers_generate(reference):
    """One worker with both cores' threads: every sequence in one batch per step."""
    with Stack(1, model=NAME, block_size=16, num_blocks=256) as one, \
            Engine(one.target, credentials=one.credentials("engine"), return_logits=True) as engine:
        assert one.torch_threads == usable_cores()
        _assert_equal_to_transformers(engine, reference, _prompts(engine.tokenizer))


def test_a_chat_answer_ends_at_the_end_of_sequence_token(engine):
    tok = engine.tokenizer
    prompt = tok.chat_prompt([Message("user", "What is the capital of France? One word.")])
    c = engine.run([Request(prompt, max_new_tokens=200)]).completions[0]
    tokens = c.outputs[0]
    assert c.finish_reasons == ["stop"] and len(tokens) < 200
    assert tokens[-1] in tok.eos_token_ids and not set(tokens[:-1]) & tok.eos_token_ids
    raw = tok._backend.decode(tokens, skip_special_tokens=False)
    assert "<|im_start|>" not in raw and raw.count("<|im_end|>") == 1 and raw.endswith("<|im_end|>")
    assert "Paris" in c.texts[0] and "<|im_end|>" not in c.texts[0]


def test_a_stop_string_cuts_the_text_before_it(engine):
    tok = engine.tokenizer
    prompt = tok.encode("Once upon a time")
    free = engine.run([Request(prompt, max_new_tokens=24, ignore_eos=True)]).completions[0].texts[0]
    word = free.split()[3]                               # a word from the middle of the free text
    stop = " " + word
    cut = engine.run([Request(prompt, max_new_tokens=24, ignore_eos=True, stop=(stop,))]).completions[0]
    assert cut.finish_reasons == ["stop"]
    assert cut.texts[0] == free[:free.index(stop)] and stop not in cut.texts[0]


def test_the_stop_matcher_holds_back_what_could_begin_a_stop_string():
    m = StopMatcher(["END"])
    assert m.feed("abc E") == ("abc", False)        # " E" could begin "END": held
    assert m.feed("N") == (" ", False)               # "EN" still could
    assert m.feed("D and more") == ("", True)        # found: the text ends before it
    assert m.text == "abc " and m.flush() == ""
    m = StopMatcher(["xy"])
    assert m.feed("ax") == ("a", False) and m.feed("b") == ("x", False) and m.flush() == "b"
    assert StopMatcher([]).feed("anything") == ("anything", False)


def test_sampling_with_top_p_top_k_and_a_seed_is_reproducible_and_batch_independent(engine):
    tok = engine.tokenizer
    prompt = tok.chat_prompt([Message("user", "Tell me something about cats.")])
    alone = engine.run([Request(prompt, max_new_tokens=12, n=4, temperature=0.9, top_p=0.9, top_k=40, seed=5,
                                ignore_eos=True)]).completions[0]
    crowd = engine.run([Request(tok.encode("Some other prompt"), max_new_tokens=12, temperature=1.0, seed=1),
                        Request(prompt, max_new_tokens=12, n=4, temperature=0.9, top_p=0.9, top_k=40, seed=5,
                                ignore_eos=True)]).completions[1]
    assert alone.outputs == crowd.outputs
    assert len({tuple(o) for o in alone.outputs}) > 1       # four different samples
    # top_k = 1 is greedy, whatever the temperature
    greedy = engine.run([Request(prompt, max_new_tokens=8, ignore_eos=True)]).completions[0].outputs[0]
    k1 = engine.run([Request(prompt, max_new_tokens=8, temperature=1.5, top_k=1, seed=3,
                             ignore_eos=True)]).completions[0].outputs[0]
    assert k1 == greedy


def test_online_submit_streams_outputs_and_cancel_frees_the_blocks(stack):
    with Engine(stack.target, credentials=stack.credentials("engine")) as e:
        e.start()
        with pytest.raises(RuntimeError, match="loop serves"):
            e.run([])
        before = used_blocks(stack)
        prompt = e.tokenizer.encode("Count from one to one thousand: one, two, three,")
        h = e.submit(Request(prompt * 4, max_new_tokens=400, ignore_eos=True))
        events = h.events(timeout=30)
        first = [next(events) for _ in range(3)]
        assert all(len(o.token_ids) == 1 and o.finish_reason is None for o in first)
        assert not h.done
        assert wait_for(lambda: used_blocks(stack) > before)     # the request holds blocks now
        h.cancel()
        c = h.result(timeout=30)
        assert c.finish_reasons == ["cancelled"] and 3 <= len(c.outputs[0]) < 400
        assert wait_for(lambda: used_blocks(stack) == before), (before, used_blocks(stack))
        assert e.report.cancelled == 1
        # a request submitted after goes through as usual
        c = e.submit(Request(prompt, max_new_tokens=4, ignore_eos=True)).result(timeout=60)
        assert c.finish_reasons == ["length"] and len(c.outputs[0]) == 4


def test_submit_refuses_what_cannot_be_served_and_what_cannot_wait(stack):
    with Engine(stack.target, credentials=stack.credentials("engine"), max_num_seqs=1, max_waiting=1) as e:
        e.start()
        with pytest.raises(RequestError, match="needs .* KV blocks") as exc:
            e.submit(Request([1] * 100, max_new_tokens=8000))
        assert exc.value.field == "max_new_tokens"
        with pytest.raises(RequestError, match="vocabulary") as exc:
            e.submit(Request([10**6], max_new_tokens=4))
        assert exc.value.field == "prompt"
        running = e.submit(Request([504, 3575], max_new_tokens=60, ignore_eos=True))
        assert wait_for(lambda: e.num_running == 1)
        waiting = e.submit(Request([504, 3575], max_new_tokens=4, ignore_eos=True))
        with pytest.raises(EngineBusy, match="wait for KV blocks"):
            e.submit(Request([504], max_new_tokens=4))
        assert [h.result(timeout=60).finish_reasons for h in (running, waiting)] == [["length"], ["length"]]
