"""``kvservice bench-serving``: the HTTP API under concurrent streaming chats, and vLLM's
server beside it with the same client in the same run.

The load (what a user who runs ``make up`` and then vLLM sees first): ``--requests``
concurrent streaming chat completions through the official ``openai`` client, each with
the same system prompt (about ``--system-words`` words) and its own question,
``--max-tokens`` tokens each (``ignore_eos``), temperature 0, after one warm-up request.
Figures per server: generated tokens per second over the whole batch (``tok_per_s``: the
sum of every request's completion tokens over the time from the first request sent to the
last one done), time to first token (p50, max), and the prompt tokens the server reported
cached.

Ours is a local stack (``kvservice up``: ``--workers`` SmolLM2 workers and the HTTP API),
started here; by default one worker, which takes every core, as vLLM's one server does
(on a CPU a decode step streams every weight from memory once, whatever its batch: one
worker's step of 24 sequences costs less than two workers' steps of 12 at once). Both
servers get the same KV memory, ``--kv-gib`` (ours split over the workers; vLLM's
``VLLM_CPU_KVCACHE_SPACE``). With ``--vllm-python PATH`` (a Python with vLLM's CPU build), vLLM's
OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, float32,
``--enforce-eager``) serves the same converted SmolLM2 folder, started after ours is
stopped, so that the two never share the cores.

Usage::

    kvservice bench-serving [--requests 24] [--max-tokens 64] [--workers 1] [--kv-gib 2] [--vllm-python PATH] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m"
#: A sentence of the shared system prompt (repeated to ``--system-words`` words).
SYSTEM = ("You are a careful assistant for a library of technical manuals. Answer in plain words, "
          "cite the manual's section when you know it, and say so when you do not. ")
QUESTIONS = ("How do I reset the device?", "What does error 42 mean?", "Which cable fits the port?",
             "How often should the filter be cleaned?", "Can it run on batteries?", "Where is the serial number?",
             "What is the warranty period?", "How do I update the firmware?")


def progress(msg: str) -> None:
    print(f"[bench-serving] {msg}", file=sys.stderr, flush=True)


def system_prompt(words: int) -> str:
    base = SYSTEM.split()
    return " ".join(base[i % len(base)] for i in range(words))


def _one(client: Any, model: str, system: str, question: str, max_tokens: int) -> dict[str, Any]:
    """One streaming chat; its time to first token, tokens and cached prompt tokens."""
    start = time.perf_counter()
    first = None
    arrivals: list[float] = []
    tokens = cached = prompt = 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            if first is None:
                first = arrivals[-1] - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            prompt = chunk.usage.prompt_tokens
            details = getattr(chunk.usage, "prompt_tokens_details", None)
            cached = (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft_s": first if first is not None else time.perf_counter() - start, "tokens": tokens,
            "prompt_tokens": prompt, "cached_tokens": cached, "seconds": time.perf_counter() - start,
            "itl_s": statistics.mean(gaps) if gaps else 0.0}


def drive(base_url: str, api_key: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The warm-up request, then ``--requests`` at once; the figures."""
    import openai

    system = system_prompt(args.system_words)
    with openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0, timeout=600) as client:
        _one(client, model, system, "Hello.", args.max_tokens)
        results: list[dict[str, Any] | None] = [None] * args.requests
        errors: list[str] = []

        def run(i: int) -> None:
            try:
                results[i] = _one(client, model, system, QUESTIONS[i % len(QUESTIONS)] + f" (case {i})",
                                  args.max_tokens)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(args.requests)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    done = [r for r in results if r is not None]
    if errors or len(done) != args.requests:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[:3]}")
    ttfts = sorted(r["ttft_s"] for r in done)
    tokens = sum(r["tokens"] for r in done)
    itls = sorted(r["itl_s"] for r in done)
    return {"tok_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1],
            "itl_p50_s": statistics.median(itls), "itl_max_s": itls[-1],
            "tokens": tokens, "wall_s": wall, "prompt_tokens": done[0]["prompt_tokens"],
            "cached_tokens_p50": statistics.median(r["cached_tokens"] for r in done)}


