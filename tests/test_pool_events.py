"""kvservice's own pools as vLLM KV events (``kvservice events``, DESIGN §15), through the
service: an allocator with ``kv_events`` records each pool's cache changes in the scripts
that make them; the publisher sends them in vLLM's format; a subscriber (the router's
ingester and index) sees every stored block with its tokens and parent, removals on
eviction, a cleared pool on re-registration, commits of the SDK's local mode (its journal)
too; sequence numbers never used twice across publishers; nothing recorded when off. Over
one Redis and the local Redis Cluster."""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis as redis_py
import zmq

from kvservice.allocator import keys
from kvservice.allocator.store import is_cluster
from kvservice.client import Client
from kvservice.events import wire
from kvservice.events.index import Index
from kvservice.events.ingest import Ingester, Source
from kvservice.events.pools import PoolEvents
from kvservice.events.publisher import Publisher

from helpers import TEST_SETTINGS, ServerThread

BS = 4
PROMPT = list(range(1, 14))             # 3 full blocks and one token

pytestmark = [pytest.mark.cluster_too, pytest.mark.e2e]


def _redis(url: str):
    return redis_py.RedisCluster.from_url(url) if is_cluster(url) else redis_py.Redis.from_url(url)


@pytest.fixture
def events(redis_url):
    settings = dataclasses.replace(TEST_SETTINGS, kv_events=True)
    r = _redis(redis_url)
    with ServerThread(redis_url, settings) as s, Client(s.target, tenant="t1", lease_ttl=30.0) as c:
        c.register_pool("a", num_blocks=8, block_size=BS)
        pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        source = PoolEvents(r, pub, pools=["a"])
        index = Index(r)
        ing = Ingester(index, [Source("kvs", pub.bound, pub.replay_bound)]).start()
        time.sleep(0.5)
        try:
            yield s, c, source, index, r
        finally:
            ing.stop()
            pub.close()


def _publish(source: PoolEvents, index: Index) -> None:
    """Publishes what the pool recorded and waits until the ingester applied it."""
    before = index.info("kvs").get("last_seq", -1)
    if source.poll_once():
        deadline = time.monotonic() + 10
        while index.info("kvs").get("last_seq", -1) == before:
            assert time.monotonic() < deadline, "the batch did not reach the index"
            time.sleep(0.02)


def test_stored_blocks_reach_a_subscriber_with_their_tokens_and_removals_and_clears_follow(events):
    s, c, source, index, _ = events
    seq = c.create(PROMPT, pool="a")
    _publish(source, index)
    assert index.lookup(PROMPT)["kvs"].blocks == 3          # (chained from its root, by its tokens)
    seq.free()
    for i in range(3):                                      # (other prompts evict PROMPT's blocks)
        c.create([100 * (i + 1) + t for t in range(12)], pool="a").free()
    _publish(source, index)
    assert index.lookup(PROMPT)["kvs"].blocks < 3
    c.register_pool("a", num_blocks=8, block_size=BS)       # (a new epoch: all cleared)
    c.create([7] * 9, pool="a")
    _publish(source, index)
    assert index.lookup([100 + t for t in range(12)])["kvs"].blocks == 0
    assert index.lookup([7] * 9)["kvs"].blocks == 2


def test_the_sdks_local_commits_are_published_with_their_tokens(events):
    s, _, source, index, _ = events
    with Client(s.target, tenant="t1", local=True, lease_ttl=30.0) as c:
        seq = c.create(PROMPT[:5], pool="a")                 # (1 full block at create)
        c.step({seq: PROMPT[5:]})                           # (2 more committed in the journal)
        c.flush()
    _publish(source, index)
    assert index.lookup(PROMPT)["kvs"].blocks == 3


@pytest.mark.parametrize("local", [False, True], ids=["remote", "local"])
def test_a_block_is_published_as_stored_only_once_its_kv_is_written(events, local):
    s, _, source, index, _ = events
    with Client(s.target, tenant="t1", local=local, lease_ttl=30.0, commit_after_write=True) as c:
        seq = c.create(PROMPT, pool="a")                    # (an engine's create: nothing written yet)
        c.flush()
        _publish(source, index)
        assert index.lookup(PROMPT)["kvs"].blocks == 0
        seq.mark_written(8)                                 # (two blocks' KV written)
        c.flush()
        _publish(source, index)
        assert index.lookup(PROMPT)["kvs"].blocks == 2
        seq.free()                                          # (the third never written: never stored)
        c.flush()
        _publish(source, index)
        assert index.lookup(PROMPT)["kvs"].blocks == 2


