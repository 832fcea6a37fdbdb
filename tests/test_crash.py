"""Crashes: a client process killed with SIGKILL while it holds sequences leaves no
allocated block once its lease TTL has passed; an allocator replica killed with SIGKILL
loses nothing, because the state lives in Redis and another replica serves it. On one
Redis and on a local 3-primary Redis Cluster."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvservice import errors
from kvservice.client import Client
from kvservice.tools.launcher import AllocatorProcess
from kvservice.v1 import allocator_pb2 as pb

from helpers import audit, client_env, stats

ROOT = Path(__file__).resolve().parent.parent
TTL = 1.0

#: (each test also runs on a local 3-primary Redis Cluster)
pytestmark = [pytest.mark.cluster_too, pytest.mark.e2e]

# The client process: a lease of TTL seconds, sequences in two pools (shared prefixes,
# forks, copy-on-write), then "ready" with what it holds, then it sleeps until killed.
CLIENT = r"""
import json, sys, time
from kvservice.client import Client


target, ttl = sys.argv[1], float(sys.argv[2])
client = Client(target, tenant="crash", lease_ttl=ttl)
prefix = list(range(1, 41))
held = []
for pool in ("k8", "k16"):
    a = client.create(prefix + [100, 101, 102], pool=pool)
    b = client.create(prefix + [200, 201], pool=pool)        # shares the prefix's full blocks
    kid = a.fork()                                           # shares every block of a
    client.step({kid: [7, 8, 9], a: list(range(300, 320))})  # kid copies a's partial last block
    grandkids = client.step(forks={b: [[1], [2, 3]]}).children[b.id]
    held += [a, b, kid, *grandkids]
assert sum(s.num_cached_tokens for s in held) > 0
print(json.dumps({"ready": True, "pid": __import__("os").getpid(), "lease": client.lease_id,
                  "seqs": [s.id for s in held], "tables": [s.block_table for s in held]}), flush=True)
time.sleep(120)
"""


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next stdout line of ``proc``, or '' after ``timeout`` seconds or at EOF."""
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: out.put(proc.stdout.readline()), daemon=True).start()
    try:
        return out.get(timeout=timeout)
    except queue.Empty:
        return ""


def used(redis_url: str) -> tuple[int, int]:
    """(used blocks, sequences) over both pools."""
    s = [stats(redis_url, p) for p in ("k8", "k16")]
    return sum(x["num_used_blocks"] for x in s), sum(x["num_sequences"] for x in s)


@pytest.fixture
def allocator(redis_url):
    with AllocatorProcess(redis_url, args=("--reap-interval", "0.1")) as a:
        with Client(a.target, tenant="admin") as admin:
            admin.register_pool("k8", num_blocks=64, block_size=8)
            admin.register_pool("k16", num_blocks=64, block_size=16)
        yield a


def test_sigkilled_client_leaves_no_allocated_block_after_its_lease_ttl(allocator, redis_url, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    proc = subprocess.Popen([sys.executable, str(script), allocator.target, str(TTL)], cwd=ROOT,
                            env={**os.environ, **client_env()}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = read_line(proc, 60)
        if not line:
            proc.kill()
            pytest.fail(f"the client never got ready (exit {proc.poll()}):\n{proc.stderr.read()[-3000:]}")
        held = json.loads(line)
        assert held["ready"] and len(held["seqs"]) == 10
        blocks_held = len({(sid.split("/")[0], b) for sid, t in zip(held["seqs"], held["tables"]) for b in t})

        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
        assert proc.returncode == -signal.SIGKILL

        # The lease outlives its holder by up to one TTL: nothing is freed at once.
        assert used(redis_url) == (blocks_held, 10)
        with Client(allocator.target, tenant="observer") as observer:
            assert list(observer.get(held["seqs"][0]).block_table) == held["tables"][0]
            deadline = killed + TTL + 10
            while used(redis_url) != (0, 0) and time.monotonic() < deadline:
                time.sleep(0.02)
            elapsed = time.monotonic() - killed
            assert used(redis_url) == (0, 0), f"sequences still allocated {elapsed:.1f}s after the kill"
            # Keep-alives came every TTL/3: the lease had at least 2/3 of its TTL left.
            assert elapsed >= 0.5 * TTL, f"freed {elapsed:.2f}s after the kill, before the lease TTL"
            print(f"freed {elapsed:.2f}s after the kill (TTL {TTL}s)")
            for sid in held["seqs"]:
                with pytest.raises(errors.NotFound):
                    observer.get(sid)
        assert audit(redis_url) == []
        for pool_id in ("k8", "k16"):
            s = stats(redis_url, pool_id)
            assert s["num_free_blocks"] + s["num_evictable_blocks"] == 64
            assert s["leases_expired"] == 1 and s["num_leases"] == 0
            assert s["num_evictable_blocks"] > 0          # full blocks stay cached by hash
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_sigkilled_replica_loses_nothing_another_replica_serves_the_sequences(allocator, redis_url):
    with AllocatorProcess(redis_url, args=("--reap-interval", "0.1")) as second:
        holder = Client(allocator.target, tenant="crash", lease_ttl=30.0)
        try:
            a = holder.create(list(range(1, 30)), pool="k8")
            kid = a.fork([5])
            b = holder.create(list(range(1, 40)), pool="k16")
            before = {s.id: holder.get(s.id) for s in (a, kid, b)}

            allocator.kill()
            assert allocator.proc.returncode == -signal.SIGKILL
            with pytest.raises(errors.Unavailable):
                holder.get(a.id)

            with Client(second.target, tenant="crash") as other:
                for s in (a, kid, b):
                    state = other.get(s.id)
                    assert state == before[s.id]
                    assert list(state.block_table) == s.block_table and state.lease_id == holder.lease_id
                # The surviving replica keeps serving, from the same state.
                c = other.create(list(range(1, 30)), pool="k8")
                assert c.num_cached_tokens == 24 and c.block_table[:3] == a.block_table[:3]
                assert audit(redis_url) == []
                # The dead replica's client's lease lives in Redis: the other replica revokes it.
                other.stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=holder.lease_id), timeout=10)
                for s in (a, kid, b):
                    with pytest.raises(errors.NotFound):
                        other.get(s.id)
                c.free()
        finally:
            holder.close(revoke=False)
        assert used(redis_url) == (0, 0)
        assert audit(redis_url) == []
