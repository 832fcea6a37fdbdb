"""``kvservice many-pools``: what many registered pools cost, measured on a private Redis.

On an embedded Redis, with real allocator processes (``kvservice serve``) and the SDK
(progress on stderr):

1. **Scaling.** Pools are registered in three steps (a quarter of ``--pools``, half, all);
   at each size, ``ListPools`` (the SDK's ``Client.pools()``, every page) and the audit
   (``run_audit``, what ``kvservice audit`` runs) are timed. They scale linearly when the
   time per pool at the full size is within ``LINEAR_SLACK`` of the time per pool at a
   quarter of it.
2. **An idle replica.** A second allocator process starts once every pool is registered
   and serves nothing: its CPU (user + system, from ``/proc``) over ``--idle-seconds``,
   against ``TARGET_IDLE_CPU`` of one core. What it does meanwhile is its reaper's
   sweeps (docs/allocator.md, "Leases").
3. **Redis stalls.** A workload in one pool among them for ``--load-seconds`` (a local-mode
   and a remote-mode client creating, stepping, forking and freeing sequences). Redis's
   SLOWLOG logs every script call (EVALSHA) of the whole run that took over ``SLOW_US``
   (Redis's own time for it, on a core of its own where there are two or more: ``_pin``);
   the longest of each script, against the ~10 ms bound (``limits.TARGET_MS``), and the
   mean of them all (``INFO commandstats``).

Usage::

    kvservice many-pools [--pools 2000] [--idle-seconds 10] [--load-seconds 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from typing import Any

#: An idle replica's share of one core, at most.
TARGET_IDLE_CPU = 0.05
#: Linear: the time per pool at the full size is at most this many times the time per pool
#: at a quarter of it.
LINEAR_SLACK = 1.5
#: SLOWLOG entries kept between two reads.
SLOWLOG_LEN = 100_000
#: Commands slower than this are logged (µs). Logging every command would make Redis
#: allocate for each one, and those allocations stall it for milliseconds now and then.
SLOW_US = 1000
BLOCK_SIZE = 16
#: Blocks per pool (never-used blocks cost Redis nothing: ``state.fresh``).
NUM_BLOCKS = 4096


def progress(msg: str) -> None:
    print(f"[many-pools] {msg}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class SlowLog:
    """The script calls (EVALSHA) that Redis timed above ``SLOW_US``, per script: how many
    and the longest; and every script call's count and mean time (``INFO commandstats``).
    ``take`` reads and clears the log."""

    def __init__(self, r: Any) -> None:
        from kvservice.allocator import lua

        self.r = r
        r.config_set("slowlog-log-slower-than", SLOW_US)
        r.config_set("slowlog-max-len", SLOWLOG_LEN)
        r.slowlog_reset()
        r.config_resetstat()
        self.names = {r.script_load(script.source): name for name, script in lua.SCRIPTS.items()}
        self.slow_ms: dict[str, list[float]] = {}

    def take(self) -> None:
        for entry in self.r.slowlog_get(SLOWLOG_LEN):
            command = entry["command"]
            parts = (command if isinstance(command, bytes) else str(command).encode()).split(maxsplit=2)[:2]
            parts = [part.decode("ascii", "replace") for part in parts]
            if len(parts) == 2 and parts[0].upper() == "EVALSHA" and parts[1] in self.names:
                self.slow_ms.setdefault(self.names[parts[1]], []).append(entry["duration"] / 1000)
        self.r.slowlog_reset()

    def figures(self) -> dict[str, Any]:
        """Script calls in all, their mean (ms), and per script the calls above ``SLOW_US``
        and the longest (ms)."""
        stats = self.r.info("commandstats").get("cmdstat_evalsha", {"calls": 0, "usec_per_call": 0.0})
        return {"calls": int(stats["calls"]), "mean_ms": float(stats["usec_per_call"]) / 1000,
                "slow": {name: {"calls": len(times), "max_ms": max(times)} for name, times in self.slow_ms.items()}}


def _audit_seconds(url: str) -> tuple[float, int]:
    """The audit of every pool (``kvservice audit``'s ``run_audit``): seconds, problems."""
    from kvservice.allocator.audit import run_audit
    from kvservice.allocator.core import Allocator
    from kvservice.allocator.store import Store, connect

    async def run() -> tuple[float, int]:
        store = Store(connect(url))
        try:
            start = time.perf_counter()
            problems, _ = await run_audit(Allocator(store))
            return time.perf_counter() - start, len(problems)
        finally:
            await store.close()
    return asyncio.run(run())


def _workload(client: Any, pool: str, seconds: float, seed: int) -> int:
    """Creates, steps, forks and frees sequences in ``pool`` for ``seconds``; returns the
    operations done."""
    from kvservice import errors

    rng = random.Random(seed)
    live: list[Any] = []
    ops = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        r = rng.random()
        try:
            if r < 0.2 or not live:
                live.append(client.create([rng.randrange(50_000) for _ in range(rng.randrange(8, 200))], pool=pool))
            elif r < 0.3 and len(live) < 16:
                live.append(rng.choice(live).fork())
            elif r < 0.45 or len(live) > 24 or max(s.num_tokens for s in live) > 1000:
                live.pop(max(range(len(live)), key=lambda i: live[i].num_tokens)).free()
            else:
                client.step({s: [rng.randrange(50_000) for _ in range(rng.randrange(1, 20))] for s in live})
        except errors.ResourceExhausted:
            live.pop(0).free()        # (the other client holds the rest: make room)
        ops += 1
    for s in live:
        s.free()
    client.flush()
    return ops


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import redis

    from kvservice.allocator.embedded import EmbeddedRedis
    from kvservice.tools.launcher import AllocatorProcess

    sizes = sorted({max(1, args.pools // 4), max(1, args.pools // 2), args.pools})
    out: dict[str, Any] = {"pools": args.pools, "sizes": []}
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            out["redis_cpus"] = _pin(int(r.info("server")["process_id"]))
            with AllocatorProcess(server.url) as allocator:
                _measure(args, out, sizes, server, r, allocator)
        finally:
            r.close()
            if mine is not None:
                os.sched_setaffinity(0, mine)
    return out


def _pin(redis_pid: int) -> list[int]:
    """Redis on a core of its own, this process and its children (the allocators) on the
    others, where there are two or more: a script's time in the SLOWLOG is wall-clock time,
    which would count the moments the OS gave Redis's core to another process. Returns
    Redis's cores (every core: not pinned)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if len(cpus) < 2:
        return cpus
    os.sched_setaffinity(redis_pid, {cpus[0]})
    os.sched_setaffinity(0, set(cpus[1:]))
    return cpus[:1]


def _measure(args: argparse.Namespace, out: dict[str, Any], sizes: list[int], server: Any, r: Any,
             allocator: Any) -> None:
    from kvservice.client import Client
    from kvservice.tools.launcher import AllocatorProcess

    slow = SlowLog(r)
    with Client(allocator.target, tenant="many-pools", keepalive=False) as admin:
        registered = 0
        for size in sizes:
            progress(f"registering pools {registered}..{size - 1}")
            start = time.perf_counter()
            for i in range(registered, size):
                admin.register_pool(f"pool-{i:05d}", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
            register_s = time.perf_counter() - start
            registered = size
            slow.take()
            start = time.perf_counter()
            listed = len(admin.pools())
            list_s = time.perf_counter() - start
            assert listed == size, f"ListPools gave {listed} pools of {size}"
            slow.take()
            progress(f"{size} pools: ListPools {list_s:.2f} s; auditing")
            audit_s, problems = _audit_seconds(server.url)
            slow.take()
            out["sizes"].append({"pools": size, "register_s": register_s, "list_pools_s": list_s,
                                 "audit_s": audit_s, "audit_problems": problems})
            progress(f"{size} pools: audit {audit_s:.2f} s, {problems} problem(s)")
    with AllocatorProcess(server.url) as idle:
        time.sleep(1.0)            # (started: its first sweeps are spread over --reap-recheck)
        progress(f"an idle replica over {args.pools} pools, {args.idle_seconds:.0f} s")
        cpu0, t0 = cpu_seconds(idle.proc.pid), time.monotonic()
        time.sleep(args.idle_seconds)
        out["idle_cpu"] = (cpu_seconds(idle.proc.pid) - cpu0) / (time.monotonic() - t0)
    slow.take()
    progress(f"a workload in one pool among {args.pools}, {args.load_seconds:.0f} s")
    pool = f"pool-{args.pools // 2:05d}"
    with Client(allocator.target, tenant="load-local", local=True) as local, \
            Client(allocator.target, tenant="load-remote") as remote:
        done: list[int] = []
        threads = [threading.Thread(target=lambda c=c, i=i: done.append(_workload(c, pool, args.load_seconds, i)))
                   for i, c in enumerate((local, remote))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    out["load_ops"] = sum(done)
    slow.take()
    out["scripts"] = slow.figures()


def verdicts(fig: dict[str, Any]) -> dict[str, bool]:
    from kvservice.tools.limits import TARGET_MS

    first, last = fig["sizes"][0], fig["sizes"][-1]

    def per_pool(row: dict[str, Any], key: str) -> float:
        return row[key] / row["pools"]

    return {
        "idle_cpu": fig["idle_cpu"] <= TARGET_IDLE_CPU,
        "scripts_within_bound": max((x["max_ms"] for x in fig["scripts"]["slow"].values()), default=0.0) <= TARGET_MS,
        "list_pools_linear": per_pool(last, "list_pools_s") <= LINEAR_SLACK * per_pool(first, "list_pools_s"),
        "audit_linear": per_pool(last, "audit_s") <= LINEAR_SLACK * per_pool(first, "audit_s"),
        "audit_clean": all(row["audit_problems"] == 0 for row in fig["sizes"]),
    }


def report(fig: dict[str, Any]) -> str:
    from kvservice.tools.limits import TARGET_MS

    lines = ["| pools | register (s) | ListPools (s) | per pool (µs) | audit (s) | per pool (µs) |",
             "|---|---|---|---|---|---|"]
    for row in fig["sizes"]:
        n = row["pools"]
        lines.append(f"| {n:,} | {row['register_s']:.2f} | {row['list_pools_s']:.2f} | "
                     f"{row['list_pools_s'] / n * 1e6:,.0f} | {row['audit_s']:.2f} | {row['audit_s'] / n * 1e6:,.0f} |")
    lines += ["", f"An idle replica over {fig['pools']:,} pools: {fig['idle_cpu']:.2%} of a core "
                  f"(target ≤ {TARGET_IDLE_CPU:.0%}).", "",
              f"Script calls over the whole run, as Redis timed them ({fig['load_ops']:,} operations of the "
              f"workload in one pool): {fig['scripts']['calls']:,}, {fig['scripts']['mean_ms']:.3f} ms on "
              f"average. Those over {SLOW_US / 1000:g} ms (target: the longest ≤ {TARGET_MS:.0f} ms):", "",
              "| script | calls over " f"{SLOW_US / 1000:g} ms | longest (ms) |", "|---|---|---|"]
    slow = fig["scripts"]["slow"]
    for name in sorted(slow, key=lambda n: -slow[n]["max_ms"]):
        lines.append(f"| {name} | {slow[name]['calls']:,} | {slow[name]['max_ms']:.2f} |")
    if not slow:
        lines.append("| (none) | 0 | |")
    lines.append("")
    lines += [f"{'met' if ok else 'MISSED'}: {name}" for name, ok in fig["verdicts"].items()]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pools", type=int, default=2000, help="pools to register (default 2000)")
    p.add_argument("--idle-seconds", type=float, default=10.0,
                   help="how long the idle replica's CPU is measured (default 10)")
    p.add_argument("--load-seconds", type=float, default=5.0,
                   help="how long the workload in one pool runs (default 5)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def main(args: argparse.Namespace) -> int:
    if args.pools < 4 or args.idle_seconds <= 0 or args.load_seconds <= 0:
        print("kvservice many-pools: --pools must be at least 4, --idle-seconds and --load-seconds positive",
              file=sys.stderr)
        return 2
    fig = measure(args)
    fig["verdicts"] = verdicts(fig)
    print(json.dumps(fig, indent=2) if args.json else report(fig))
    return 0
