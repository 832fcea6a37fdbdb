"""``kvservice demo``: a local stack (Redis, an allocator, model workers) and a batch of
requests run by the continuous-batching engine, ending with the answers and a report.

The workload is built to show what paging buys: requests share system prompts (the prefix
cache serves them), some ask for four samples each (fork and copy-on-write share the
prompt), and all run together. With the default model (``smollm2-135m``,
SmolLM2-135M-Instruct on the CPU, converted into the model cache on first use) the
requests are chats and the answers are printed as text with their cached prompt tokens;
with a seeded preset (``tiny-llama``: random weights) they are random token ids. The
engine uses the SDK's local mode (``--remote``: the Step path). Progress goes to stderr,
the answers and the report to stdout.

The workers' pools are small (``--num-blocks`` 24) and each has a host tier
(``--host-tier-gb``): after the workload, a second turn of the first chats finds their
first turn's blocks evicted from the device and loads them from the host tier (DESIGN §12).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import textwrap
import time

from kvservice.engine import Completion, Engine, Progress, Report, Request
from kvservice.engine.text import Message, Tokenizer
from kvservice.tools.launcher import Stack

#: Chats asked again at the end (their prompts' blocks come back from the host tier).
AGAIN = 3
FOLLOW_UP = "\n<|im_start|>user\nThank you. Can you say it in other words?<|im_end|>\n<|im_start|>assistant\n"
#: The report's figures, in order, with their labels and formats.
FIGURES = (
    ("requests", "requests completed", "{}"),
    ("tokens", "tokens generated", "{}"),
    ("peak_blocks", "KV blocks used at peak", "{}"),
    ("kv_utilization", "KV utilization at peak (slots holding tokens / slots of used blocks)", "{:.1%}"),
    ("prefix_hit_tokens", "prefix-cache hit tokens (not recomputed)", "{}"),
    ("cow_copies", "copy-on-write block copies", "{}"),
    ("sharing_saving", "memory saved by sharing vs an unshared run", "{:.1%}"),
)

#: The chats' system prompts (each shared by several requests: prefix-cache hits).
SYSTEMS = (
    "You are a helpful assistant. Answer in one or two short sentences, in plain words. If you do not know "
    "the answer, say so instead of guessing.",
    "You are a friendly science teacher for children. Explain things simply and briefly, with one everyday "
    "example, in at most two sentences.",
)
QUESTIONS = (
    "What is the capital of France?", "Why is the sky blue?", "How many legs does a spider have?",
    "What is the boiling point of water?", "Name three primary colours.", "What do bees make?",
    "Why do we have seasons?", "What is a prime number?", "How far away is the Moon?",
    "What is photosynthesis?", "Write a haiku about the sea.", "Suggest a name for a cat.",
    "What is the largest planet?", "Why does ice float?", "What is gravity?", "Give me a tip for sleeping well.",
)


def chat_workload(tokenizer: Tokenizer, seed: int = 7, *, num_requests: int = 12,
                  max_new_tokens: int = 64) -> tuple[list[Request], list[str]]:
    """Chats over the shared system prompts; every fourth asks for four samples.

    Returns:
        The requests (greedy for n = 1, temperature 0.8 and top-p 0.95 for n = 4; each
        ends at the model's end of sequence or after ``max_new_tokens``) and their
        questions.
    """
    requests, questions = [], []
    for i in range(num_requests):
        question = QUESTIONS[i % len(QUESTIONS)]
        prompt = tokenizer.chat_prompt([Message("system", SYSTEMS[i % len(SYSTEMS)]), Message("user", question)])
        n = 4 if i % 4 == 3 else 1
        requests.append(Request(prompt, max_new_tokens=max_new_tokens, n=n, temperature=0.8 if n > 1 else 0.0,
                                top_p=0.95 if n > 1 else 1.0, seed=seed * 100 + i, request_id=f"r{i}"))
        questions.append(question)
    return requests, questions


def workload(seed: int = 7, *, num_requests: int = 16, max_new_tokens: int = 24, vocab: int = 512) -> list[Request]:
    """Token-id requests for a model without a tokenizer: three shared random "system
    prompts" and random user parts; every fourth asks for four samples."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(length)] for length in (48, 40, 70)]
    requests = []
    for i in range(num_requests):
        user = [rng.randrange(vocab) for _ in range(rng.randrange(4, 40))]
        n = 4 if i % 4 == 3 else 1
        requests.append(Request(prompt=systems[i % 3] + user, max_new_tokens=max_new_tokens, n=n,
                                temperature=0.8 if n > 1 else 0.0, seed=seed * 100 + i, request_id=f"r{i}"))
    return requests


def _progress(p: Progress) -> None:
    sys.stderr.write(f"\rstep {p.step:>4}: {p.running:>2} running, {p.waiting:>2} waiting, "
                     f"{p.finished:>2}/{p.total} done, {p.tokens:>4} tokens, {p.blocks:>3} blocks in use")
    sys.stderr.flush()


def format_report(report: Report) -> str:
    """The report as aligned text lines."""
    values = report.to_dict()
    lines = [f"  {label:<70} {fmt.format(values[key])}" for key, label, fmt in FIGURES]
    lines.append(f"  {'(unshared peak would be ' + str(report.peak_unshared_blocks) + ' blocks; '}"
                 f"{report.steps} engine steps, {report.preemptions} preemptions, "
                 f"{report.prefill_tokens} prompt tokens computed, {report.seconds:.1f} s)")
    return "\n".join(lines)


