"""``kvservice shards``, parts 2 and 4: the step script driven on one shard from
concurrent callers, through ``Store`` as the allocator calls it (a decode step's payload:
every sequence grows a block and commits the one it filled), for the shard's ceiling at
100% of one core; and the same calls with and without ``WAIT``, for what it costs."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvservice.tools.bench import percentile

BLOCK_SIZE = 16
TOKEN_RANGE = 32000
#: (part 2) A caller frees its oldest sequence and creates one every this many calls.
RETIRE_EVERY = 4
#: (part 2) Pools on the measured shard (the callers are spread over them).
SINGLE_POOLS = 4
#: (part 2) The warm-up lasts until the callers have grown their sequences by this many
#: times the blocks of the shard's pools, or this many seconds.
WARM_UP_TURNS = 1.5
WARM_UP_MAX_S = 10.0
#: (part 4) WAIT for this many replicas, at most this many ms, after each step-script call.
WAIT_REPLICAS = 1
WAIT_TIMEOUT_MS = 1000
#: (part 4) Rounds: in each, one caller, then the concurrent callers, through each store in turn.
WAIT_ROUNDS = 4
#: (part 4) The stores compared: without WAIT, with it.
MODES = ("no_wait", "wait")


def progress(msg: str) -> None:
    print(f"[shards] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- Redis figures


@dataclass(slots=True)
class NodeStats:
    """What one Redis node has counted since it started."""

    script_calls: int     # EVALSHA + EVAL (executions, failed ones included)
    failed_calls: int
    script_usec: int      # time inside those commands (commandstats)
    cpu_s: float          # used_cpu_user + used_cpu_sys
    keys: int

    def minus(self, before: "NodeStats") -> "NodeStats":
        return NodeStats(self.script_calls - before.script_calls, self.failed_calls - before.failed_calls,
                         self.script_usec - before.script_usec, self.cpu_s - before.cpu_s, self.keys - before.keys)


def node_stats(admin: Any) -> NodeStats:
    """``admin``: a (sync) redis-py client of one node, allowed INFO and DBSIZE."""
    commands = admin.info("commandstats")
    cpu = admin.info("cpu")
    calls = failed = usec = 0
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        c = commands.get(name, {})
        calls += int(c.get("calls", 0))
        failed += int(c.get("failed_calls", 0))
        usec += int(c.get("usec", 0))
    return NodeStats(calls, failed, usec, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
                     int(admin.dbsize()))


def own_slots(admin: Any) -> list[tuple[int, int]]:
    """The slot ranges a node holds (its own line of CLUSTER NODES)."""
    for line in admin.execute_command("CLUSTER", "NODES").splitlines():
        parts = line.split()
        if len(parts) > 2 and "myself" in parts[2].split(","):
            ranges = []
            for r in parts[8:]:
                if r.startswith("["):          # (a slot being migrated)
                    continue
                lo, _, hi = r.partition("-")
                ranges.append((int(lo), int(hi or lo)))
            return ranges
    return []


def pool_slot(pool_id: str) -> int:
    from redis.crc import key_slot

    from kvservice.allocator.keys import pool_key

    return key_slot(pool_key(pool_id, "meta").encode())


# ---------------------------------------------------------------------------- 2. one shard


@dataclass(slots=True)
class _Seq:
    """A driven sequence, as the SDK keeps it: its id, its full table (``num_blocks``
    blocks of ``BLOCK_SIZE`` tokens, filled locally), its committed blocks and last hash."""

    sequence_id: str
    num_blocks: int
    num_committed_blocks: int
    last_hash: bytes


class _Caller:
    """One caller of the step script (parts 2 and 4): ``k`` live sequences in ``pool``
    under ``lease``; each call grows every one by a block and commits the block each
    filled (the decode payload); every ``RETIRE_EVERY``-th call the oldest is freed instead
    and a sequence created (a 4-block prompt). Its sequences outlive a ``run``, so that
    the next run (through another allocator, in part 4) goes on with them."""

    def __init__(self, pool: str, lease: str, k: int, rng: random.Random) -> None:
        self.pool, self.lease, self.k, self.rng = pool, lease, k, rng
        self.seqs: list[_Seq] = []
        self.call = 0

    def _prompt(self) -> tuple[int, ...]:
        return tuple(self.rng.randrange(TOKEN_RANGE) for _ in range(4 * BLOCK_SIZE))

    @staticmethod
    def _born(state: Any) -> _Seq:
        return _Seq(state.sequence_id, len(state.block_table), state.num_committed_blocks, state.last_hash)

    async def start(self, a: Any) -> None:
        from kvservice.allocator.domain import Create

        out = await a.step(self.lease, [], [Create(self._prompt(), self.pool) for _ in range(self.k)])
        self.seqs = [self._born(s) for s in out.created]

    async def turn(self, a: Any) -> int:
        """One step call through ``a``; returns how many sequences it grew."""
        from kvservice.allocator.domain import Commit, Create, Update

        self.call += 1
        retire = self.call % RETIRE_EVERY == 0
        seqs = self.seqs
        grown = seqs[1:] if retire else seqs
        updates = []
        for s in grown:
            n = s.num_blocks * BLOCK_SIZE
            commits = tuple(Commit(i, (i % TOKEN_RANGE,) * BLOCK_SIZE) for i in range(s.num_committed_blocks,
                                                                                      s.num_blocks))
            updates.append(Update(s.sequence_id, n, s.last_hash, commits, grow_to=n + 1))
        if retire:
            updates.append(Update(seqs[0].sequence_id, free=True))
        out = await a.step(self.lease, updates, [Create(self._prompt(), self.pool)] if retire else [])
        for s, d in zip(grown, out.updates):
            s.num_blocks += len(d.new_blocks)
            s.num_committed_blocks, s.last_hash = d.num_committed_blocks, d.last_hash
        if retire:
            self.seqs = grown + [self._born(out.created[0])]
        return len(grown)

    async def drop(self, a: Any) -> None:
        """Frees its sequences through ``a``, one at a time (after a call whose outcome it
        did not get: it may have freed one of them already)."""
        from kvservice import errors
        from kvservice.allocator.domain import Update

        for s in self.seqs:
            try:
                await a.step(self.lease, [Update(s.sequence_id, free=True)], [])
            except errors.NotFound:
                pass
        self.seqs = []

    async def run(self, a: Any, stop: asyncio.Event, counts: dict[str, int], latencies: list[float] | None = None,
                  cleanup: Any = None) -> None:
        """Calls through ``a`` until ``stop``, counting in ``counts`` ("calls" and "grown";
        "starts": the calls that created its sequences; "short": the calls a ``WAIT`` fell
        short in, after which it frees its sequences through ``cleanup`` and starts anew);
        each call's seconds appended to ``latencies``."""
        from kvservice import errors

        while not stop.is_set():
            t = time.perf_counter()
            try:
                if not self.seqs:
                    await self.start(a)
                    counts["starts"] = counts.get("starts", 0) + 1
                    continue
                grown = await self.turn(a)
            except errors.Unavailable as exc:
                if cleanup is None or "redis_wait_replicas" not in str(exc):
                    raise
                counts["short"] = counts.get("short", 0) + 1
                await self.drop(cleanup)
                continue
            if latencies is not None:
                latencies.append(time.perf_counter() - t)
            counts["calls"] += 1
            counts["grown"] += grown


