"""Two allocator replicas on one Redis, eight client processes doing random operations
for 20 s (``KVS_CONCURRENCY_SECONDS`` overrides it for quick local runs): the audit is
clean while they run and afterwards, and every block is free once all clients have freed.

Everything is real: separate allocator processes (``kvservice serve``) with their own
reapers, separate client processes with their own keep-alive threads, real gRPC, one Redis
(and a local 3-primary Redis Cluster).
Each client process runs this file as a script (``--worker``) and writes a JSON report.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # a worker process: make the repository importable
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from kvservice import errors  # noqa: E402
from kvservice.client import Client, Sequence  # noqa: E402

#: (each test also runs on a local 3-primary Redis Cluster)
pytestmark = [pytest.mark.cluster_too, pytest.mark.e2e]

SECONDS = float(os.environ.get("KVS_CONCURRENCY_SECONDS", "20"))
NUM_CLIENTS = 8
POOLS = {"c8": 8, "c16": 16}      # pool id -> block size
NUM_BLOCKS = 200
MAX_LIVE = 20                     # sequences one client holds at most
MAX_TOKENS = 320                  # a sequence longer than this is freed instead of grown
PREFIX_SEED = 1234                # every client derives the same shared prefixes from it


# ---------------------------------------------------------------------------- the worker


def shared_prefixes() -> list[list[int]]:
    rng = random.Random(PREFIX_SEED)
    return [[rng.randrange(1, 30000) for _ in range(rng.randrange(16, 64))] for _ in range(6)]


class Worker:
    """One client process: a seeded random mix of creates, appends, steps with forks and
    frees, and checks of its local view against the allocator's."""

    def __init__(self, target: str, seed: int, seconds: float, tenant: str, mode: str) -> None:
        self.target = target
        self.rng = random.Random(seed)
        self.seconds = seconds
        self.tenant = tenant
        self.mode = mode
        self.prefixes = shared_prefixes()
        self.live: list[Sequence] = []
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.messages: list[str] = []
        self.stats: Counter[str] = Counter()

    def tok(self) -> int:
        return self.rng.randrange(1, 30000)

    def toks(self, n: int) -> list[int]:
        return [self.tok() for _ in range(n)]

    def pick(self, k: int, exclude: set[Sequence] = frozenset()) -> list[Sequence]:
        pool = [s for s in self.live if s not in exclude]
        return self.rng.sample(pool, min(k, len(pool)))

    def track(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.live.append(s)
            self.stats["cached_tokens"] += s.num_cached_tokens

    def forget_freed(self) -> None:
        self.live = [s for s in self.live if not s.freed]

    # -- operations

    def op_create(self) -> None:
        prompt = list(self.rng.choice(self.prefixes)) + self.toks(self.rng.randrange(0, 24))
        pool = self.rng.choice(["c8", "c16", ""])       # "": the allocator places it
        self.track([self.client.create(prompt, pool=pool)])

    def op_append_one(self) -> None:
        """A decode step: one token for many sequences, in one call at most."""
        seqs = [s for s in self.pick(8) if s.num_tokens < MAX_TOKENS]
        if seqs:
            res = self.client.step({s: [self.tok()] for s in seqs})
            self.stats["copies"] += len(res.copies)
            self.stats["rpc_steps"] += res.rpc

    def op_append_chunk(self) -> None:
        """A chunk that crosses one or more block boundaries."""
        for s in self.pick(1):
            if s.num_tokens < MAX_TOKENS:
                res = s.append(self.toks(self.rng.randrange(1, 3 * s.block_size)))
                self.stats["copies"] += len(res.copies)

    def op_mixed_step(self) -> None:
        """Forks, appends and frees of disjoint sequences (a parent may also append)."""
        frees = self.pick(self.rng.randrange(0, 3))
        parents = self.pick(self.rng.randrange(1, 3), set(frees))
        forks = {p: [self.toks(self.rng.choice([0, 0, 1, 5])) for _ in range(self.rng.randrange(1, 3))]
                 for p in parents if len(self.live) < MAX_LIVE}
        growers = self.pick(self.rng.randrange(0, 4), set(frees))
        appends = {s: self.toks(self.rng.choice([1, 1, 3, 17])) for s in growers if s.num_tokens < MAX_TOKENS}
        if not (forks or appends or frees):
            return
        res = self.client.step(appends, forks=forks, frees=frees)
        for kids in res.children.values():
            self.track(kids)
        self.stats["forks"] += sum(len(k) for k in res.children.values())
        self.stats["copies"] += len(res.copies)
        self.forget_freed()

    def op_free(self) -> None:
        for s in self.pick(1):
            s.free()
        self.forget_freed()

    def op_check(self) -> None:
        """The allocator's view of a sequence agrees with the client's local one."""
        for s in self.pick(1):
            state = self.client.get(s.id)
            if list(state.block_table) != s.block_table or not state.num_tokens <= s.num_tokens <= s.capacity:
                raise AssertionError(f"{s.id}: allocator has {list(state.block_table)} for "
                                     f"{state.num_tokens} tokens, client {s.block_table} for {s.num_tokens}")

    def shed(self) -> None:
        """Out of blocks: free about half of what this client holds, in one step."""
        victims = self.pick(max(1, len(self.live) // 2))
        if victims:
            self.client.step(frees=victims)
            self.ops["shed"] += 1
        self.forget_freed()

    def run(self) -> dict:
        self.client = Client(self.target, tenant=self.tenant, lease_ttl=10.0, timeout=30.0)
        start = time.time()
        deadline = time.monotonic() + self.seconds
        table = [(self.op_create, 4), (self.op_append_one, 5), (self.op_append_chunk, 3),
                 (self.op_mixed_step, 4), (self.op_free, 2), (self.op_check, 1)]
        ops, weights = zip(*table)
        while time.monotonic() < deadline:
            op = self.op_free if len(self.live) >= MAX_LIVE else self.rng.choices(ops, weights)[0]
            if op is self.op_create or not self.live:
                op = self.op_create
            name = op.__name__.removeprefix("op_")
            try:
                op()
                self.ops[name] += 1
            except errors.ResourceExhausted as exc:
                self.ops[name] += 1
                self.errors["ResourceExhausted"] += 1
                self._partial(exc)
                try:
                    self.shed()
                except Exception as exc2:  # noqa: BLE001 - reported to the test
                    self._unexpected(exc2)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                self._unexpected(exc)
        end = time.time()
        held = len(self.live)
        try:
            if self.mode == "revoke":            # exit with sequences held: revoke frees them
                self.client.close()
            else:                                # free everything, let the lease lapse
                self.forget_freed()
                if self.live:
                    self.client.step(frees=self.live)
                self.client.close(revoke=False)
        except Exception as exc:  # noqa: BLE001
            self._unexpected(exc)
        return {"ops": dict(self.ops), "total_ops": sum(self.ops.values()) - self.ops["shed"],
                "errors": dict(self.errors), "messages": self.messages, "stats": dict(self.stats),
                "start": start, "end": end, "held_at_end": held, "mode": self.mode,
                "rpcs": self.client.rpc_count, "target": self.target}

    def _partial(self, exc: errors.KvsError) -> None:
        """A step over two pools failed in one: the other pool's results still count."""
        result = getattr(exc, "result", None)
        if result is not None:
            self.stats["partial_steps"] += 1
            for kids in result.children.values():
                self.track(kids)
            self.track(result.created)
        self.forget_freed()

    def _unexpected(self, exc: Exception) -> None:
        self.errors[type(exc).__name__] += 1
        if len(self.messages) < 10:
            self.messages.append(f"{type(exc).__name__}: {exc}")


def worker_main(args: dict) -> None:
    report = Worker(args["target"], args["seed"], args["seconds"], args["tenant"], args["mode"]).run()
    tmp = args["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, args["out"])


# ---------------------------------------------------------------------------- the test


def test_two_replicas_eight_client_processes_random_ops(redis_url, tmp_path):
    from kvservice.tools.launcher import AllocatorProcess

    from helpers import audit, client_env, stats

    replicas = [AllocatorProcess(redis_url, args=("--reap-interval", "0.2")) for _ in range(2)]
    workers: list[tuple[subprocess.Popen, Path, dict]] = []
    try:
        for r in replicas:
            r.start()
        with Client(replicas[0].target, tenant="admin") as admin:
            for pool_id, bs in POOLS.items():
                admin.register_pool(pool_id, num_blocks=NUM_BLOCKS, block_size=bs)

        for i in range(NUM_CLIENTS):
            args = {"target": replicas[i % 2].target, "seed": 1000 + i, "seconds": SECONDS,
                    "tenant": f"tenant{(i // 2) % 2}",       # each tenant on both replicas
                    "mode": "revoke" if i % 4 < 2 else "free",  # each mode on both replicas
                    "out": str(tmp_path / f"worker{i}.json")}
            log = open(tmp_path / f"worker{i}.log", "wb")
            proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(args)], cwd=ROOT,
                                    env={**os.environ, **client_env()},
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            log.close()
            workers.append((proc, Path(args["out"]), args))

        # Audits while the clients run, each on one consistent snapshot per pool.
        audits: list[tuple[float, list[str]]] = []
        interval = max(0.3, SECONDS / 10)
        hard_stop = time.monotonic() + SECONDS + 120
        while any(p.poll() is None for p, _, _ in workers) and time.monotonic() < hard_stop:
            time.sleep(interval)
            audits.append((time.time(), audit(redis_url)))
        for proc, _, _ in workers:
            try:
                proc.wait(timeout=max(1.0, hard_stop - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        reports = []
        for i, (proc, out, args) in enumerate(workers):
            log = (tmp_path / f"worker{i}.log").read_text(errors="replace")[-3000:]
            assert proc.returncode == 0 and out.exists(), f"worker {i} exited with {proc.returncode}:\n{log}"
            reports.append(json.loads(out.read_text()))

        for r in replicas:
            assert r.proc.poll() is None, f"allocator replica died:\n{r.log()}"
            assert not any(w in r.log() for w in ("Traceback", " ERROR ", " WARNING ")), r.log()
        for i, rep in enumerate(reports):
            unexpected = {k: v for k, v in rep["errors"].items() if k != "ResourceExhausted"}
            assert not unexpected, f"worker {i}: {unexpected}\n" + "\n".join(rep["messages"])
            assert rep["total_ops"] >= 2 * SECONDS, f"worker {i} did only {rep['total_ops']} ops: {rep['ops']}"
            for name in ("create", "append_one", "append_chunk", "mixed_step", "free", "check"):
                assert rep["ops"].get(name, 0) > 0, f"worker {i} never ran {name}: {rep['ops']}"

        # Both replicas served traffic, from clients of both exit modes.
        per_replica = Counter()
        for rep in reports:
            per_replica[rep["target"]] += rep["total_ops"]
        assert set(per_replica) == {r.target for r in replicas} and all(per_replica.values()), per_replica
        assert {rep["mode"] for rep in reports} == {"revoke", "free"}
        assert any(rep["held_at_end"] for rep in reports if rep["mode"] == "revoke")

        # The audits ran while every client was mid-run, and found nothing.
        window = (max(rep["start"] for rep in reports), min(rep["end"] for rep in reports))
        during = [problems for t, problems in audits if window[0] <= t <= window[1]]
        assert len(during) >= 3, f"{len(during)} audits while all clients ran ({len(audits)} in all)"
        broken = [problems for _, problems in audits if problems]
        assert not broken, f"{len(broken)} of {len(audits)} mid-run audits failed: {broken[0][:10]}"

        # Afterwards: clean, and every block is free or evictable.
        assert audit(redis_url) == []
        totals = Counter()
        for pool_id in POOLS:
            s = stats(redis_url, pool_id)
            assert s["num_used_blocks"] == 0, (pool_id, s)
            assert s["num_sequences"] == 0, (pool_id, s)
            assert s["num_free_blocks"] + s["num_evictable_blocks"] == NUM_BLOCKS, (pool_id, s)
            for k in ("prefix_hit_tokens", "cow_copies", "evictions", "allocation_failures",
                      "sequences_created"):
                totals[k] += s.get(k, 0)
        # The mix did what it is meant to: prefix hits, copy-on-write, eviction, exhaustion.
        assert totals["prefix_hit_tokens"] > 0 and totals["cow_copies"] > 0, totals
        assert totals["allocation_failures"] > 0 and totals["evictions"] > 0, totals
        assert totals["sequences_created"] > NUM_CLIENTS * 10, totals
        print(f"\n{sum(r['total_ops'] for r in reports)} ops, {dict(totals)}, per replica {dict(per_replica)}, "
              f"{len(audits)} audits ({len(during)} with all clients running), "
              f"ResourceExhausted {sum(r['errors'].get('ResourceExhausted', 0) for r in reports)}, "
              f"partial steps {sum(r['stats'].get('partial_steps', 0) for r in reports)}")
    finally:
        for proc, _, _ in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for r in replicas:
            r.stop()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker_main(json.loads(sys.argv[2]))
