"""``kvservice bench-index``: the KV event index (``kvservice.events``) at scale, on a
private Redis.

Ingest: ``--instances`` publishers (``kvservice.events.publisher``, vLLM's protocol over
ZMQ on loopback) publish ``BlockStored`` events of ``--blocks-per-event`` blocks each until
the index holds ``--blocks`` blocks in all; one ingester (the router's) applies them.
``events_per_s``: events applied per second, from the first published to the last applied
(``blocks_per_s`` the same in blocks). Lookup: ``--lookups`` prompts of ``--prompt-tokens``
tokens, each a prefix one instance cached in full, ranked over every instance
(``Index.lookup``, what ``Route`` runs): ``lookup_p50_us``, ``lookup_p99_us``.

Usage::

    kvservice bench-index [--blocks 1000000] [--prompt-tokens 4096] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

BLOCK_SIZE = 16


def progress(msg: str) -> None:
    print(f"[bench-index] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks indexed in all (default 1,000,000)")
    p.add_argument("--instances", type=int, default=4, help="publishers, one per instance (default 4)")
    p.add_argument("--blocks-per-event", type=int, default=16,
                   help="blocks of each BlockStored event (default 16: a 256-token prompt)")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="tokens of each looked-up prompt (default 4096)")
    p.add_argument("--lookups", type=int, default=200, help="prompts looked up (default 200)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def _events(instance: int, count: int, per_event: int, chain: int):
    """``count`` BlockStored events of an instance: chains of ``chain`` events (each
    event's first block the previous one's child), the instance's own hashes, its tokens
    drawn from a seed of its own (the same every time)."""
    from kvservice.events import wire

    rng = random.Random(33 + instance)
    n = 0
    while n < count:
        parent = None
        for _ in range(min(chain, count - n)):
            hashes = [(instance << 40) | (n * per_event + i) for i in range(per_event)]
            tokens = [rng.randrange(0, 50000) for _ in range(per_event * BLOCK_SIZE)]
            yield wire.BlockStored(hashes, parent, tokens, BLOCK_SIZE)
            parent = hashes[-1]
            n += 1


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import redis

    from kvservice.allocator.embedded import EmbeddedRedis
    from kvservice.events import wire
    from kvservice.events.index import Index
    from kvservice.events.ingest import Ingester, Source
    from kvservice.events.publisher import Publisher

    per = args.blocks_per_event
    chain = max(1, args.prompt_tokens // (BLOCK_SIZE * per))       # (one chain covers one looked-up prompt)
    events_each = args.blocks // per // args.instances
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        index = Index(r)
        pubs = [Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer=events_each + 1)
                for _ in range(args.instances)]
        ingester = Ingester(index, [Source(f"vllm-{i}", p.bound, p.replay_bound) for i, p in enumerate(pubs)]).start()
        try:
            time.sleep(0.5)
            progress(f"publishing {events_each * args.instances:,} events of {per} blocks "
                     f"({events_each * args.instances * per:,} blocks) from {args.instances} publishers")
            t0 = time.perf_counter()
            for i, p in enumerate(pubs):
                for e in _events(i, events_each, per, chain):
                    p.publish("bench", wire.Batch(time.time(), [e]))
            total = events_each * args.instances
            last = time.monotonic()
            while sum(c.events for c in ingester.counters.values()) < total:
                done = sum(c.events for c in ingester.counters.values())
                if time.monotonic() - last > 10:
                    progress(f"  {done:,} of {total:,} events applied")
                    last = time.monotonic()
                time.sleep(0.05)
            ingest_s = time.perf_counter() - t0
            blocks = sum(index.num_blocks(f"vllm-{i}") for i in range(args.instances))
            progress(f"ingested in {ingest_s:.1f} s; the index holds {blocks:,} blocks")
            prompts = _prompts(args)
            lookups = []
            for k in range(args.lookups):
                prompt = prompts[k % len(prompts)]
                t = time.perf_counter()
                found = index.lookup(prompt)
                lookups.append(time.perf_counter() - t)
                if k < len(prompts) and max(m.blocks for m in found.values()) * BLOCK_SIZE < len(prompt) - BLOCK_SIZE:
                    raise RuntimeError(f"a prompt the index holds was found {max(m.blocks for m in found.values())} "
                                       f"blocks deep only")
        finally:
            ingester.stop()
            for p in pubs:
                p.close()
            r.close()
    lookups.sort()
    return {"blocks": blocks, "instances": args.instances, "events": total, "blocks_per_event": per,
            "ingest_s": ingest_s, "events_per_s": total / ingest_s, "blocks_per_s": total * per / ingest_s,
            "prompt_tokens": args.prompt_tokens, "lookups": len(lookups),
            "lookup_p50_us": statistics.median(lookups) * 1e6,
            "lookup_p99_us": lookups[min(len(lookups) - 1, int(len(lookups) * 0.99))] * 1e6}


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    """Prompts whose whole prefix one instance holds: each instance's first two chains, as
    it published them (drawn again from its seed)."""
    per = args.blocks_per_event
    chain = max(1, args.prompt_tokens // (BLOCK_SIZE * per))
    out = []
    for i in range(args.instances):
        tokens: list[int] = []
        for k, e in enumerate(_events(i, args.blocks // per // args.instances, per, chain)):
            if k >= chain * 2:
                break
            tokens += e.token_ids
            if (k + 1) % chain == 0:
                out.append(tokens[:args.prompt_tokens])
                tokens = []
    return out


def report(fig: dict[str, Any]) -> str:
    return "\n".join([
        f"KV event index, {fig['blocks']:,} blocks over {fig['instances']} instances:",
        f"  ingest: {fig['events_per_s']:,.0f} events/s ({fig['blocks_per_s']:,.0f} blocks/s; "
        f"{fig['events']:,} events of {fig['blocks_per_event']} blocks in {fig['ingest_s']:.1f} s)",
        f"  lookup of a {fig['prompt_tokens']}-token prompt: p50 {fig['lookup_p50_us']:.0f} us, "
        f"p99 {fig['lookup_p99_us']:.0f} us ({fig['lookups']} lookups)"])


def main(args: argparse.Namespace) -> int:
    if min(args.blocks, args.instances, args.blocks_per_event, args.prompt_tokens, args.lookups) < 1:
        print("kvservice bench-index: every count must be positive", file=sys.stderr)
        return 2
    if args.blocks < args.instances * args.blocks_per_event * 2 * max(1, args.prompt_tokens // (BLOCK_SIZE *
                                                                                              args.blocks_per_event)):
        print("kvservice bench-index: --blocks is too few for two prompts per instance", file=sys.stderr)
        return 2
    fig = measure(args)
    print(json.dumps(fig, indent=2) if args.json else report(fig))
    return 0
