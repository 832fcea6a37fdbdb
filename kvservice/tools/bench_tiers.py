"""``kvservice bench-tiers``: a multi-turn chat workload over SmolLM2 workers whose device
pools are far smaller than its working set, with the lower tiers off, a host tier, and a
host and a disk tier (DESIGN §12), one local stack each, in one run. The engine keeps to
each pool's own cache (fetches between pools off, DESIGN §13): the tiers alone are measured.

The workload (the same in every configuration, drawn from ``--seed``): ``--conversations``
chats of ``--turns`` turns each, every chat opening with one of ``--systems`` shared system
prompts (``--system-tokens``, default 150 to 300 tokens), user turns of ShareGPT-like lengths (a log-normal of
median ~60 tokens, 15 to 300) and answers of ShareGPT-like lengths too (a log-normal of
median ~0.6 ``--max-tokens``, at most ``--max-tokens``; greedy, ``ignore_eos``); each
turn's prompt is the chat so far. The turns go in rounds, as users take turns: every
chat's first turn, then every chat's second, ...; ``--concurrency`` chats in flight at once
within a round, so that between two turns of a chat every other chat's turn has gone
through the pools. The working set (every chat's last prompt, in blocks, shared system
blocks counted once) is printed beside the device pools' size; the defaults make it more
than four times as large.

Figures per configuration (``runs``, one object each): ``tiers`` ("off", "host",
"host+disk"), ``prompt_tokens`` (all turns'), ``recomputed_prompt_tokens`` (the prompt
tokens the workers computed: not served by the device's prefix cache nor loaded from a
lower tier), ``ttft_p50_ms`` and ``ttft_p99_ms`` (submit to first token, every turn),
``loaded_blocks``, ``load_failures``, ``offloaded_blocks`` (copied down a tier: blocks the
device evicted), ``floor_prompt_tokens`` (what one unbounded prefix cache would have
computed of the same turns: the new messages, each answer's unfilled last block, each
system prompt's first use), ``filled_blocks`` (blocks the run filled: what a write-through policy,
copying every block down as it fills, would have copied) and ``seconds``.

Usage::

    kvservice bench-tiers [--conversations 16] [--turns 5] [--num-blocks 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

MODEL = "smollm2-135m"
CONFIGS = ("off", "host", "host+disk")
WORDS = ("the of and to in is that for it with as was on be by this are from at or an have not which but "
         "they one you all were their there can been has more when will would who out about time so what up "
         "some into them could only other then also over its our most after first well years two how way "
         "because system data report river garden engine market signal winter letter method history "
         "library travel kitchen budget weather science music doctor village harbour network model").split()


def progress(msg: str) -> None:
    print(f"[bench-tiers] {msg}", file=sys.stderr, flush=True)


def _text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of words (SmolLM2's tokenizer: ~1.3 tokens a word here)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, int(tokens / 1.3))))


def workload(tokenizer: Any, args: argparse.Namespace) -> list[tuple[list[int], list[list[int]]]]:
    """Per chat: its first prompt (a system prompt and a user turn), and the tokens each
    later turn adds before the answer so far (a user turn)."""
    rng = random.Random(args.seed)
    low, high = args.system_tokens
    systems = [tokenizer.encode(f"system: {_text(rng, rng.randint(low, high))}\n") for _ in range(args.systems)]
    chats = []
    for i in range(args.conversations):
        def user() -> list[int]:
            n = min(300, max(15, int(rng.lognormvariate(math.log(60), 0.6))))
            return tokenizer.encode(f"\nuser: {_text(rng, n)}\nassistant:")
        chats.append((systems[i % args.systems] + user(), [user() for _ in range(args.turns - 1)]))
    return chats


def measure(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: a fresh stack, the whole workload, its figures."""
    from kvservice.engine import Engine, Request
    from kvservice.tools.launcher import Stack

    worker_args: list[str] = []
    disk = None
    if config == "host":
        worker_args += ["--host-tier-gb", str(args.host_tier_gb)]
    elif config == "host+disk":
        disk = tempfile.TemporaryDirectory(prefix="kvs-bench-tiers-")
        worker_args += ["--host-tier-gb", str(args.host_tier_gb / 4), "--disk-tier-dir", disk.name,
                        "--disk-tier-gb", str(args.disk_tier_gb)]
    ttfts: list[float] = []
    lock = threading.Lock()
    with Stack(args.workers, model=MODEL, block_size=16, num_blocks=args.num_blocks,
               worker_args=tuple(worker_args)) as stack, \
            Engine(stack.target, credentials=stack.credentials("engine"), fetch=False) as engine:
        chats = workload(engine.tokenizer, args)
        rng = random.Random(args.seed + 1)
        answers = [[min(args.max_tokens, max(16, int(rng.lognormvariate(math.log(args.max_tokens * 0.6), 0.4))))
                    for _ in range(args.turns)] for _ in chats]
        engine.start()
        prompts = [first for first, _ in chats]
        prompt_tokens = 0
        filled = [0]
        log: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

        def turn_of(i: int, turn: int) -> None:
            nonlocal prompt_tokens
            prompt = prompts[i]
            first: list[float] = []
            sent = time.monotonic()
            handle = engine.submit(Request(prompt, max_new_tokens=answers[i][turn], ignore_eos=True,
                                           request_id=f"c{i}t{turn}"),
                                   on_event=lambda e, f=first: f.append(time.monotonic()) if not f else None)
            done = handle.result(timeout=600)
            if done.error:
                raise RuntimeError(f"chat {i} turn {turn}: {done.error}")
            with lock:
                log[(turn, i)] = (prompt, done.outputs[0])
                ttfts.append((first[0] - sent) * 1000)
                prompt_tokens += len(prompt)
                # (the blocks this turn filled: what a write-through policy would copy down)
                filled[0] += (len(prompt) + len(done.outputs[0]) - 1) // 16 - done.num_cached_tokens // 16
            if turn + 1 < args.turns:
                prompts[i] = prompt + done.outputs[0] + chats[i][1][turn]

        start = time.monotonic()
        for turn in range(args.turns):        # (a round: every chat's next turn, --concurrency at a time)
            pending = list(range(len(chats)))

            def runner(t: int = turn) -> None:
                while True:
                    with lock:
                        if not pending:
                            return
                        i = pending.pop(0)
                    turn_of(i, t)
            threads = [threading.Thread(target=runner) for _ in range(args.concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            progress(f"  {config}: turn {turn + 1} of {args.turns} done ({time.monotonic() - start:.0f} s)")
        last_prompts = prompts
        seconds = time.monotonic() - start
        r = engine.report
        working = len({tuple(p[:k + 16]) for p in last_prompts for k in range(0, len(p) - 15, 16)})
        out = {"tiers": config, "prompt_tokens": prompt_tokens, "recomputed_prompt_tokens": r.prefill_tokens,
               "ttft_p50_ms": round(statistics.median(ttfts), 1),
               "ttft_p99_ms": round(_percentile(ttfts, 0.99), 1),
               "loaded_blocks": r.loaded_blocks, "load_failures": r.load_failures,
               "offloaded_blocks": r.offloaded_blocks, "filled_blocks": filled[0], "seconds": round(seconds, 1),
               "working_set_blocks": working, "device_blocks": args.num_blocks * args.workers,
               "floor_prompt_tokens": floor_of(log)}
        if not stack.audit().ok:
            raise RuntimeError(f"the audit found problems after the {config} run")
    if disk is not None:
        disk.cleanup()
    return out


def floor_of(log: dict[tuple[int, int], tuple[list[int], list[int]]], block_size: int = 16) -> int:
    """The prompt tokens one unbounded prefix cache would compute for the run's turns, in
    their order (by round, then chat): each prompt less its longest prefix of full blocks
    that an earlier turn's prompt and answer held (and at least its last token)."""
    def chain(tokens: list[int]) -> list[int]:
        out, h = [], 0
        for k in range(0, len(tokens) - block_size + 1, block_size):
            h = hash((h, tuple(tokens[k:k + block_size])))
            out.append(h)
        return out

    seen: set[int] = set()
    total = 0
    for key in sorted(log):
        prompt, output = log[key]
        cached = 0
        for h in chain(prompt[:-1]):
            if h not in seen:
                break
            cached += block_size
        total += len(prompt) - cached
        seen.update(chain(prompt + output[:-1]))     # (the answer's last token was never fed)
    return total


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    try:
        a, b = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two integers), got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return a, b


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=16, help="chats (default 16)")
    p.add_argument("--turns", type=int, default=5, help="turns per chat (default 5)")
    p.add_argument("--systems", type=int, default=4, help="shared system prompts (default 4)")
    p.add_argument("--system-tokens", type=_range, default=(150, 300), metavar="MIN,MAX",
                   help="each system prompt's length in tokens, drawn in MIN..MAX (default 150,300)")
    p.add_argument("--max-tokens", type=int, default=320,
                   help="the longest answer, in tokens (default 320; answers are log-normal, median ~0.6 of it)")
    p.add_argument("--concurrency", type=int, default=6, help="chats in flight at once (default 6)")
    p.add_argument("--workers", type=int, default=2, help="SmolLM2 workers (default 2)")
    p.add_argument("--num-blocks", type=int, default=128,
                   help="device blocks (16 tokens) per worker (default 128: the working set is over 4x larger)")
    p.add_argument("--host-tier-gb", type=float, default=0.5,
                   help="each worker's host tier, GB (default 0.5: ~680 blocks); with a disk tier, a quarter")
    p.add_argument("--disk-tier-gb", type=float, default=1.0, help="each worker's disk tier, GB (default 1)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"the configurations to measure, in order (default {','.join(CONFIGS)})")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def report(fig: dict[str, Any]) -> str:
    lines = [f"{fig['conversations']} chats x {fig['turns']} turns, working set {fig['runs'][0]['working_set_blocks']} "
             f"blocks, device pools {fig['runs'][0]['device_blocks']} blocks",
             f"{'tiers':<10} {'prompt':>8} {'recomputed':>11} {'floor':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'loaded':>7} {'failed':>7} {'s':>6}"]
    for r in fig["runs"]:
        lines.append(f"{r['tiers']:<10} {r['prompt_tokens']:>8} {r['recomputed_prompt_tokens']:>11} "
                     f"{r['floor_prompt_tokens']:>7} "
                     f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms {r['loaded_blocks']:>7} "
                     f"{r['load_failures']:>7} {r['seconds']:>6.1f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        print(f"kvservice bench-tiers: --configs takes {', '.join(CONFIGS)}; got {args.configs!r}", file=sys.stderr)
        return 2
    if min(args.conversations, args.turns, args.systems, args.max_tokens, args.concurrency, args.workers,
           args.num_blocks) < 1 or args.host_tier_gb <= 0 or args.disk_tier_gb <= 0:
        print("kvservice bench-tiers: every count and size must be positive", file=sys.stderr)
        return 2
    fig: dict[str, Any] = {"conversations": args.conversations, "turns": args.turns, "runs": []}
    for config in configs:
        progress(f"tiers {config}: {args.workers} workers of {args.num_blocks} device blocks, "
                 f"{args.conversations} chats x {args.turns} turns")
        fig["runs"].append(measure(config, args))
        progress(json.dumps(fig["runs"][-1]))
    print(json.dumps(fig, indent=2) if args.json else report(fig))
    return 0
