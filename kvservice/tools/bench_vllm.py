"""``kvservice bench-vllm``: vLLM's time to first token on a long shared prefix, with and
without the kvservice connector, in one run.

A local stack (an allocator, one store worker) and three vLLM instances (CPU build, ``make
vllm``), each its own process, one after the other: "off" (no connector) answers
``--samples`` prompts, each a prefix of ``--prefix-tokens`` tokens of its own and a
question; "A" (connector on) computes the same prefixes (saved to the store); "B" (connector
on, a fresh instance) answers the off instance's prompts, loading the prefixes A stored.
Each instance answers a short prompt first (a warm-up), then the timed prompts one at a
time, one token each: a request's time is its time to first token. Figures: the median of
the samples (``ttft_ms_off``, ``ttft_ms_on``), the tokens B loaded from the store
(``loaded_tokens``, over every sample) and each prompt's length (``prompt_tokens``).

Usage::

    kvservice bench-vllm [--prefix-tokens 2048] [--samples 3] [--vllm-python PATH] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvservice.tools.vllm_store import (BLOCK_SIZE, DEFAULT_VLLM_PYTHON, connector_config, model_folder, run_offline,
                                        store_stack)


def progress(msg: str) -> None:
    print(f"[bench-vllm] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-tokens", type=int, default=2048, help="tokens of each shared prefix (default 2048)")
    p.add_argument("--question-tokens", type=int, default=40, help="tokens after the prefix (default 40)")
    p.add_argument("--samples", type=int, default=3, help="timed prompts per instance (default 3)")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, metavar="PATH",
                   help="a Python with vLLM's CPU build and kvservice (default: make vllm's, .venv-vllm)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def _prompts(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(the timed prompts, A's prompts: the same prefixes, other questions, a warm-up)."""
    rng = random.Random(15)
    words = lambda n: [rng.randrange(100, 40000) for _ in range(n)]     # noqa: E731
    prefixes = [words(args.prefix_tokens) for _ in range(args.samples)]
    return ([p + words(args.question_tokens) for p in prefixes], [p + words(args.question_tokens) for p in prefixes],
            words(64))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    timed, stored, warm = _prompts(args)
    folder = model_folder()
    blocks = args.samples * (len(stored[0]) // BLOCK_SIZE)
    kv = f"{max(256, (blocks + 8) * 6)}MiB"           # (a block of SmolLM2's is 5.6 MiB)
    work = tempfile.mkdtemp(prefix="kvs-bench-vllm-")
    progress(f"store: one worker, {kv}; vLLM runs' logs in {work}")
    with store_stack(folder, workers=1, kv_memory=kv) as stack:
        def run(name: str, connector: bool, prompts: list[list[int]]) -> dict[str, Any]:
            t0 = time.monotonic()
            out = run_offline(args.vllm_python, {"model": folder, "connector": connector_config(stack) if connector
                                                 else None, "phases": [
                {"name": "warm-up", "prompts": [warm], "max_tokens": 1},
                {"name": name, "prompts": prompts, "max_tokens": 1, "one_by_one": True}]}, work, name)
            progress(f"{name}: {time.monotonic() - t0:.0f} s (start {out['start_seconds']:.0f} s)")
            return out["phases"][1]
        off = run("off", False, timed)
        saved = run("a", True, stored)
        on = run("b", True, timed)
    if saved["connector"]["worker"]["saved_blocks"] != blocks:
        raise RuntimeError(f"A saved {saved['connector']['worker']['saved_blocks']} blocks, not {blocks}")
    if on["outputs"] != off["outputs"]:
        raise RuntimeError(f"B's first tokens with the connector {on['outputs']} differ from those without "
                           f"{off['outputs']}")
    return {"prompt_tokens": len(timed[0]), "prefix_tokens": args.prefix_tokens, "samples": args.samples,
            "ttft_ms_off": statistics.median(off["seconds"]) * 1000,
            "ttft_ms_on": statistics.median(on["seconds"]) * 1000,
            "ttft_ms_off_all": [s * 1000 for s in off["seconds"]], "ttft_ms_on_all": [s * 1000 for s in on["seconds"]],
            "loaded_tokens": on["connector"]["worker"]["loaded_tokens"],
            "external_hits": on["external_hits"], "load_failures": on["connector"]["worker"]["load_failures"]}


def report(fig: dict[str, Any]) -> str:
    return "\n".join([
        f"vLLM (CPU), SmolLM2, prompts of {fig['prompt_tokens']} tokens ({fig['prefix_tokens']} of them a prefix "
        f"another instance computed), median of {fig['samples']}:",
        "| connector | TTFT (ms) | tokens loaded from the store |",
        "|---|---:|---:|",
        f"| off | {fig['ttft_ms_off']:.0f} | 0 |",
        f"| kvservice | {fig['ttft_ms_on']:.0f} | {fig['loaded_tokens']} |",
        f"\non / off: {fig['ttft_ms_on'] / fig['ttft_ms_off']:.2f}x"])


def main(args: argparse.Namespace) -> int:
    if min(args.prefix_tokens, args.question_tokens, args.samples) < 1:
        print("kvservice bench-vllm: --prefix-tokens, --question-tokens and --samples must be positive", file=sys.stderr)
        return 2
    if args.prefix_tokens + args.question_tokens > 4000:
        print("kvservice bench-vllm: prompts must fit vLLM's 4096-token context here", file=sys.stderr)
        return 2
    if not Path(args.vllm_python).exists():
        print(f"kvservice bench-vllm: {args.vllm_python} does not exist (make vllm builds it)", file=sys.stderr)
        return 2
    fig = measure(args)
    print(json.dumps(fig, indent=2) if args.json else report(fig))
    return 0