async def _stopped(stop: asyncio.Event, tasks: list[asyncio.Task], who: str) -> None:
    """Stops the callers and waits for them; raises the first one's failure."""
    stop.set()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [r for r in done if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"{who} failed: {failed[0]!r}") from failed[0]


async def _drive(a: Any, pool: str, lease: str, k: int, rng: random.Random, stop: asyncio.Event,
                 counts: dict[str, int]) -> None:
    """One caller of part 2 (``_Caller``) until ``stop``."""
    await _Caller(pool, lease, k, rng).run(a, stop, counts)


async def _single_shard(url: str, pools: list[str], admin: Any, args: argparse.Namespace) -> dict[str, Any]:
    from kvservice.allocator.core import Allocator
    from kvservice.allocator.store import Store, connect
    from kvservice.common.geometry import Geometry

    store = Store(connect(url, max_connections=args.callers + 8, cluster=True))
    try:
        a = Allocator(store)
        for p in pools:
            await a.register_pool(p, Geometry(args.pool_blocks, BLOCK_SIZE, 1, 1, 8, "float16"))
        leases = [(await a.grant_lease(f"single-{i}", 120.0)).lease_id for i in range(args.callers)]
        stop = asyncio.Event()
        counts = {"calls": 0, "grown": 0}
        rng = random.Random(7)
        tasks = [asyncio.create_task(_drive(a, pools[i % len(pools)], lease, args.sequences_per_call, rng, stop,
                                            counts)) for i, lease in enumerate(leases)]
        try:
            # Warm-up, until the pools are in their steady state: every block was handed out
            # once and more, so that each new block evicts a cached one (as in a pool that
            # has served a while), whose cost differs from a never-used block's.
            started = time.perf_counter()
            while counts["grown"] < WARM_UP_TURNS * len(pools) * args.pool_blocks \
                    and time.perf_counter() - started < WARM_UP_MAX_S:
                await asyncio.sleep(0.1)
            warm_up = time.perf_counter() - started
            # NOTE: node_stats is a blocking call: no caller runs while it reads, so the
            # shard's counters and the callers' agree (but for the calls in flight).
            before, driven0, t0 = node_stats(admin), dict(counts), time.perf_counter()
            await asyncio.sleep(args.single_seconds)
            after, driven1, wall = node_stats(admin), dict(counts), time.perf_counter() - t0
        finally:
            await _stopped(stop, tasks, "a step caller")
        for lease in leases:
            await a.revoke_lease(lease)
    finally:
        await store.close()
    d = after.minus(before)
    calls = driven1["calls"] - driven0["calls"]
    grown = driven1["grown"] - driven0["grown"]
    cpu_per_call = d.cpu_s / d.script_calls if d.script_calls else 0.0
    return {"callers": args.callers, "seconds": wall, "warm_up_s": warm_up, "pool_blocks": args.pool_blocks,
            "sequence_blocks_max": 4 + args.sequences_per_call * RETIRE_EVERY,
            "script_calls": d.script_calls, "step_calls": calls,
            "failed_calls": d.failed_calls, "calls_per_s": d.script_calls / wall,
            "sequences_per_call": grown / calls if calls else 0.0,
            "tokens_per_call": grown * BLOCK_SIZE / calls if calls else 0.0,
            "redis_cpu_s": d.cpu_s, "redis_cpu_share": d.cpu_s / wall,
            "cpu_us_per_call": cpu_per_call * 1e6,
            "script_us_per_call": d.script_usec / d.script_calls if d.script_calls else 0.0,
            "ceiling_calls_per_s": 1 / cpu_per_call if cpu_per_call else 0.0}


