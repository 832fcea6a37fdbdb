"""Many engines, one cache: two engines (two leases of one tenant, as two API replicas run)
over one allocator and two workers get the same fresh prompt at the same moment. A
block's hash is announced only once its KV is written, so the second engine either
computes the prompt itself or hits blocks that hold their KV: every answer equals
transformers' greedy generation, with and without a host tier (whose loads land in
blocks that are announced once loaded). A writer SIGKILLed between its create and its
write leaves no hash behind: the next engine computes the prompt. On a seeded preset
(``chats.TINY``: the same paths as SmolLM2 at a fraction of the compute); run with ``-s``
for the figures."""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time

import pytest

from chats import STEPS, TINY, assert_greedy, words
from kvservice.engine import Engine, Request
from kvservice.tools.launcher import Stack

pytestmark = pytest.mark.e2e

TRIALS = 40
BLOCK = 16


@pytest.fixture(scope="session")
def tiny():
    return TINY.reference()


def _prompt(trial: int, tag: str) -> list[int]:
    """A fresh prompt of ~200 tokens (12 full blocks) that no earlier trial shares."""
    return words(f"{tag} trial {trial}: " + " ".join(f"item {trial * 31 + k} weighs {k * 7 % 13} units"
                                                   for k in range(28)))[:200]


#: How long after the first engine the second gets the prompt, trial after trial (s): at
#: once, and while the first may be computing it or have just written it.
DELAYS = (0.0, 0.0, 0.02, 0.05, 0.1, 0.2)