def test_each_batch_is_a_vllm_batch_numbered_from_redis_and_a_new_publisher_never_reuses_a_number(events):
    s, c, source, index, r = events
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(source.publisher.bound)
    time.sleep(0.3)
    try:
        c.create(PROMPT, pool="a")
        source.poll_once()
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        batch = wire.decode(payload)
        # (the pool's registration, then the prompt's three blocks)
        assert topic == b"a" and [type(e).__name__ for e in batch.events] == ["AllBlocksCleared"] + ["BlockStored"] * 3
        first = batch.events[1]
        assert first.parent_block_hash is None and first.token_ids == PROMPT[:4] and first.block_size == BS
        assert batch.events[2].parent_block_hash == first.block_hashes[0] and len(first.block_hashes[0]) == 16
        assert first.medium == wire.MEDIUM_GPU
        # another publisher (a restart) takes the next number from Redis
        other = Publisher("tcp://127.0.0.1:0", "")
        try:
            again = PoolEvents(r, other, pools=["a"])
            sub2 = ctx.socket(zmq.SUB)
            sub2.setsockopt(zmq.SUBSCRIBE, b"")
            sub2.connect(other.bound)
            time.sleep(0.3)
            c.create([9] * 5, pool="a")
            again.poll_once()
            assert sub2.poll(5000)
            _, seq2, _ = sub2.recv_multipart()
            assert wire.seq_of(seq2) == wire.seq_of(seq) + 1
            assert again.poll_once() == 0                    # (its position is kept in Redis too)
            sub2.close(linger=0)
        finally:
            other.close()
    finally:
        sub.close(linger=0)
        ctx.destroy(linger=0)


def test_nothing_is_recorded_when_events_are_off(redis_url):
    r = _redis(redis_url)
    with ServerThread(redis_url, TEST_SETTINGS) as s, Client(s.target, tenant="t1") as c:
        c.register_pool("b", num_blocks=8, block_size=BS)
        c.create(PROMPT, pool="b").free()
        assert r.xlen(keys.pool_key("b", "events")) == 0
        assert not r.exists(f"kvs:tok:{'0' * 32}")


def test_a_refused_call_records_nothing(events):
    s, c, source, index, r = events
    c.create(PROMPT, pool="a")
    before = r.xlen(keys.pool_key("a", "events"))
    from kvservice import errors
    with pytest.raises(errors.ResourceExhausted):
        c.create(list(range(500, 500 + 40)), pool="a")         # (10 blocks: more than the pool has)
    assert r.xlen(keys.pool_key("a", "events")) == before


def test_the_events_command_publishes_and_counts(events, redis_url):
    import subprocess
    import sys
    import urllib.request
    s, c, _, _, _ = events
    proc = subprocess.Popen([sys.executable, "-m", "kvservice", "events", "--redis", redis_url, "--endpoint",
                             "tcp://127.0.0.1:0", "--replay-endpoint", "", "--metrics-port", "0", "--pool", "a"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ctx = zmq.Context()
    try:
        first = proc.stdout.readline()
        assert "publishing on " in first, first
        bound = first.split("publishing on ")[1].split(" ")[0]
        metrics_port = int(proc.stdout.readline().rsplit(":", 1)[1])
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"a")
        sub.connect(bound)
        time.sleep(0.5)
        c.create(PROMPT, pool="a")
        while sub.poll(5000):
            topic, _, payload = sub.recv_multipart()
            if any(isinstance(e, wire.BlockStored) for e in wire.decode(payload).events):
                break
        else:
            raise AssertionError("no BlockStored from kvservice events")
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'kvservice_events_published_total{pool="a"}' in text
        sub.close(linger=0)
    finally:
        proc.terminate()
        proc.wait(10)
        ctx.destroy(linger=0)


def test_a_create_staged_in_bounded_calls_is_published_with_its_tokens(redis_url):
    settings = dataclasses.replace(TEST_SETTINGS, kv_events=True, max_blocks_per_call=2)
    r = _redis(redis_url)
    with ServerThread(redis_url, settings) as s, Client(s.target, tenant="t1") as c:
        c.register_pool("a", num_blocks=16, block_size=BS)
        pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        index = Index(r)
        ing = Ingester(index, [Source("kvs", pub.bound, pub.replay_bound)]).start()
        try:
            time.sleep(0.5)
            c.create(PROMPT, pool="a")                       # (4 blocks: staged, 2 per call)
            _publish(PoolEvents(r, pub, pools=["a"]), index)
            assert index.lookup(PROMPT)["kvs"].blocks == 3
        finally:
            ing.stop()
            pub.close()
