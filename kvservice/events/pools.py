"""``kvservice events``: publishes the cache changes of kvservice's own pools as vLLM KV
events (DESIGN §15), for routers that read vLLM's (Dynamo's, llm-d's, ``kvservice router``).

The allocator's scripts append each pool's changes to its stream in the same call that makes
them (an allocator started with ``--kv-events``; ``scripts/lib/pool.lua``, ``EVENTS``), so the
events follow the Redis changes they describe, in order, and a change that was refused has
none. This process reads every registered pool's stream and publishes one batch per read:

- ``S`` (a hash registered on the device, or a lower-tier entry made ready) ->
  ``BlockStored``: the hash (16 bytes), its parent's (None for a chain's first block), its
  tokens (``kvs:tok:<hash>``, written by the allocator before the script; empty if that
  record has expired), the pool's block size, the medium (GPU: device, CPU: host tier,
  STORAGE: disk tier);
- ``R`` -> ``BlockRemoved``; ``C`` (the pool registered anew, or unregistered) ->
  ``AllBlocksCleared``.

The topic is the pool id. Sequence numbers come from Redis (``kvs:events:seq``, one per
batch, never used twice, whichever process publishes) and the position read in each
stream is kept there too (``kvs:events:pos``), so a restarted publisher goes on where the
last one stopped. The replay socket keeps the last ``--buffer`` batches (vLLM's protocol).
Hashes are salted per tenant, but token ids are not: the endpoints reveal the prompts the
pools cache, so keep them on a private network."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from array import array
from typing import Any

from kvservice.allocator import keys
from kvservice.allocator.events import ROOT, tokens_key
from kvservice.events import wire
from kvservice.events.publisher import Publisher

_log = logging.getLogger(__name__)

SEQ = "kvs:events:seq"
POSITIONS = "kvs:events:pos"
MEDIA = {"GPU": wire.MEDIUM_GPU, "CPU": wire.MEDIUM_CPU, "STORAGE": wire.MEDIUM_STORAGE}
READ_COUNT = 512


class PoolEvents:
    """Reads the pools' streams and publishes them (``run`` until ``stop``)."""

    def __init__(self, redis: Any, publisher: Publisher, *, pools: list[str] | None = None,
                 poll_interval: float = 0.02) -> None:
        self.r = redis
        self.publisher = publisher
        self.pools = pools
        self.poll_interval = poll_interval
        self.published = 0
        self.by_pool: dict[str, int] = {}
        self._block_size: dict[str, int] = {}
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.is_set():
            if not self.poll_once():
                self._stop.wait(self.poll_interval)

    def poll_once(self) -> int:
        """One read of every pool's stream; returns the batches published."""
        pools = self.pools if self.pools is not None else sorted(p.decode() for p in self.r.smembers(keys.POOLS))
        n = 0
        for pool in pools:
            n += self._pool(pool)
        return n

    def _pool(self, pool: str) -> int:
        pos = self.r.hget(POSITIONS, pool) or b"0-0"
        got = self.r.xread({keys.pool_key(pool, "events"): pos}, count=READ_COUNT)
        if not got:
            return 0
        entries = got[0][1]
        batch = wire.Batch(time.time(), self._events(pool, entries))
        seq = int(self.r.incr(SEQ)) - 1
        self.publisher.publish(pool, batch, seq=seq)
        self.r.hset(POSITIONS, pool, entries[-1][0])
        self.published += 1
        self.by_pool[pool] = self.by_pool.get(pool, 0) + 1
        return 1

    def _events(self, pool: str, entries: list) -> list[wire.Event]:
        stored: list[bytes] = []
        for _, fields in entries:
            if fields[b"k"] == b"S":
                stored += _split(fields[b"h"])
        tokens = self._tokens(stored)
        bs = self._pool_block_size(pool)
        out: list[wire.Event] = []
        for _, fields in entries:
            kind, medium = fields[b"k"], MEDIA.get(fields[b"m"].decode(), None)
            hashes = _split(fields[b"h"])
            if kind == b"C":
                out.append(wire.AllBlocksCleared())
            elif kind == b"R":
                out.append(wire.BlockRemoved([bytes.fromhex(h.decode()) for h in hashes], medium))
            else:
                for h in hashes:
                    parent, ids = tokens.get(h, (None, []))
                    out.append(wire.BlockStored([bytes.fromhex(h.decode())], parent, ids, bs, medium))
        return out

    def _tokens(self, hashes: list[bytes]) -> dict[bytes, tuple[bytes | None, list[int]]]:
        """Each hash's (parent hash or None for a root, token ids), from ``kvs:tok``."""
        if not hashes:
            return {}
        with self.r.pipeline(transaction=False) as p:
            for h in hashes:
                p.get(tokens_key(h.decode()))
            records = p.execute()
        parents = {rec[:16] for rec in records if rec and rec != ROOT}
        with self.r.pipeline(transaction=False) as p:
            for parent in parents:
                p.get(tokens_key(parent.hex()))
            roots = {parent for parent, rec in zip(parents, p.execute()) if rec == ROOT}
        out = {}
        for h, rec in zip(hashes, records):
            if rec and rec != ROOT:
                ids = array("I")
                ids.frombytes(rec[16:])
                out[h] = (None if rec[:16] in roots else rec[:16], ids.tolist())
        return out

    def _pool_block_size(self, pool: str) -> int:
        if pool not in self._block_size:
            self._block_size[pool] = int(self.r.hget(keys.pool_key(pool, "meta"), "block_size") or 0)
        return self._block_size[pool]