def measure_ours(args: argparse.Namespace) -> dict[str, Any]:
    from kvservice.tools.launcher import Stack

    roles = tuple(args.roles.split(",")) if args.roles else ()
    progress(f"starting a local stack: {args.workers} {MODEL} worker(s)"
             + (f" (roles {', '.join(roles)})" if roles else "") + " and the HTTP API")
    kv_memory = f"{args.kv_gib * 1024 // args.workers}MiB"
    with Stack(args.workers, model=MODEL, http_port=0, kv_memory=kv_memory, roles=roles) as stack:
        progress(f"driving {stack.api.url}: {args.requests} streaming chats of {args.max_tokens} tokens")
        return drive(stack.api.url, stack.api_key, stack.api.model, args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_vllm(args: argparse.Namespace) -> dict[str, Any]:
    # (the model cache's folder, converted once, as the stack's workers use it: kvservice
    # itself imports nothing of the worker's)
    folder = subprocess.run([sys.executable, "-m", "worker.weights", MODEL], check=True, stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True).stdout.strip()
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-", suffix=".log", delete=False)
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager", "--host", "127.0.0.1",
               "--port", str(port), "--max-model-len", "2048"]
    progress(f"starting vLLM: {' '.join(command)} (log {log.name})")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)})
    try:
        deadline = time.monotonic() + args.vllm_start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}: {Path(log.name).read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start within {args.vllm_start_timeout:.0f} s")
            time.sleep(1.0)
        progress(f"driving vLLM at port {port}")
        return drive(f"http://127.0.0.1:{port}/v1", "", MODEL, args)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def report(fig: dict[str, Any]) -> str:
    lines = ["| server | tokens/s | TTFT p50 (s) | TTFT max (s) | ITL p50 (ms) | cached prompt tokens (p50) |",
             "|---|---|---|---|---|---|",
             f"| kvservice ({fig['workers']} worker{'s' if fig['workers'] != 1 else ''}, {fig['roles']}) | "
             f"{fig['tok_per_s']:.1f} | {fig['ttft_p50_s']:.2f} | {fig['ttft_max_s']:.2f} | "
             f"{fig['itl_p50_s'] * 1000:.0f} | {fig['cached_tokens_p50']:.0f} of {fig['prompt_tokens']} |"]
    if "vllm_tok_per_s" in fig:
        lines.append(f"| vLLM | {fig['vllm_tok_per_s']:.1f} | {fig['vllm_ttft_p50_s']:.2f} | "
                     f"{fig['vllm_ttft_max_s']:.2f} | {fig['vllm_itl_p50_s'] * 1000:.0f} | "
                     f"{fig['vllm_cached_tokens_p50']:.0f} of {fig['vllm_prompt_tokens']} |")
        lines.append(f"\nkvservice / vLLM tokens/s: {fig['tok_per_s'] / fig['vllm_tok_per_s']:.2f}x")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=24, help="concurrent streaming chats (default 24)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each generates (default 64)")
    p.add_argument("--system-words", type=int, default=80,
                   help="words of the shared system prompt (default 80: about 100 tokens)")
    p.add_argument("--workers", type=int, default=1, help="our stack's workers, sharing the cores (default 1)")
    p.add_argument("--roles", default="",
                   help="each worker's role, comma-separated (both, prefill, decode: disaggregated prefill / "
                        "decode, DESIGN §13); default: every worker both")
    p.add_argument("--kv-gib", type=int, default=2,
                   help="KV memory of each server in GiB: ours split over its workers (default 2)")
    p.add_argument("--vllm-python", default="", metavar="PATH",
                   help="a Python with vLLM's CPU build: also measure vLLM's server, with the same client")
    p.add_argument("--vllm-start-timeout", type=float, default=600.0,
                   help="seconds vLLM may take to start (default 600)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def main(args: argparse.Namespace) -> int:
    if args.roles and (len(args.roles.split(",")) != args.workers
                       or not set(args.roles.split(",")) <= {"both", "prefill", "decode"}):
        print(f"kvservice bench-serving: --roles needs one of both, prefill, decode per worker ({args.workers}), "
              f"got {args.roles!r}", file=sys.stderr)
        return 2
    if min(args.requests, args.max_tokens, args.workers, args.system_words, args.kv_gib) < 1:
        print("kvservice bench-serving: --requests, --max-tokens, --workers, --system-words and --kv-gib must be "
              "positive",
              file=sys.stderr)
        return 2
    try:
        import openai  # noqa: F401
    except ImportError:
        print("kvservice bench-serving: needs the openai package (pip install openai)", file=sys.stderr)
        return 2
    fig: dict[str, Any] = {"workers": args.workers, "roles": args.roles or "both", "requests": args.requests,
                           "max_tokens": args.max_tokens,
                           **measure_ours(args)}
    if args.vllm_python:
        fig.update({f"vllm_{k}": v for k, v in measure_vllm(args).items()})
    print(json.dumps(fig, indent=2) if args.json else report(fig))
    return 0
