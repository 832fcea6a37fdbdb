"""`kvservice audit` finds every kind of broken invariant, and passes on a sound state."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis

from kvservice.allocator import keys
from kvservice.client import Client
from kvservice.v1 import allocator_pb2 as pb

from helpers import ServerThread, audit

pytestmark = pytest.mark.e2e


def run_audit_cli(url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvservice", "audit", "--redis-url", url, *extra],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def live(redis_url):
    """A pool with shared, forked, cached and free blocks, held by a live client."""
    with ServerThread(redis_url) as srv, Client(srv.target) as c:
        c.register_pool("a1", num_blocks=32, block_size=4)
        x = c.create(list(range(10)), pool="a1")
        x.fork()
        y = c.create(list(range(11)), pool="a1")
        c.create(list(range(50, 59)), pool="a1").free()      # two evictable blocks
        yield redis.Redis.from_url(redis_url), x, y


def test_sound_state_passes(live, redis_url):
    out = run_audit_cli(redis_url)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "audit ok: 1 pool(s)" in out.stdout
    assert "32 blocks = " in out.stdout
    report = json.loads(run_audit_cli(redis_url, "--json").stdout)
    assert report["ok"] and report["pools"][0]["num_sequences"] == 3


def test_the_audit_reports_what_each_lease_holds(live, redis_url):
    r, x, y = live
    c = x.client
    c.stub.Sync(pb.SyncRequest(lease_id=c.lease_id, pools=[pb.PoolSync(pool_id="a1", epoch=x.epoch, want_blocks=2)]))
    report = json.loads(run_audit_cli(redis_url, "--json").stdout)
    assert report["ok"] and report["pools"][0]["num_reserved_blocks"] == 2
    assert report["leases"] == [{"pool_id": "a1", "lease_id": c.lease_id, "num_sequences": 3,
                                 "num_reserved_blocks": 2, "applied_entries": 0, "num_staged_blocks": 0}]
    rpc = c.audit("a1")
    assert rpc.ok and [(h.lease_id, h.num_sequences, h.num_reserved_blocks) for h in rpc.leases] == [
        (c.lease_id, 3, 2)]
    assert f"lease {c.lease_id}: 3 sequences, 2 reserved blocks" in run_audit_cli(redis_url).stdout


def _k(name: str) -> str:
    return keys.pool_key("a1", name)


CORRUPTIONS = {
    "double-owned block": (lambda r, x, y: r.rpush(_k("free"), x.block_table[0]),
                           "blocks both free and referenced"),
    "lost block": (lambda r, x, y: r.hdel(_k("ref"), y.block_table[-1]), "lost"),
    "wrong ref count": (lambda r, x, y: r.hincrby(_k("ref"), x.block_table[0], 1), "held by 3 block tables"),
    "hash maps disagree": (lambda r, x, y: r.hset(_k("h2b"), "ab" * 16, x.block_table[2]),
                           "hash abababababab.. -> block"),
    "evictable without hash": (lambda r, x, y: r.hdel(_k("b2h"), int(r.zrange(_k("evict"), 0, 0)[0])),
                               "has no hash"),
    "counter drift": (lambda r, x, y: r.hincrby(_k("stats"), "sequences_created", 1), "live sequences"),
    "table too short": (lambda r, x, y: r.hset(_k("tabs"), str(y.number),
                                                "".join(f"{b:06x}" for b in y.block_table[:2])),
                        "its record says 3 blocks, its table holds 2"),
    "reserved and free": (lambda r, x, y: r.hset(_k("reserve"), "31", x.client.lease_id),
                          "blocks both free and reserved"),
    "reserved and referenced": (lambda r, x, y: r.hset(_k("reserve"), str(x.block_table[0]), x.client.lease_id),
                                "both referenced and reserved"),
    "reserve count drift": (lambda r, x, y: r.hset(_k("journal"), x.client.lease_id, "0 5"),
                            "reserved blocks, its journal record says 5"),
    "reserve of an unknown lease": (lambda r, x, y: r.hset(_k("reserve"), "30", "ghost"),
                                    "lease ghost holds a reserve but is unknown to the pool"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_broken_invariant_fails_the_audit(live, redis_url, name):
    r, x, y = live
    assert audit(redis_url) == []
    corrupt, expected = CORRUPTIONS[name]
    corrupt(r, x, y)
    out = run_audit_cli(redis_url)
    assert out.returncode == 1, out.stdout
    assert "AUDIT FAILED" in out.stdout and expected in out.stdout, out.stdout
    # Put it right for the fixture's teardown: wipe the pool.
    r.flushall()


def test_unreachable_redis_exits_2():
    out = run_audit_cli("redis://127.0.0.1:1")
    assert out.returncode == 2 and "cannot audit" in out.stderr


def test_the_audit_of_the_largest_pool_checks_its_unused_blocks_as_one_range(redis_url):
    """A pool of 2^24 blocks, nearly all never used: the audit takes the blocks past the
    fresh mark as one free range (it used to build a set of 16M blocks, for 12 s), and
    still sees a never-used block in another set."""
    with ServerThread(redis_url) as server, Client(server.target, keepalive=False) as c:
        c.register_pool("huge", num_blocks=1 << 24, block_size=16)
        c.create(list(range(100)), pool="huge")
        assert c.audit("huge").ok
        r = redis.Redis.from_url(redis_url)
        r.hset(keys.pool_key("huge", "reserve"), str((1 << 24) - 1), c.lease_id)
        r.hset(keys.pool_key("huge", "b2h"), str(1 << 23), "ab" * 16)
        problems = list(c.audit("huge").problems)
        assert any("blocks both free and reserved" in p for p in problems), problems
        assert any(f"free block {1 << 23} still has a hash" in p for p in problems), problems