def _both(engines: list[Engine], prompts: list[list[int]], trial: int, delay: float) -> list[tuple[object, float]]:
    """A prompt to each engine, the second ``delay`` seconds after the first: (completion,
    seconds to its first token) per engine."""
    gate = threading.Barrier(len(engines))
    out: list = [None] * len(engines)

    def one(i: int, engine: Engine) -> None:
        first: list[float] = []
        gate.wait()
        if i:
            time.sleep(delay)
        t0 = time.monotonic()
        handle = engine.submit(Request(prompts[i], max_new_tokens=STEPS, ignore_eos=True, request_id=f"t{trial}e{i}"),
                               lambda event: first or first.append(time.monotonic()))
        done = handle.result(timeout=120)
        out[i] = (done, first[0] - t0)
    threads = [threading.Thread(target=one, args=(i, e)) for i, e in enumerate(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(o is not None for o in out)
    return out


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ms" if values else "-"


@pytest.mark.parametrize("tier", ["off", "host"])
def test_two_engines_sent_one_fresh_prompt_answer_as_transformers(tiny, tier):
    # (small device pools with a host tier: the trials' earlier prompts are evicted and
    # copied down; every fifth trial sends an old prompt again, loaded from the host tier)
    worker_args = ("--host-tier-gb", TINY.tier_gb(400)) if tier == "host" else ()
    with Stack(2, model=TINY.name, block_size=BLOCK, num_blocks=24 if tier == "host" else 512,
               worker_args=worker_args) as stack, \
            Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as a, \
            Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as b:
        a.start()
        b.start()
        by_delay: dict[float, list[tuple[int, float]]] = {d: [] for d in DELAYS}   # the second's (hit, ttft)
        first_ttft, alone, hits = [], [], 0
        for trial in range(TRIALS):
            again = tier == "host" and trial % 5 == 4
            prompt = _prompt(trial - 4 if again else trial, tier)
            delay = DELAYS[trial % len(DELAYS)]
            results = _both([a, b], [prompt, prompt], trial, delay)
            for done, _ in results:
                assert done.error == "", done.error
                assert_greedy(tiny, prompt, done)
                hits += done.num_cached_tokens > 0
            if not again:
                first_ttft.append(results[0][1])
                by_delay[delay].append((results[1][0].num_cached_tokens, results[1][1]))
            if delay == 0.0 and not again:
                # (the control: two other fresh prompts at once, one each: the time to first
                # token of computing a prompt alone under the same load)
                other = [_prompt(trial, tier + " control a"), _prompt(trial, tier + " control b")]
                for p, (done, ttft) in zip(other, _both([a, b], other, trial, 0.0)):
                    assert done.error == "" and done.num_cached_tokens == 0, done.error
                    assert_greedy(tiny, p, done)
                alone.append(ttft)
        loaded = sum(e.report.loaded_blocks for e in (a, b))
        rows = "; ".join(f"{d * 1e3:.0f} ms later: {sum(1 for h, _ in v if h)} of {len(v)} hit, ttft "
                         f"{_ms([t for _, t in v])}" for d, v in by_delay.items() if v)
        print(f"\ntier {tier}: {TRIALS} trials x 2 engines, every answer equal to transformers' "
              f"({hits} of {2 * TRIALS} requests hit cached blocks; {loaded} blocks loaded from the host tier); "
              f"first engine ttft {_ms(first_ttft)}; second engine, sent {rows}; a prompt of its own at "
              f"the same moment (alone, the same load): ttft {_ms(alone)}")
        if tier == "host":
            assert loaded > 0
        # (sent 0.2 s later, the first's prompt is written and committed: the second hits it)
        assert all(h > 0 for h, _ in by_delay[0.2])


WRITER = r"""
import sys
from kvservice.client import Client
from kvservice.common.security import ClientCredentials
target, prompt, ca, cert, key = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], *sys.argv[3:6]
c = Client(target, lease_ttl=3.0, commit_after_write=True, credentials=ClientCredentials(ca=ca, cert=cert, key=key))
seq = c.create(prompt)
print(seq.pool, len(seq.block_table), flush=True)
sys.stdin.readline()          # (killed here: created, never written)
"""


def test_a_writer_killed_between_its_create_and_its_write_leaves_no_hash(tiny, tmp_path):
    prompt = _prompt(999, "killed")
    with Stack(2, model=TINY.name, block_size=BLOCK, num_blocks=256) as stack:
        script = tmp_path / "writer.py"
        script.write_text(WRITER)
        creds = stack.credentials("engine")
        writer = subprocess.Popen([sys.executable, str(script), stack.target, ",".join(map(str, prompt)),
                                   creds.ca, creds.cert, creds.key], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        try:
            pool, blocks = writer.stdout.readline().split()
            assert int(blocks) == -(-len(prompt) // BLOCK)
            writer.kill()
            writer.wait(10)
            with Engine(stack.target, credentials=stack.credentials("engine"), return_logits=True) as engine:
                first = engine.run([Request(prompt, max_new_tokens=STEPS, ignore_eos=True)]).completions[0]
                assert first.num_cached_tokens == 0          # (its blocks were never announced)
                assert_greedy(tiny, prompt, first)
                # (its lease reaped: nothing of it stays)
                deadline = time.monotonic() + 30
                while any(p.num_sequences for p in stack.audit().pools):
                    assert time.monotonic() < deadline, "the killed writer's lease was not reaped"
                    time.sleep(0.2)
                assert stack.audit().ok
                second = engine.run([Request(prompt, max_new_tokens=STEPS, ignore_eos=True)]).completions[0]
                assert second.num_cached_tokens == len(prompt) // BLOCK * BLOCK - (BLOCK if len(prompt) % BLOCK == 0
                                                                                   else 0)
                assert_greedy(tiny, prompt, second)
        finally:
            writer.kill()


def test_two_api_replicas_behind_the_front_answer_one_new_prompt_alike(smollm2_cache):
    """``kvservice up --api-replicas 2``'s shape: two ``kvservice api`` processes (two engines,
    one lease each, tenant "api") behind the round-robin front, over one allocator and two
    SmolLM2 workers; the unmodified OpenAI client sends one new prompt to both at once, and
    then again: every answer equals transformers' greedy generation."""
    import openai

    from chats import greedy
    from kvservice.engine.text import Tokenizer
    from worker import weights

    name, steps = "smollm2-135m", 12
    with Stack(2, model=name, block_size=BLOCK, num_blocks=256, http_port=0, api_replicas=2) as stack, \
            openai.OpenAI(base_url=stack.http_url, api_key=stack.api_key, max_retries=0, timeout=120) as api:
        files = weights.tokenizer_files(name)
        tok = Tokenizer(files.tokenizer_json, files.chat_template, files.eos_token_ids, files.bos_token, files.eos_token)
        reference = weights.load(name)
        answers, cached = [], []
        for trial in range(3):
            prompt = tok.encode(f"Trial {trial}. The harbour master of the northern port keeps a ledger of every ship "
                                f"that arrives, with its cargo, its crew and the hour it was sighted; on the "
                                f"{trial + 3}rd page of the ledger he wrote that")
            expected = tok.decode(greedy(reference, prompt, steps)[0])

            def ask(prompt=prompt):
                r = api.completions.create(model=name, prompt=prompt, max_tokens=steps, temperature=0)
                return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens
            gate = threading.Barrier(2)
            out: list = [None, None]

            def both(i: int) -> None:
                gate.wait()
                out[i] = ask()
            threads = [threading.Thread(target=both, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            later = ask()
            answers += [o[0] for o in out] + [later[0]]
            cached += [o[1] for o in out] + [later[1]]
            assert [o[0] for o in out] + [later[0]] == [expected] * 3, (out, later, expected)
            assert later[1] > 0                                  # (written and announced: a hit)
        assert len(stack.front.connections) == 2          # (both replicas took connections)
        print(f"\n2 API replicas: 9 answers equal to transformers'; cached tokens {cached}; connections per "
              f"replica {sorted(stack.front.connections.values())}")
