"""``kvservice demo``: an embedded Redis, an allocator process, and a client that creates,
forks, grows and frees sequences, printing block tables and the pool's stats."""

from __future__ import annotations

import argparse
import random

from kvservice.client import Client, Sequence
from kvservice.launcher import AllocatorProcess

POOL = "demo-0"
BLOCK_SIZE = 16


def _show(label: str, seq: Sequence) -> None:
    print(f"  {label:<28} {seq.id:<12} tokens={seq.num_tokens:<4} cached={seq.num_cached_tokens:<4} "
          f"blocks={seq.block_table}")


def _stats(client: Client) -> None:
    s = client.pool_stats(POOL)
    print(f"  pool {POOL}: {s.num_blocks} blocks = {s.num_free_blocks} free + "
          f"{s.num_evictable_blocks} evictable + {s.num_used_blocks} used "
          f"(usage {s.usage:.1%}); prefix hits {s.prefix_hit_tokens}/{s.prefix_queried_tokens} tokens; "
          f"CoW copies {s.cow_copies}; evictions {s.evictions}")


def run(target: str) -> None:
    rng = random.Random(7)
    system = [rng.randrange(32000) for _ in range(40)]   # a shared system prompt: 2.5 blocks
    with Client(target, tenant="demo", lease_ttl=5.0) as client:
        pool = client.register_pool(POOL, num_blocks=64, block_size=BLOCK_SIZE, num_layers=4,
                                    num_kv_heads=2, head_dim=64)
        print(f"registered pool {pool.pool_id} (epoch {pool.epoch}): {pool.geometry.num_blocks} blocks "
              f"of {pool.geometry.block_size} tokens")
        _stats(client)

        print("\n1. create two requests that share a 40-token system prompt")
        a = client.create(system + [101, 102, 103], pool=POOL)
        _show("request A (cold)", a)
        b = client.create(system + [201, 202], pool=POOL)
        _show("request B (2 blocks cached)", b)
        _stats(client)

        print("\n2. decode 30 tokens into A: one allocator call per crossed block boundary")
        calls = client.rpc_count
        for t in range(30):
            a.append([1000 + t])
        _show("request A", a)
        print(f"  allocator calls for 30 appends: {client.rpc_count - calls}")

        print("\n3. parallel sampling in one step: three forks of A, and every branch appends a token")
        res = client.step({a: [7000]}, forks={a: [[7001], [7002], [7003]]})
        kids = res.children[a.id]
        for i, k in enumerate(kids):
            _show(f"child {i + 1}", k)
        _show("request A (parent)", a)
        print(f"  copy-on-write pairs of the shared partial last block: {[(c.src, c.dst) for c in res.copies]}"
              f" (the last writer keeps the original)")
        _stats(client)

        print("\n4. free everything: full blocks stay cached (evictable) for later prompts")
        client.step(frees=[a, b, *kids])
        _stats(client)

        print("\n5. the same prompt again hits the cache")
        c = client.create(system + [101, 102, 103], pool=POOL)
        _show("request A again", c)
        c.free()
        _stats(client)

        audit = client.audit(POOL)
        print(f"\naudit: {'ok' if audit.ok else 'FAILED'} {list(audit.problems)}")


def main(args: argparse.Namespace) -> int:
    print("starting an embedded Redis and an allocator ...")
    with AllocatorProcess(args.redis_url or None) as proc:
        print(f"allocator at {proc.target}, Redis at {proc.url}\n")
        run(proc.target)
    print("\nstopped the allocator and its Redis.")
    return 0
