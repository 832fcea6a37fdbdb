"""KV events in vLLM's format (``kvservice.events``), over real ZMQ sockets and a real
Redis: the wire format both ways, a publisher with its replay socket, the ingester that
keeps the index (gaps replayed, a late subscriber catching up, a dropped batch detected by
its number, a restarted publisher's entries dropped, a lost connection making its
instance suspect), lookups by prefix and medium, and the router's gRPC and HTTP calls and
``kvservice route``. vLLM's own decoder reading what is published: tests/test_vllm.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
import redis

from kvservice.events import wire
from kvservice.events.index import Index
from kvservice.events.ingest import Ingester, Source
from kvservice.events.publisher import Publisher
from kvservice.events.server import RouterService, grpc_server, http_server
from kvservice.v1 import router_pb2 as rpb, router_pb2_grpc as rpb_grpc

BS = 4
PROMPT = list(range(1, 14))             # 3 full blocks and one token

pytestmark = [pytest.mark.cluster_too, pytest.mark.e2e]


def _stored(tokens: list[int], first: int, n: int, medium: str = wire.MEDIUM_GPU, parent: int | None = None,
            base: int = 0) -> wire.BlockStored:
    """Blocks first .. first + n - 1 of ``tokens``, their (instance) hashes base + index."""
    return wire.BlockStored([base + i for i in range(first, first + n)],
                            parent if parent is not None else (base + first - 1 if first else None),
                            tokens[first * BS:(first + n) * BS], BS, medium)


def _publisher(**kw) -> Publisher:
    return Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", **kw)


def _wait(cond, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.02)


def _r(url: str):
    return redis.RedisCluster.from_url(url) if _is_cluster(url) else redis.Redis.from_url(url)


def _is_cluster(url: str) -> bool:
    from kvservice.allocator.store import is_cluster
    return is_cluster(url)


@pytest.fixture
def index(redis_url):
    yield Index(_r(redis_url))


def test_the_wire_format_round_trips_and_bad_payloads_are_refused():
    batch = wire.Batch(12.5, [_stored(PROMPT, 0, 3, wire.MEDIUM_CPU), wire.BlockRemoved([b"\x01" * 32], None),
                              wire.AllBlocksCleared()], data_parallel_rank=1)
    assert wire.decode(wire.encode(batch)) == batch
    for bad in (b"\x93", b"not msgpack at all", wire.encode(wire.Batch(1.0))[:1], b"\x92\x01\x91\x05"):
        with pytest.raises(wire.BadPayload):
            wire.decode(bad)
    # an event kind this reader does not know is passed over
    import msgpack
    assert wire.decode(msgpack.packb([1.0, [{"type": "Future", "x": 1}]])).events == []


def test_the_index_chains_blocks_by_tokens_and_weighs_media(index):
    index.set_info("a", block_size=BS, last_seq=-1)
    index.set_info("b", block_size=BS, last_seq=-1)
    index.apply("a", wire.Batch(1.0, [_stored(PROMPT, 0, 2), _stored(PROMPT, 2, 1)]))
    # b names its blocks otherwise (its own hashes) and holds the first one in host memory
    index.apply("b", wire.Batch(1.0, [_stored(PROMPT, 0, 1, wire.MEDIUM_CPU, base=1000)]))
    got = index.lookup(PROMPT + [99, 98])
    assert (got["a"].blocks, got["a"].weighted_tokens, got["a"].by_medium) == (3, 12.0, {"GPU": 3})
    assert (got["b"].blocks, got["b"].weighted_tokens, got["b"].by_medium) == (1, 2.0, {"CPU": 1})
    assert index.lookup([7] * 12)["a"].blocks == 0               # (another prompt)
    # a child whose parent the index never saw is passed over
    assert index.apply("a", wire.Batch(1.0, [_stored(PROMPT, 1, 1, parent=555)])).unchained == 1
    index.apply("a", wire.Batch(2.0, [wire.BlockRemoved([1], wire.MEDIUM_GPU)]))
    assert index.lookup(PROMPT)["a"].blocks == 1                 # (the chain breaks at block 1)
    assert index.apply("b", wire.Batch(3.0, [wire.AllBlocksCleared()])).cleared == 1
    assert index.lookup(PROMPT)["b"].blocks == 0 and index.num_blocks("b") == 0
    index.set_info("a", suspect=1)
    assert index.lookup(PROMPT)["a"].blocks == 0                 # (suspect: not used)


def test_the_ingester_applies_batches_replays_gaps_and_catches_up_late(index):
    pub = _publisher()
    try:
        # published before the ingester listens: recovered through the replay socket
        pub.publish("pool-a", wire.Batch(1.0, [_stored(PROMPT, 0, 1)]))
        pub.publish("pool-a", wire.Batch(1.0, [_stored(PROMPT, 1, 1)]))
        pub.flush()
        ing = Ingester(index, [Source("a", pub.bound, pub.replay_bound)]).start()
        try:
            time.sleep(0.5)                                        # (the SUB socket connects)
            pub.publish("pool-a", wire.Batch(2.0, [_stored(PROMPT, 2, 1)]))
            _wait(lambda: index.info("a").get("last_seq") == 2, what="batch 2 applied")
            assert index.lookup(PROMPT)["a"].blocks == 3
            c = ing.counters["a"]
            assert (c.replays, c.dropped, c.batches) == (1, 0, 3)
        finally:
            ing.stop()
    finally:
        pub.close()


def test_a_batch_the_replay_socket_no_longer_has_is_detected_and_drops_the_instance(index):
    pub = _publisher(buffer=1)
    try:
        ing = Ingester(index, [Source("a", pub.bound, pub.replay_bound)]).start()
        time.sleep(0.5)
        pub.publish("t", wire.Batch(1.0, [_stored(PROMPT, 0, 2)]))
        _wait(lambda: index.info("a").get("last_seq") == 0, what="batch 0")
        ing.stop()                                                 # (the ingester is away for 1 .. 2)
        pub.publish("t", wire.Batch(1.0, [_stored([50] * 8, 0, 1, base=500)]))
        pub.publish("t", wire.Batch(1.0, [_stored([60] * 8, 0, 1, base=600)]))
        pub.flush()
        ing = Ingester(index, [Source("a", pub.bound, pub.replay_bound)]).start()
        try:
            time.sleep(0.5)
            pub.publish("t", wire.Batch(2.0, [_stored(PROMPT, 2, 1, parent=1)]))
            _wait(lambda: index.info("a").get("last_seq") == 3, what="batch 3")
            # batch 1 is gone from the replay buffer: counted, and what the index held of "a"
            # is dropped (it cannot know what it missed)
            assert ing.counters["a"].dropped == 2 and ing.counters["a"].replays == 1
            assert index.lookup(PROMPT)["a"].blocks == 0
        finally:
            ing.stop()
    finally:
        pub.close()


def test_a_restarted_publisher_drops_its_entries_and_a_lost_connection_makes_it_suspect(index):
    pub = _publisher()
    endpoint, replay = pub.bound, pub.replay_bound
    ing = Ingester(index, [Source("a", endpoint, replay)]).start()
    try:
        time.sleep(0.5)
        for i in range(3):
            pub.publish("t", wire.Batch(1.0, [_stored(PROMPT, i, 1)]))
        _wait(lambda: index.info("a").get("last_seq") == 2, what="3 batches")
        assert index.lookup(PROMPT)["a"].blocks == 3
        pub.close()
        _wait(lambda: index.info("a").get("suspect") == 1, what="suspect after the disconnect")
        assert index.lookup(PROMPT)["a"].blocks == 0              # (not used until it publishes again)
        pub = Publisher(endpoint, replay)                          # (a new process: numbers from 0)
        time.sleep(0.5)
        pub.publish("t", wire.Batch(2.0, [_stored([9] * 8, 0, 1, base=900)]))
        _wait(lambda: index.info("a").get("last_seq") == 0, what="the new publisher's batch 0")
        assert ing.counters["a"].restarts == 1 and index.info("a")["suspect"] == 0
        assert index.lookup(PROMPT)["a"].blocks == 0 and index.lookup([9] * 8)["a"].blocks == 1
    finally:
        ing.stop()
        pub.close()


@pytest.fixture
def router(redis_url, tmp_path):
    pubs = [_publisher(), _publisher()]
    service = RouterService(redis_url, [Source(f"vllm-{i}", p.bound, p.replay_bound) for i, p in enumerate(pubs)],
                            load_tokens=1.0).start()
    server, port = grpc_server(service, "127.0.0.1", 0)
    web = http_server(service, "127.0.0.1", 0)
    time.sleep(0.5)
    yield service, pubs, f"127.0.0.1:{port}", f"http://127.0.0.1:{web.server_address[1]}"
    web.shutdown()
    server.stop(0)
    service.stop()
    for p in pubs:
        p.close()


def _post(url: str, body: object) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/route", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_router_ranks_by_cached_prefix_and_load_over_grpc_http_and_the_command_line(router):
    service, pubs, target, url = router
    pubs[1].publish("t", wire.Batch(1.0, [_stored(PROMPT, 0, 3)]))
    pubs[0].publish("t", wire.Batch(1.0, [_stored(PROMPT, 0, 1, wire.MEDIUM_STORAGE, base=50)]))
    _wait(lambda: service.index.info("vllm-1").get("last_seq") == 0 and service.index.info("vllm-0").get("last_seq")
          == 0, what="both batches")
    with grpc.insecure_channel(target) as ch:
        reply = rpb_grpc.RouterStub(ch).Route(rpb.RouteRequest(token_ids=PROMPT + [1]), timeout=10)
    assert (reply.instance, reply.reason, reply.num_prompt_tokens) == ("vllm-1", "cache", 14)
    assert [(c.instance, c.cached_blocks, c.cached_tokens) for c in reply.candidates] == [("vllm-1", 3, 12.0),
                                                                                        ("vllm-0", 1, 1.0)]
    status, out = _post(url, {"token_ids": [500, 501, 502, 503, 504]})
    assert status == 200 and out["reason"] == "load" and out["instance"] == "vllm-0"   # (vllm-1 has 1 routed)
    cli = subprocess.run([sys.executable, "-m", "kvservice", "route", "--router", url, "--tokens",
                          ",".join(map(str, PROMPT))], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and cli.stdout.startswith("vllm-1 (cache), prompt of 13 tokens"), cli.stderr
    metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    assert 'kvservice_routed_requests_total{instance="vllm-1",reason="cache"} 2.0' in metrics
    assert 'kvservice_index_blocks{instance="vllm-1"} 3.0' in metrics
    assert 'kvservice_events_ingested_total{instance="vllm-0"} 1.0' in metrics


@pytest.mark.parametrize("body, message", [
    ({}, "a prompt needs token_ids or text"),
    ({"text": "hello"}, "this router has no tokenizer"),
    ({"token_ids": [1, -2]}, "token id -2 is outside"),
    ({"token_ids": 7}, "token_ids is a list of token ids"),
    ([1, 2], "the body is a JSON object"),
])
def test_the_router_refuses_bad_prompts(router, body, message):
    _, _, target, url = router
    status, out = _post(url, body)
    assert status == 400 and message in out["error"]


def test_the_route_call_over_grpc_refuses_an_empty_prompt(router):
    _, _, target, _ = router
    with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as exc:
        rpb_grpc.RouterStub(ch).Route(rpb.RouteRequest(), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids or text" in exc.value.details()


def test_a_router_with_a_tokenizer_routes_text(redis_url, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(["[UNK]", *[f"w{i}" for i in range(20)]])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = " ".join(f"w{i}" for i in range(1, 14))                  # token ids 2 .. 14
    pub = _publisher()
    service = RouterService(redis_url, [Source("vllm-0", pub.bound, pub.replay_bound)],
                            tokenizer=str(tmp_path / "tokenizer.json")).start()
    web = http_server(service, "127.0.0.1", 0)
    try:
        time.sleep(0.5)
        pub.publish("t", wire.Batch(1.0, [_stored(list(range(2, 15)), 0, 2)]))
        _wait(lambda: service.index.info("vllm-0").get("last_seq") == 0, what="the batch")
        status, out = _post(f"http://127.0.0.1:{web.server_address[1]}", {"text": text})
        assert status == 200 and out["num_prompt_tokens"] == 13 and out["reason"] == "cache"
        assert out["candidates"][0]["cached_blocks"] == 2
    finally:
        web.shutdown()
        service.stop()
        pub.close()