def _split(joined: bytes) -> list[bytes]:
    return [joined[i:i + 32] for i in range(0, len(joined), 32)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", required=True, metavar="URL", help="the allocator's Redis (one node of a Cluster)")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the PUB socket (default tcp://127.0.0.1:5557)")
    p.add_argument("--replay-endpoint", default="tcp://127.0.0.1:5558",
                   help="the replay (ROUTER) socket; '' none (default tcp://127.0.0.1:5558)")
    p.add_argument("--buffer", type=int, default=10_000, help="batches kept for replay (default 10000)")
    p.add_argument("--metrics-port", type=int, default=9403,
                   help="port of /metrics on 127.0.0.1 (0: any free one; -1: off; default 9403)")
    p.add_argument("--pool", action="append", default=None, help="publish only this pool's events (repeatable; "
                                                                  "default every registered pool)")


def main(args: argparse.Namespace) -> int:
    import redis

    from kvservice.events.server import _redis

    try:
        r = _redis(args.redis)
    except redis.exceptions.RedisError as exc:
        print(f"kvservice events: cannot reach Redis at {args.redis}: {exc}", file=sys.stderr)
        return 1
    replays = [0]
    publisher = Publisher(args.endpoint, args.replay_endpoint, buffer=args.buffer,
                          on_replay=lambda: replays.__setitem__(0, replays[0] + 1))
    source = PoolEvents(r, publisher, pools=args.pool)
    print(f"kvservice events: publishing on {publisher.bound} (replay {publisher.replay_bound or 'none'})",
          flush=True)
    if args.metrics_port >= 0:
        from prometheus_client import CollectorRegistry

        from kvservice.common.metrics import MetricsServer, family

        class Collector:
            def collect(self):
                published = family("events_published_total")
                for pool, n in sorted(source.by_pool.items()):
                    published.add_metric([pool], n)
                yield published
                yield family("events_replays_served_total", replays[0])

        registry = CollectorRegistry()
        registry.register(Collector())
        metrics = MetricsServer(registry, "127.0.0.1", args.metrics_port)
        print(f"kvservice events: /metrics on 127.0.0.1:{metrics.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: source.stop())
    try:
        source.run()
    except KeyboardInterrupt:
        pass
    publisher.close()
    print(f"kvservice events: {source.published} batches published", file=sys.stderr)
    return 0
