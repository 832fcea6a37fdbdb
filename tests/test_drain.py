"""Draining a pool in the allocator (DESIGN §13): DrainPool marks it, placement passes it
over, a create or migration that names it is refused, Syncs grant no reserve there and a
client that leaves it gives its reserve back; UnregisterPool removes it once it holds
nothing, and its worker's heartbeat then says it was drained. Over one Redis and the local
Redis Cluster."""

from __future__ import annotations

import grpc
import pytest

from kvservice import errors
from kvservice.client import Client
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

from helpers import ServerThread, audit

BS = 4
PROMPT = list(range(1, 15))

pytestmark = [pytest.mark.cluster_too, pytest.mark.e2e]


@pytest.fixture(params=["local", "remote"])
def two(any_redis_url, request):
    with ServerThread(any_redis_url) as s, Client(s.target, tenant="t1", lease_ttl=30.0,
                                                   local=request.param == "local") as c:
        c.collect_tier_orders = True
        c.register_pool("a", num_blocks=64, block_size=BS)
        c.register_pool("b", num_blocks=64, block_size=BS)
        yield s, c, any_redis_url


def _draining(c: Client) -> dict[str, bool]:
    return {p.pool_id: p.draining for p in c.pools()}


def test_a_drained_pool_takes_nothing_new_and_leaves_the_registry_once_empty(two):
    server, c, url = two
    s = c.create(PROMPT, pool="a")
    with Client(server.target) as admin:                      # (the suite's admin)
        assert admin.drain_pool("a").draining and _draining(c) == {"a": True, "b": False}
        with pytest.raises(errors.FailedPrecondition, match="drained") as info:
            c.create(PROMPT, pool="a")
        assert info.value.reason == "DRAINING"
        placed = [c.create(list(range(100 + 10 * i, 110 + 10 * i))) for i in range(4)]
        assert {p.pool for p in placed} == {"b"}
        with pytest.raises(errors.FailedPrecondition) as info:
            admin.unregister_pool("a")
        assert info.value.reason == "NOT_DRAINED"
        c.leave_pool("a")
        copy = s.migrate()
        assert copy.pool == "b"
        orders = c.take_tier_orders()
        c.settle_tiers("a", orders[0].source_epoch, [], [orders[0].pin_id])
        c.flush()
        stats = c.pool_stats("a")
        assert (stats.num_sequences, stats.num_reserved_blocks, stats.num_used_blocks) == (0, 0, 0)
        assert audit(url, "a") == []
        epoch = c.pool_stats("a").epoch
        gone = admin.unregister_pool("a")
        assert (gone.epoch, gone.num_sequences, gone.num_reserved_blocks) == (epoch, 0, 0)
        assert [p.pool_id for p in c.pools()] == ["b"]
        with pytest.raises(errors.NotFound):
            c.pool_stats("a")
        # The worker's heartbeat learns it.
        with server.channel() as ch:
            with pytest.raises(grpc.RpcError) as rpc:
                pb_grpc.AllocatorStub(ch).Heartbeat(pb.HeartbeatRequest(pool_id="a", epoch=epoch), timeout=10)
            assert rpc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "drained" in rpc.value.details()
        # Registered again: a new pool, not draining.
        c.register_pool("a", num_blocks=64, block_size=BS)
        assert _draining(c) == {"a": False, "b": False}
        for p in placed:
            p.free()
        copy.free()
        c.flush()
        assert audit(url) == []


def test_undo_a_drain_and_refusals(two):
    server, c, url = two
    with Client(server.target) as admin:
        with pytest.raises(errors.FailedPrecondition) as info:
            admin.unregister_pool("a")
        assert info.value.reason == "NOT_DRAINING"
        with pytest.raises(errors.NotFound):
            admin.drain_pool("nowhere")
        admin.drain_pool("a")
        assert not admin.drain_pool("a", undo=True).draining
        assert c.create(PROMPT, pool="a").pool == "a"


def test_the_drain_command_reports_what_it_does_and_refuses_an_unknown_pool(two):
    import os
    import subprocess
    import sys

    from helpers import client_env

    server, c, url = two
    env = {**os.environ, **client_env()}

    def drain(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvservice", "drain", *args, "--target", server.target],
                              env=env, capture_output=True, text=True, timeout=60)
    bad = drain("nowhere")
    assert bad.returncode == 2 and "NotFound" in bad.stderr and "nowhere" in bad.stderr
    s = c.create(PROMPT, pool="a")
    held = drain("a", "--timeout", "1")                    # (nobody moves the sequence: it stays draining)
    assert held.returncode == 1 and "1 sequences" in held.stdout and "stays draining" in held.stderr
    assert _draining(c)["a"]
    assert drain("a", "--undo").returncode == 0 and not _draining(c)["a"]
    s.free()
    c.leave_pool("a")                                      # (what an engine does when it sees the drain)
    done = drain("a")
    assert done.returncode == 0 and "unregistered" in done.stdout, done.stdout + done.stderr
    assert [p.pool_id for p in c.pools()] == ["b"]


def test_a_create_carrying_the_journal_of_a_pool_unregistered_meanwhile_goes_on(any_redis_url):
    """Local mode: a create that carries the pending journal (it commits blocks) while one
    of its pools was unregistered by force (``kvservice drain --force``): the client
    forgets that pool, its sequences there are lost, and the create goes on without it."""
    with ServerThread(any_redis_url) as s, Client(s.target) as admin, \
            Client(s.target, tenant="t1", lease_ttl=30.0, local=True, flush_interval=60.0) as c:
        c.register_pool("a", num_blocks=64, block_size=BS)
        c.register_pool("b", num_blocks=64, block_size=BS)
        there = c.create(PROMPT, pool="a")
        c.step({there: [1, 2]})                     # (fills a block; a Sync goes at once)
        c.step({there: [3, 4, 5, 6]})               # (fills another: a commit the journal holds)
        assert c._journals["a"].pending
        admin.drain_pool("a")
        admin.unregister_pool("a", force=True)
        made = c.create(list(range(200, 210)), pool="b")
        assert made.pool == "b" and there.lost
        made.free()
        c.flush()
        assert audit(any_redis_url) == []