def measure_single_shard(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Part 2 on the first primary of ``cluster``."""
    import redis

    node = cluster.nodes[cluster.primaries()[0]]
    admin = redis.Redis(host="127.0.0.1", port=node.port, decode_responses=True, socket_timeout=10)
    try:
        ranges = own_slots(admin)
        pools, i = [], 0
        while len(pools) < SINGLE_POOLS:
            name = f"single-{i}"
            if any(lo <= pool_slot(name) <= hi for lo, hi in ranges):
                pools.append(name)
            i += 1
        progress(f"one shard (127.0.0.1:{node.port}): {args.callers} callers x {args.sequences_per_call} "
                  f"sequences per step call, {args.single_seconds:g} s")
        out = asyncio.run(_single_shard(cluster.url, pools, admin, args))
    finally:
        admin.close()
    out["shard"] = f"127.0.0.1:{node.port}"
    out["pools"] = len(pools)
    return out


# ---------------------------------------------------------------------------- 4. WAIT


def _wait_commands(admin: Any) -> int:
    return int(admin.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


async def _wait_cost(url: str, pools: list[str], admin: Any, replica_admin: Any,
                     args: argparse.Namespace) -> dict[str, Any]:
    from kvservice.allocator.core import Allocator
    from kvservice.allocator.store import Store, connect
    from kvservice.common.geometry import Geometry

    stores = {"no_wait": Store(connect(url, max_connections=args.callers + 8, cluster=True)),
              "wait": Store(connect(url, max_connections=args.callers + 8, cluster=True),
                            wait_replicas=WAIT_REPLICAS, wait_timeout_ms=WAIT_TIMEOUT_MS)}
    try:
        allocators = {m: Allocator(st) for m, st in stores.items()}
        plain = allocators["no_wait"]      # (the setup and the clean-up: no WAIT)
        for p in pools:
            await plain.register_pool(p, Geometry(args.pool_blocks, BLOCK_SIZE, 1, 1, 8, "float16"))
        leases = [(await plain.grant_lease(f"wait-{i}", 120.0)).lease_id for i in range(args.callers)]
        rng = random.Random(11)
        callers = [_Caller(pools[i % len(pools)], lease, args.sequences_per_call, rng)
                   for i, lease in enumerate(leases)]
        counts = {m: {"calls": 0, "grown": 0, "starts": 0, "short": 0} for m in MODES}
        waits0 = _wait_commands(admin)

        async def phase(mode: str, group: list[_Caller], seconds: float,
                        latencies: list[float] | None = None) -> tuple[int, float, float]:
            """``group`` calling through ``mode``'s allocator for ``seconds``: the calls
            made in that time, the time, and the time until the calls in flight ended."""
            stop, c = asyncio.Event(), counts[mode]
            before = c["calls"]
            tasks = [asyncio.create_task(x.run(allocators[mode], stop, c, latencies, cleanup=plain)) for x in group]
            t0 = time.perf_counter()
            try:
                await asyncio.wait(tasks, timeout=seconds)
                calls, wall = c["calls"] - before, time.perf_counter() - t0
            finally:
                await _stopped(stop, tasks, f"a step caller ({mode})")
            return calls, wall, time.perf_counter() - t0

        # Warm-up: both allocators in turn (each opens its connections) until the pools
        # are in their steady state, as in part 2.
        started = time.perf_counter()
        while sum(c["grown"] for c in counts.values()) < WARM_UP_TURNS * len(pools) * args.pool_blocks \
                and time.perf_counter() - started < WARM_UP_MAX_S:
            for m in MODES:
                await phase(m, callers, 0.25)
        warm_up = time.perf_counter() - started

        each = args.wait_seconds / (WAIT_ROUNDS * 2 * len(MODES))
        latencies: dict[str, list[float]] = {m: [] for m in MODES}
        driven = {m: {"calls": 0, "seconds": 0.0, "cpu_s": 0.0, "script_calls": 0, "full_s": 0.0,
                      "replica_cpu_s": 0.0, "client_cpu_s": 0.0} for m in MODES}
        t0 = time.perf_counter()
        for r in range(WAIT_ROUNDS):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for m in order:                                  # (a) one caller at a time
                await phase(m, callers[:1], each, latencies[m])
            for m in order:                                  # (b) the concurrent callers
                # (node_stats blocks: no caller runs while it reads)
                before, replica0, client0 = node_stats(admin), node_stats(replica_admin), time.process_time()
                calls, wall, full = await phase(m, callers, each)
                client = time.process_time() - client0
                d, dr = node_stats(admin).minus(before), node_stats(replica_admin).minus(replica0)
                driven[m]["replica_cpu_s"] += dr.cpu_s
                driven[m]["client_cpu_s"] += client
                driven[m]["calls"] += calls
                driven[m]["seconds"] += wall
                driven[m]["full_s"] += full
                driven[m]["cpu_s"] += d.cpu_s
                driven[m]["script_calls"] += d.script_calls
        measured = time.perf_counter() - t0
        for c in callers:
            await c.drop(plain)
        waits = _wait_commands(admin) - waits0
        for lease in leases:
            await plain.revoke_lease(lease)
    finally:
        for st in stores.values():
            await st.close()
    out: dict[str, Any] = {}
    for m in MODES:
        lat, dr = latencies[m], driven[m]
        out[m] = {"latency_calls": len(lat), "p50_us": percentile(lat, 50) * 1e6 if lat else 0.0,
                  "p99_us": percentile(lat, 99) * 1e6 if lat else 0.0,
                  "mean_us": sum(lat) / len(lat) * 1e6 if lat else 0.0,
                  "concurrent_calls": dr["calls"], "concurrent_seconds": dr["seconds"],
                  "calls_per_s": dr["calls"] / dr["seconds"] if dr["seconds"] else 0.0,
                  "cpu_us_per_call": dr["cpu_s"] / dr["script_calls"] * 1e6 if dr["script_calls"] else 0.0,
                  # (over the phases and the ends of their calls in flight, as the CPU is)
                  "redis_cpu_share": dr["cpu_s"] / dr["full_s"] if dr["full_s"] else 0.0,
                  "ceiling_calls_per_s": dr["script_calls"] / dr["cpu_s"] if dr["cpu_s"] else 0.0,
                  "replica_cpu_us_per_call": dr["replica_cpu_s"] / dr["script_calls"] * 1e6
                  if dr["script_calls"] else 0.0,
                  # this process: the callers, the allocator's step code and redis-py
                  "client_cpu_us_per_call": dr["client_cpu_s"] / dr["script_calls"] * 1e6
                  if dr["script_calls"] else 0.0,
                  # every step call it made in this part: warm-up, calls creating sequences,
                  # and those a WAIT fell short in included
                  "step_calls": counts[m]["calls"] + counts[m]["starts"] + counts[m]["short"],
                  "shortfalls": counts[m]["short"]}
    nw, w = out["no_wait"], out["wait"]
    out.update({"wait_replicas": WAIT_REPLICAS, "wait_timeout_ms": WAIT_TIMEOUT_MS, "rounds": WAIT_ROUNDS,
                "phase_s": each, "seconds": measured, "warm_up_s": warm_up, "callers": args.callers,
                "pools": len(pools), "pool_blocks": args.pool_blocks,
                "wait_calls": w["step_calls"], "wait_commands": waits, "shortfalls": w["shortfalls"],
                "added_p50_us": w["p50_us"] - nw["p50_us"], "added_p99_us": w["p99_us"] - nw["p99_us"],
                "added_cpu_us_per_call": w["cpu_us_per_call"] - nw["cpu_us_per_call"],
                "throughput_ratio": w["calls_per_s"] / nw["calls_per_s"] if nw["calls_per_s"] else 0.0,
                "ceiling_ratio": w["ceiling_calls_per_s"] / nw["ceiling_calls_per_s"]
                if nw["ceiling_calls_per_s"] else 0.0})
    return out


def _replica_online(admin: Any) -> bool:
    replica = admin.info("replication").get("slave0")      # (redis-py parses it into a dict)
    return (replica.get("state") if isinstance(replica, dict) else str(replica)) == "online" \
        or "state=online" in str(replica)


def measure_wait(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Part 4 on ``cluster`` (one primary, its replica): the same step calls with and
    without ``WAIT``."""
    import redis

    primary = cluster.nodes[cluster.primaries()[0]]
    replica = cluster.nodes[cluster.replicas()[0]]
    admin = redis.Redis(host="127.0.0.1", port=primary.port, decode_responses=True, socket_timeout=10)
    replica_admin = redis.Redis(host="127.0.0.1", port=replica.port, decode_responses=True, socket_timeout=10)
    try:
        # The replica in sync with its primary (not only attached) before anything is measured.
        deadline = time.monotonic() + 30
        while not _replica_online(admin):
            if time.monotonic() > deadline:
                raise TimeoutError("the replica did not come online within 30 s")
            time.sleep(0.05)
        pools = [f"wait-{i}" for i in range(SINGLE_POOLS)]
        progress(f"what WAIT costs (127.0.0.1:{primary.port}, replica 127.0.0.1:{replica.port}): "
                  f"{args.callers} callers, with and without WAIT {WAIT_REPLICAS} {WAIT_TIMEOUT_MS} in "
                  f"{WAIT_ROUNDS} rounds, {args.wait_seconds:g} s")
        out = asyncio.run(_wait_cost(cluster.url, pools, admin, replica_admin, args))
    finally:
        admin.close()
        replica_admin.close()
    out["shard"] = f"127.0.0.1:{primary.port}"
    out["replica"] = f"127.0.0.1:{replica.port}"
    return out


# ---------------------------------------------------------------------------- report


