"""``kvservice demo``: a local stack (Redis, an allocator, model workers) and a batch of
requests run by the continuous-batching engine, ending with a report.

The workload is built to show what paging buys: requests share a few system prompts (the
prefix cache serves them), some ask for four samples each (fork and copy-on-write share
the prompt), and all run together on a small model (``tiny-llama``, random weights drawn
from a seed) on the CPU. The engine uses the SDK's local mode (``--remote``: the Step
path). Progress goes to stderr, the report to stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from kvservice.engine import Engine, Progress, Report, Request
from kvservice.tools.launcher import Stack

VOCAB = 512   # tiny-llama's vocabulary

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


def workload(seed: int = 7, *, num_requests: int = 16, max_new_tokens: int = 24) -> list[Request]:
    """Requests over three shared system prompts; every fourth asks for four samples.

    Args:
        seed: the seed of the token draws and of the sampling.
        num_requests: how many requests.
        max_new_tokens: tokens to generate per sample.

    Returns:
        The requests, greedy for n = 1 and at temperature 0.8 for n = 4.
    """
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(length)] for length in (48, 40, 70)]
    requests = []
    for i in range(num_requests):
        user = [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 40))]
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


def main(args: argparse.Namespace) -> int:
    """Starts the stack, runs the workload, prints the report; returns the exit code."""
    started = time.monotonic()
    log = (lambda msg: print(msg, file=sys.stderr)) if not args.quiet else (lambda msg: None)
    log(f"starting Redis, an allocator and {args.workers} worker(s) serving {args.model} ...")
    with Stack(args.workers, model=args.model, block_size=args.block_size, kv_memory=args.kv_memory,
               num_blocks=args.num_blocks) as stack:
        for line in stack.describe():
            log(f"  {line}")
        requests = workload(args.seed, num_requests=args.requests, max_new_tokens=args.max_new_tokens)
        log(f"running {len(requests)} requests ({sum(r.n for r in requests)} samples) over "
            f"{len({tuple(r.prompt[:40]) for r in requests})} shared system prompts ...")
        with Engine(stack.target, credentials=stack.credentials("engine"), progress=None if args.quiet else _progress,
                    local=not args.remote) as engine:
            report = engine.run(requests)
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
        print(json.dumps(report.to_dict()))
    else:
        print(f"report ({args.workers} worker(s), block size {args.block_size}):")
        print(format_report(report))
        for c in report.completions[:3]:
            print(f"  {c.request_id}: {len(c.outputs)} sample(s), first tokens {c.outputs[0][:8]} "
                  f"(cached prompt tokens {c.num_cached_tokens})")
    return 0 if not report.failed and audit.ok and not in_use else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's flags."""
    parser.add_argument("--workers", type=int, default=2, help="workers (pools) to start (default 2)")
    parser.add_argument("--model", default="tiny-llama", help="model preset the workers serve (default tiny-llama)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--kv-memory", default="64MiB", help="KV memory per worker (default 64MiB)")
    parser.add_argument("--num-blocks", type=int, default=0,
                        help="KV blocks per worker (overrides --kv-memory; e.g. 20 shows preemption)")
    parser.add_argument("--requests", type=int, default=16, help="requests in the workload (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per sample (default 24)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the workload and its sampling (default 7)")
    parser.add_argument("--remote", action="store_true",
                        help="the SDK's Step path: every ownership change of an engine step in one synchronous "
                             "allocator call (default: local mode, no allocator call while decoding)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress or start-up lines on stderr")