def format_answers(completions: list[Completion], questions: list[str], width: int = 100) -> str:
    """Each chat's question and answer(s), with its cached prompt tokens."""
    lines = []
    for c, q in zip(completions, questions):
        lines.append(f"[{c.request_id}] {q}  (prompt {c.num_prompt_tokens} tokens, {c.num_cached_tokens} from the "
                     f"prefix cache{', 4 samples' if len(c.texts) > 1 else ''})")
        for i, (text, reason) in enumerate(zip(c.texts, c.finish_reasons)):
            mark = f"  {i + 1}." if len(c.texts) > 1 else "   "
            body = " ".join(text.split()) + ("" if reason == "stop" else " [...]")
            lines.extend(textwrap.wrap(body, width, initial_indent=f"{mark} ", subsequent_indent="     ") or [mark])
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Starts the stack, runs the workload, prints the answers and the report; returns
    the exit code."""
    started = time.monotonic()
    log = (lambda msg: print(msg, file=sys.stderr)) if not args.quiet else (lambda msg: None)
    log(f"starting Redis, an allocator and {args.workers} worker(s) serving {args.model} "
        f"(each worker loads the model) ...")
    tiers = ("--host-tier-gb", str(args.host_tier_gb)) if args.host_tier_gb else ()
    with Stack(args.workers, model=args.model, block_size=args.block_size, kv_memory=args.kv_memory,
               num_blocks=args.num_blocks, worker_args=tiers) as stack:
        log(f"stack up in {time.monotonic() - started:.1f} s:")
        for line in stack.describe():
            log(f"  {line}")
        with Engine(stack.target, credentials=stack.credentials("engine"), progress=None if args.quiet else _progress,
                    local=not args.remote) as engine:
            if engine.tokenizer is not None:
                requests, questions = chat_workload(engine.tokenizer, args.seed, num_requests=args.requests,
                                                    max_new_tokens=args.max_new_tokens)
                shared = f"{min(len(SYSTEMS), len(requests))} shared system prompts"
            else:
                requests, questions = workload(args.seed, num_requests=args.requests,
                                               max_new_tokens=args.max_new_tokens, vocab=engine.model.vocab_size), []
                shared = "3 shared prompt prefixes"
            log(f"running {len(requests)} requests ({sum(r.n for r in requests)} samples) over {shared} ...")
            report = engine.run(requests)
            again = None
            if args.host_tier_gb and questions:
                # A second turn of the first chats, after the whole workload went through the
                # pools: their first turn's blocks were evicted from the device, and come
                # back from the host tier instead of being recomputed.
                log("a second turn of the first chats ...")
                follow = engine.tokenizer.encode(FOLLOW_UP)
                again = engine.run([Request(r.prompt + c.outputs[0] + follow, max_new_tokens=1,
                                            request_id=f"{r.request_id}-again")
                                    for r, c in zip(requests[:AGAIN], report.completions)])
            audit = stack.audit()
            reserved = engine.client.reserved_blocks() if engine.local else 0
        if not args.quiet:
            sys.stderr.write("\n")
        in_use = sum(p.num_used_blocks for p in audit.pools)
        log(f"audit: {'ok' if audit.ok else 'FAILED'}; blocks in use after the run: {in_use}"
            + (f" (the engine's lease held {reserved} more in reserve until it closed)" if reserved else ""))
        for problem in audit.problems:
            log(f"  {problem}")
    log(f"stopped the stack ({time.monotonic() - started:.1f} s in all)")
    if args.json:
        print(json.dumps({**report.to_dict(), **({"again": again.to_dict()} if again else {})}))
    else:
        if questions:
            print("answers:")
            print(format_answers(report.completions, questions))
            print()
        print(f"report ({args.workers} worker(s), block size {args.block_size}):")
        print(format_report(report))
        if again is not None:
            cached = sum(c.num_cached_tokens for c in again.completions)
            prompt = sum(c.num_prompt_tokens for c in again.completions)
            print(f"a second turn of the first {len(again.completions)} chats: {cached} of their {prompt} prompt tokens "
                  f"cached, {again.loaded_blocks} blocks of them loaded from the host tier "
                  f"({report.offloaded_blocks + again.offloaded_blocks} blocks were copied down as the device "
                  f"evicted them)")
        if not questions:
            for c in report.completions[:3]:
                print(f"  {c.request_id}: {len(c.outputs)} sample(s), first tokens {c.outputs[0][:8]} "
                      f"(cached prompt tokens {c.num_cached_tokens})")
    return 0 if not report.failed and audit.ok and not in_use else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's flags."""
    parser.add_argument("--workers", type=int, default=2, help="workers (pools) to start (default 2)")
    parser.add_argument("--model", default="smollm2-135m",
                        help="model preset the workers serve (default smollm2-135m: chats answered in text; "
                             "tiny-llama: random weights, token ids)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--kv-memory", default="64MiB", help="KV memory per worker (default 64MiB)")
    parser.add_argument("--num-blocks", type=int, default=24,
                        help="KV blocks per worker (default 24: small pools, so that the device evicts and the host "
                             "tier keeps what it evicted; 0: --kv-memory decides)")
    parser.add_argument("--host-tier-gb", type=float, default=0.1,
                        help="each worker's host tier in GB (default 0.1; 0: none): after the workload the first "
                             "chats are asked again, their evicted prompt blocks loaded from it")
    parser.add_argument("--requests", type=int, default=12, help="requests in the workload (default 12)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens per sample at most (default 64; a chat answer ends earlier at its end of "
                             "sequence)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the workload and its sampling (default 7)")
    parser.add_argument("--remote", action="store_true",
                        help="the SDK's Step path: every ownership change of an engine step in one synchronous "
                             "allocator call (default: local mode, no allocator call while decoding)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress or start-up lines on stderr")
