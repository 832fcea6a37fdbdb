"""``kvservice bench``: what the allocator costs an inference engine, next to the floor.

Phases (each after its own warm-up; every figure is wall time seen by the SDK):

1. **floor**: an empty gRPC round trip (the standard ``grpc.health.v1`` Check, through the
   same channel as the SDK) and a Redis PING (redis-py, the allocator's own Redis URL);
   ``floor_us`` is the sum of the two p50s, the least one allocator call can cost. Also
   ``script_rpc_us``: an allocator RPC whose handler runs one tiny Lua script (the pool's
   ``Heartbeat``), the least a step (one RPC, one script call) can cost.
2. **decode**: ``--sequences`` live sequences, prompt lengths ``128 + i`` tokens for
   sequence ``i`` (so the offsets inside a block are spread evenly and a block boundary is
   crossed by ``sequences / block_size`` sequences at *every* step, as in continuous
   batching with heterogeneous lengths, rather than by all of them every ``block_size``-th
   step); then ``--steps`` engine steps, each ONE ``Client.step`` call that appends one
   token to every sequence. A step's time is the wall time of that call, steps that need
   no RPC included.
3. **create / fork / free** of 2,000-token sequences, ``--repeat`` samples each, while the
   decode sequences are still live (a busy pool, as an engine sees it): a cold
   prompt (fresh random tokens each time, so nothing hits the cache), a fully cached prompt
   (the same prompt, held by a live sequence; every full block but the one with the last
   token is a hit), a fork of a 2,000-token sequence, and a free of a 2,000-token sequence
   that alone owns its blocks (all go to the evictable set) and of one whose prefix is shared.

By default the allocator runs as a separate process (``python -m kvservice serve`` with an
embedded Redis), so the client and the server do not share a GIL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import sys
import time
import uuid
from typing import Any, Callable

PROMPT_2K = 2000
BASE_PROMPT = 128
TOKEN_RANGE = 32000

#: figure -> (the figure of the same run it is compared with, or None for an absolute
#: limit; the multiple of it, or the absolute limit). DESIGN §5: the allocator costs what
#: an in-process block manager costs, and the decode step makes no synchronous call.
TARGETS: dict[str, tuple[str | None, float]] = {
    "step_p99_us": ("inproc_step_p99_us", 2.0),
    "alloc_us_per_token": ("inproc_us_per_token", 1.2),
    "sync_rpcs_per_step": (None, 0.0),
    "create_cached_2k_us": ("floor_us", 3.0),
    "journal_lag_p99_ms": (None, 50.0),
    "reserved_unused_p99_share": (None, 0.01),
}


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    xs = sorted(samples)
    k = max(1, math.ceil(q / 100 * len(xs)))
    return xs[min(k, len(xs)) - 1]


def _us(seconds: float) -> float:
    return seconds * 1e6


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class CpuMeter:
    """CPU time (all threads) of this process, the allocator and Redis, from Linux's
    ``/proc/<pid>/task/*/schedstat``: where a step's time goes, unaffected by waiting."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = {k: p for k, p in pids.items() if p and os.path.isdir(f"/proc/{p}/task")}

    @staticmethod
    def _ns(pid: int) -> int:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return total

    def snap(self) -> dict[str, int]:
        return {k: self._ns(p) for k, p in self.pids.items()}

    def per_op_us(self, before: dict[str, int], n: int) -> dict[str, float]:
        after = self.snap()
        return {k: round((after[k] - before[k]) / n / 1e3, 1) for k in before}


def _timed(fn: Callable[[], Any], n: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


# ---------------------------------------------------------------------------- phases


def measure_floor(channel: Any, redis_url: str, repeat: int) -> dict[str, float]:
    import redis
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    req = health_pb2.HealthCheckRequest(service="")
    grpc_s = _timed(lambda: stub.Check(req, timeout=10), repeat, warmup=max(20, repeat // 10))
    r = redis.Redis.from_url(redis_url)
    try:
        ping_s = _timed(r.ping, repeat, warmup=max(20, repeat // 10))
        # HELLO, not INFO: the allocator's ACL user (what the URL may carry) runs no INFO.
        hello = r.execute_command("HELLO", "2")
    finally:
        r.close()
    fields = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
              for k, v in zip(hello[::2], hello[1::2])}
    server, version = fields.get("server", "redis"), fields.get("version", "?")
    grpc_p50, ping_p50 = _us(percentile(grpc_s, 50)), _us(percentile(ping_s, 50))
    return {"grpc_rtt_us": grpc_p50, "grpc_rtt_p99_us": _us(percentile(grpc_s, 99)),
            "redis_ping_us": ping_p50, "redis_ping_p99_us": _us(percentile(ping_s, 99)),
            "floor_us": grpc_p50 + ping_p50, "redis_server": f"{server} {version}"}


def measure_script_call(client: Any, pool: str, epoch: int, repeat: int) -> dict[str, float]:
    """The least a step can cost: one allocator RPC whose handler runs one tiny script
    (``Heartbeat``: two HGETs, TIME and an HSET), as wall time seen by the client."""
    from kvservice.v1 import allocator_pb2 as pb

    req = pb.HeartbeatRequest(pool_id=pool, epoch=epoch)
    xs = _timed(lambda: client.stub.Heartbeat(req, timeout=10), repeat, warmup=max(20, repeat // 10))
    return {"script_rpc_us": _us(percentile(xs, 50)), "script_rpc_p99_us": _us(percentile(xs, 99))}


def measure_decode(client: Any, pool: str, sequences: int, steps: int, block_size: int,
                   rng: random.Random, cpu: CpuMeter, num_blocks: int,
                   forward_s: float = 0.0) -> tuple[list[Any], dict[str, Any]]:
    """The decode workload; returns its (still live) sequences and the figures."""
    # Prompt lengths 128 + i: every offset inside a block is held by sequences/block_size
    # sequences, so boundary crossings are spread evenly over the steps.
    lengths = [BASE_PROMPT + i for i in range(sequences)]
    seqs = []
    chunk = 64
    for i in range(0, sequences, chunk):
        creates = [([rng.randrange(TOKEN_RANGE) for _ in range(n)], pool, b"")
                   for n in lengths[i:i + chunk]]
        seqs.extend(client.step(creates=creates).created)
    assert len(seqs) == sequences

    def batch(step: int) -> dict[Any, list[int]]:
        return {s: [(step * 131 + j) % TOKEN_RANGE] for j, s in enumerate(seqs)}

    # Warm-up: one full block's worth of steps, so every sequence crosses a boundary once.
    for step in range(block_size):
        client.step(batch(step))
    batches = [batch(block_size + step) for step in range(steps)]   # the engine's work, not timed
    client.flush()
    lags0 = len(client.journal_lags())
    times, reserved = [], []
    rpcs0 = client.rpc_count
    blocks0 = sum(len(s.block_table) for s in seqs)
    cpu0 = cpu.snap()
    clock = time.perf_counter
    report_every = max(1, steps // 4)
    started = clock()
    for step, b in enumerate(batches):
        t0 = clock()
        client.step(b)
        times.append(clock() - t0)
        if forward_s:
            time.sleep(forward_s)
        if client.local:
            reserved.append(client.reserved_blocks() / num_blocks)
        if (step + 1) % report_every == 0 and step + 1 < steps:
            _progress(f"decode: {step + 1}/{steps} steps")
    rpcs = client.rpc_count - rpcs0
    wall = clock() - started
    client.flush()
    cpu_per_step = cpu.per_op_us(cpu0, steps)     # (the journal's last entries applied)
    grown = sum(len(s.block_table) for s in seqs) - blocks0
    lags = client.journal_lags()[lags0:]
    total = sum(times)
    out = {"step_p50_us": _us(percentile(times, 50)), "step_p99_us": _us(percentile(times, 99)),
           "step_mean_us": _us(total / steps), "step_max_us": _us(max(times)),
           # Every RPC of Client.step is made on the calling thread, synchronously.
           "rpcs_per_step": rpcs / steps, "sync_rpcs_per_step": rpcs / steps,
           "alloc_us_per_token": _us(total) / (steps * sequences),
           "step_cpu_us": cpu_per_step,
            "prompt_tokens_min": lengths[0], "prompt_tokens_max": lengths[-1]}
    if "client" in cpu_per_step:
        out["client_cpu_us_per_token"] = cpu_per_step["client"] / sequences
    if grown and "allocator" in cpu_per_step and "redis" in cpu_per_step:
        # What the allocator spends per block a sequence grows by: its capacity in blocks
        # per second of CPU, against what the trace asks.
        server_us = (cpu_per_step["allocator"] + cpu_per_step["redis"]) * steps / grown
        out["server_cpu_us_per_block"] = server_us
        out["blocks_per_s_asked"] = grown / wall         # (the waits of --forward-ms included)
    if client.local:
        out["journal_lag_p50_ms"] = percentile(lags, 50) * 1e3
        out["journal_lag_p99_ms"] = percentile(lags, 99) * 1e3
        out["reserved_unused_p99_share"] = percentile(reserved, 99)
    return seqs, out


def measure_inproc(sequences: int, steps: int, block_size: int, seed: int,
                   forward_s: float = 0.0) -> dict[str, float]:
    """The same decode trace through an in-process block manager (``tools/inproc.py``),
    in this process, with the same wait after each step: the reference for the
    allocator's figures."""
    from kvservice.tools.inproc import LocalBlockManager

    rng = random.Random(seed)
    lengths = [BASE_PROMPT + i for i in range(sequences)]
    per_seq = math.ceil((lengths[-1] + block_size + steps) / block_size) + 1
    manager = LocalBlockManager(sequences * per_seq, block_size)
    seqs = [manager.create([rng.randrange(TOKEN_RANGE) for _ in range(n)]) for n in lengths]

    def batch(step: int) -> dict[Any, list[int]]:
        return {s: [(step * 131 + j) % TOKEN_RANGE] for j, s in enumerate(seqs)}

    for step in range(block_size):
        manager.step(batch(step))
    batches = [batch(block_size + step) for step in range(steps)]
    times = []
    clock = time.perf_counter
    for b in batches:
        t0 = clock()
        manager.step(b)
        times.append(clock() - t0)
        if forward_s:
            time.sleep(forward_s)
    for s in seqs:
        manager.free(s)
    return {"inproc_step_p50_us": _us(percentile(times, 50)), "inproc_step_p99_us": _us(percentile(times, 99)),
            "inproc_us_per_token": _us(sum(times)) / (steps * sequences)}


def measure_lifecycle(client: Any, pool: str, repeat: int, rng: random.Random,
                      cpu: CpuMeter) -> dict[str, Any]:
    clock = time.perf_counter
    warmup = max(3, min(20, repeat // 10))

    def cold_prompt() -> list[int]:
        return [rng.randrange(TOKEN_RANGE) for _ in range(PROMPT_2K)]

    # Cold creates (no block of the prompt is cached), each freed after: the free of a
    # sequence that alone owns its 125 blocks (every one goes to the evictable set).
    def create_then_free(prompt: list[int]) -> tuple[float, float, int]:
        t0 = clock()
        seq = client.create(prompt, pool=pool)
        t1 = clock()
        seq.free()
        return t1 - t0, clock() - t1, seq.num_cached_tokens

    cold, free_owned = [], []
    prompts = [cold_prompt() for _ in range(warmup + repeat)]
    for i, prompt in enumerate(prompts):
        create_s, free_s, _ = create_then_free(prompt)
        if i >= warmup:
            cold.append(create_s)
            free_owned.append(free_s)
    _progress("create cold: done")

    # Fully cached: the same prompt, held by a live sequence.
    prompt = cold_prompt()
    holder = client.create(prompt, pool=pool)
    cached, free_shared, hit_tokens = [], [], 0
    for i in range(warmup + repeat):
        if i == warmup:
            cpu0 = cpu.snap()
        create_s, free_s, hits = create_then_free(prompt)
        if i >= warmup:
            cached.append(create_s)
            free_shared.append(free_s)
            hit_tokens = hits
    cpu_cached = cpu.per_op_us(cpu0, repeat)   # one create and one free each
    _progress("create cached: done")

    # Fork of a 2,000-token sequence (the child is freed, untimed).
    forks = []
    for i in range(warmup + repeat):
        t0 = clock()
        child = holder.fork()
        t1 = clock()
        child.free()
        if i >= warmup:
            forks.append(t1 - t0)
    holder.free()
    _progress("fork: done")

    def p(xs: list[float], q: float) -> float:
        return _us(percentile(xs, q))

    return {"create_cold_2k_us": p(cold, 50), "create_cold_2k_p99_us": p(cold, 99),
            "create_cached_2k_us": p(cached, 50), "create_cached_2k_p99_us": p(cached, 99),
            "create_cached_2k_hit_tokens": hit_tokens,
            "fork_us": p(forks, 50), "fork_p99_us": p(forks, 99),
            "free_us": p(free_owned, 50), "free_p99_us": p(free_owned, 99),
            "free_shared_2k_us": p(free_shared, 50), "create_free_cached_2k_cpu_us": cpu_cached}


# ---------------------------------------------------------------------------- report


def judge(fig: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (base, factor) in TARGETS.items():
        if name not in fig:   # (the journal's figures, with --remote)
            continue
        limit = factor * fig[base] if base is not None else factor
        target = f"<= {factor:g}x {_SHORT.get(base, base)}" if base is not None else f"<= {factor:g}"
        out[name] = {"value": fig[name], "limit": limit, "met": fig[name] <= limit, "target": target}
    return out


_SHORT = {"floor_us": "floor", "inproc_step_p99_us": "in-proc", "inproc_us_per_token": "in-proc"}


def table(fig: dict[str, Any], targets: dict[str, dict[str, Any]]) -> str:
    floor = fig["floor_us"]
    rows: list[tuple[str, str, str, str, str]] = []

    def row(label: str, key: str, unit: str = "us", ratio: bool = True) -> None:
        value = fig[key]
        text = f"{value:,.1f} {unit}" if unit else f"{value:.3f}"
        t = targets.get(key)
        rows.append((label, text, t["target"] if t else "",
                     f"{value / floor:.2f}x" if ratio else "",
                     ("pass" if t["met"] else "MISS") if t else ""))

    row("floor: gRPC round trip + Redis PING (p50)", "floor_us")
    row("  gRPC health Check round trip (p50)", "grpc_rtt_us")
    row("  Redis PING (p50)", "redis_ping_us")
    row("one RPC running one tiny script (p50)", "script_rpc_us")
    row("one RPC running one tiny script (p99)", "script_rpc_p99_us")
    row("decode step (p50)", "step_p50_us")
    row("decode step (p99)", "step_p99_us")
    row("RPCs per step", "rpcs_per_step", unit="", ratio=False)
    row("  of them synchronous (on the calling thread)", "sync_rpcs_per_step", unit="", ratio=False)
    row("allocator time per generated token", "alloc_us_per_token", ratio=False)
    if "client_cpu_us_per_token" in fig:
        row("  client CPU per generated token", "client_cpu_us_per_token", ratio=False)
    if "journal_lag_p50_ms" in fig:
        row("journal lag, local change -> applied (p50)", "journal_lag_p50_ms", unit="ms", ratio=False)
        row("journal lag, local change -> applied (p99)", "journal_lag_p99_ms", unit="ms", ratio=False)
        row("reserved but unused blocks / pool (p99)", "reserved_unused_p99_share", unit="", ratio=False)
    if "server_cpu_us_per_block" in fig:
        row("allocator + Redis CPU per block grown", "server_cpu_us_per_block", ratio=False)
    row("in-process block manager: step (p50)", "inproc_step_p50_us")
    row("in-process block manager: step (p99)", "inproc_step_p99_us")
    row("in-process block manager: time per token", "inproc_us_per_token", ratio=False)
    row("create, 2,000-token prompt, cold (p50)", "create_cold_2k_us")
    row("create, 2,000-token prompt, cached (p50)", "create_cached_2k_us")
    row("fork of a 2,000-token sequence (p50)", "fork_us")
    row("free of a 2,000-token sequence (p50)", "free_us")
    head = ("figure", "value", "target", "/ floor", "")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [head, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def run(target: str, redis_url: str, args: argparse.Namespace, cpu: CpuMeter) -> dict[str, Any]:
    from kvservice.client import Client

    rng = random.Random(20240607)
    tag = uuid.uuid4().hex[:8]
    pool = f"bench-{tag}"
    bs = args.block_size
    per_seq = math.ceil((BASE_PROMPT + args.sequences + bs + args.steps) / bs) + 2
    per_2k = math.ceil(PROMPT_2K / bs) + 1
    num_blocks = args.sequences * per_seq + (args.repeat + 30) * per_2k * 2 + 1024
    fig: dict[str, Any] = {}
    with Client(target, tenant=f"bench-{tag}", lease_ttl=60.0, local=not args.remote) as client:
        epoch = client.register_pool(pool, num_blocks=num_blocks, block_size=bs).epoch
        _progress(f"floor: {args.repeat} gRPC round trips and Redis PINGs")
        fig.update(measure_floor(client.channel, redis_url, args.repeat))
        fig.update(measure_script_call(client, pool, epoch, args.repeat))
        _progress(f"in-process reference: the same {args.sequences} x {args.steps} decode trace")
        fig.update(measure_inproc(args.sequences, args.steps, bs, seed=20240608,
                                  forward_s=getattr(args, "forward_ms", 0.0) / 1e3))
        _progress(f"decode: {args.sequences} sequences x {args.steps} steps, block size {bs}")
        live, decode = measure_decode(client, pool, args.sequences, args.steps, bs, rng, cpu, num_blocks,
                                      getattr(args, "forward_ms", 0.0) / 1e3)
        fig.update(decode)
        # The lifecycle figures are taken in a busy pool, the decode sequences still live,
        # as in an engine that admits requests while it decodes (see docs/benchmark.md).
        _progress(f"create / fork / free of 2,000-token sequences: {args.repeat} samples each")
        fig.update(measure_lifecycle(client, pool, args.repeat, rng, cpu))
        t0 = time.perf_counter()
        client.step(frees=live)
        fig["decode_free_all_us"] = _us(time.perf_counter() - t0)
        audit = client.audit(pool)
        fig["audit_ok"] = bool(audit.ok)
    return fig


def _embedded_redis_pid(parent: int) -> int:
    """The pid of the allocator's embedded Redis: its child process running a Redis
    server (0 if none)."""
    try:
        children = []
        for task in os.listdir(f"/proc/{parent}/task"):
            with open(f"/proc/{parent}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
        for pid in children:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() in ("redis-server", "valkey-server"):
                    return pid
    except (OSError, ValueError):
        pass
    return 0


def main(args: argparse.Namespace) -> int:
    for name in ("sequences", "steps", "repeat"):
        if getattr(args, name) < 1:
            print(f"kvservice bench: --{name} must be >= 1", file=sys.stderr)
            return 2
    if getattr(args, "forward_ms", 0.0) < 0:
        print("kvservice bench: --forward-ms must be >= 0", file=sys.stderr)
        return 2
    if args.target and not args.redis_url:
        print("kvservice bench: --target needs --redis-url (the allocator's Redis, for the PING floor)",
              file=sys.stderr)
        return 2
    from kvservice.errors import KvsError
    from kvservice.tools.launcher import AllocatorProcess

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        pids = {"client": os.getpid()}
        if args.target:
            target, redis_url, mode = args.target, args.redis_url, "running allocator"
        else:
            _progress("starting " + ("an allocator process" if args.redis_url else
                                     "an allocator process with an embedded Redis"))
            proc = stack.enter_context(AllocatorProcess(args.redis_url or None))
            target, redis_url = proc.target, proc.url
            mode = "allocator process, " + ("given Redis" if args.redis_url else "embedded Redis")
            pids["allocator"] = proc.proc.pid if proc.proc else 0
            if not args.redis_url:
                pids["redis"] = _embedded_redis_pid(pids["allocator"])
        try:
            if getattr(args, "long", False):
                return _long_main(target, CpuMeter(pids), args, mode, started)
            fig = run(target, redis_url, args, CpuMeter(pids))
        except KvsError as exc:
            print(f"kvservice bench: the allocator refused: {exc}", file=sys.stderr)
            return 1
    fig = {k: (round(v, 4 if k.endswith(("rpcs_per_step", "_share")) else 2 if k.endswith("per_token") else 1)
               if isinstance(v, float) else v) for k, v in fig.items()}
    fig["elapsed_s"] = round(time.perf_counter() - started, 2)
    targets = judge(fig)
    fig["targets"] = targets
    fig["targets_met"] = all(t["met"] for t in targets.values())
    fig["config"] = {"sequences": args.sequences, "steps": args.steps, "block_size": args.block_size,
                     "forward_ms": getattr(args, "forward_ms", 0.0),
                     "repeat": args.repeat, "mode": mode, "cpus": os.cpu_count(),
                     "python": platform.python_version()}
    if args.json:
        print(json.dumps(fig, indent=2))
    else:
        print(f"kvservice bench: {mode} ({fig['redis_server']}), {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}")
        print(f"decode: {args.sequences} sequences x {args.steps} steps (one Client.step each), block size "
              f"{args.block_size}, staggered prompts of {fig['prompt_tokens_min']}..{fig['prompt_tokens_max']} "
              f"tokens (block-boundary crossings spread evenly over the steps); "
              f"{args.repeat} samples per latency\n")
        print(table(fig, targets))
        for key, what in (("step_cpu_us", "decode step"),
                          ("create_free_cached_2k_cpu_us", "cached 2,000-token create + free")):
            if fig.get(key):
                print(f"\nCPU time per {what}: " +
                      ", ".join(f"{k} {v:,.0f} us" for k, v in fig[key].items()) +
                      f" (sum {sum(fig[key].values()):,.0f} us)", end="")
        print()
        met = sum(t["met"] for t in targets.values())
        print(f"\ntargets met: {met}/{len(targets)}; audit {'ok' if fig['audit_ok'] else 'FAILED'}; "
              f"{fig['elapsed_s']:.1f} s")
    return 0 if fig["audit_ok"] else 1


def _long_main(target: str, cpu: CpuMeter, args: argparse.Namespace, mode: str, started: float) -> int:
    """``--long``: the long-sequence figures alone (``kvservice.tools.bench_long``)."""
    from kvservice.tools.bench_long import long_table, measure_long

    fig = measure_long(target, cpu, _progress, tenant=f"bench-{uuid.uuid4().hex[:8]}")
    fig = {k: round(v, 2) if isinstance(v, float) else v for k, v in fig.items()}
    fig["elapsed_s"] = round(time.perf_counter() - started, 2)
    fig["config"] = {"mode": mode, "cpus": os.cpu_count(), "python": platform.python_version()}
    if args.json:
        print(json.dumps(fig, indent=2))
    else:
        print(f"kvservice bench --long: {mode}, {os.cpu_count()} CPUs, Python {platform.python_version()}\n")
        print(long_table(fig))
        met = sum(t["met"] for t in fig["targets"].values())
        print(f"\ntargets met: {met}/{len(fig['targets'])}; audit {'ok' if fig['audit_ok'] else 'FAILED'}; "
              f"{fig['elapsed_s']:.1f} s")
    return 0 if fig["audit_ok"] else 1
