"""``kvservice limits``: how long the worst call that the per-call limits allow holds Redis.

Every script runs alone in Redis: while one runs, every other caller waits (a lease whose
keep-alive waits too long expires). The per-call limits (``max_items_per_call``,
``max_blocks_per_call``, ``max_prompt_tokens``, ``max_forks_per_sequence``,
``max_forks_per_call``, ``max_fork_refs_per_call``) bound what one call may ask; this tool builds, for each script, the largest call they allow, runs it
against a private Redis through the allocator, and reads how long Redis spent in it from
Redis's own SLOWLOG (microseconds of execution, no network). The audit, which is Python
over a snapshot, is timed by wall clock.

It prints one row per worst case, with the target (~10 ms on the CI machine). Usage::

    kvservice limits [--max-blocks-per-call N ...]   # the allocator's flags: try other limits
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

#: The longest a script may hold Redis (docs/security.md).
TARGET_MS = 10.0


@dataclass(slots=True)
class Row:
    script: str
    call: str
    ms: float

    @property
    def met(self) -> bool:
        return self.ms <= TARGET_MS


async def _script_ms(r: Any, run: Callable[[], Awaitable[Any]], names: dict[str, str]) -> dict[str, float]:
    """Runs ``run`` and returns, per script, the longest EVALSHA Redis logged meanwhile (ms)."""
    await r.slowlog_reset()
    await run()
    longest: dict[str, float] = {}
    for entry in await r.slowlog_get(1024):
        cmd = [c.decode() if isinstance(c, bytes) else str(c) for c in entry["command"].split()[:2]] \
            if isinstance(entry["command"], (bytes, str)) else []
        if len(cmd) == 2 and cmd[0].upper() == "EVALSHA" and cmd[1] in names:
            name = names[cmd[1]]
            longest[name] = max(longest.get(name, 0.0), entry["duration"] / 1000)
    return longest


async def measure(settings: Any, progress: Callable[[str], None] = print) -> list[Row]:
    """The worst allowed call of each script under ``settings`` (an allocator Settings)."""
    import redis.asyncio as aioredis

    from kvservice.allocator import lua
    from kvservice.allocator.audit import run_audit
    from kvservice.allocator.core import Allocator
    from kvservice.allocator.domain import Create, ReserveRequest, Update
    from kvservice.allocator.embedded import EmbeddedRedis
    from kvservice.allocator.store import Store, connect
    from kvservice.common.geometry import Geometry

    s = settings
    rows: list[Row] = []
    with EmbeddedRedis() as redis_server:
        r = aioredis.Redis.from_url(redis_server.url)
        await r.config_set("slowlog-log-slower-than", 0)
        await r.config_set("slowlog-max-len", 4096)
        # (a worst case may hold Redis for many seconds: the tool waits it out)
        store = Store(connect(redis_server.url, socket_timeout=3600))
        a = Allocator(store, s)
        names = {}
        for name, script in lua.SCRIPTS.items():
            names[await r.script_load(script.source)] = name
        bs = 16
        max_blocks = s.max_blocks_per_call
        num_blocks = 1 << 24   # the largest pool (every row's blocks stay allocated; the audit reads it)
        await a.register_pool("limits", Geometry(num_blocks, bs, 1, 1, 8, "float16"))
        lease = (await a.grant_lease("limits", 3600.0)).lease_id

        async def row(script: str, call: str, run: Callable[[], Awaitable[Any]]) -> Any:
            progress(f"limits: {script}: {call}")
            got = await _script_ms(r, run, names)
            rows.append(Row(script, call, got.get(script, 0.0)))


        # 1. One create of the longest prompt the limits allow (its blocks: at most max_blocks).
        tokens = min(s.max_prompt_tokens, max_blocks * bs)
        prompt = tuple(range(tokens))
        await row("step", f"one create of {tokens:,} tokens ({tokens // bs:,} new blocks)",
                  lambda: a.step(lease, [], [Create(prompt, "limits")]))
        # 2. The same prompt again: every block a prefix-cache hit.
        created: list[Any] = []

        async def cached() -> None:
            created.append((await a.step(lease, [], [Create(prompt, "limits")])).created[0])

        await row("step", f"one create of {tokens:,} cached tokens ({tokens // bs - 1:,} hits)", cached)
        # 3. As many creates as one call takes, sharing the block budget.
        n = s.max_items_per_call
        per = max(1, min(s.max_prompt_tokens, max_blocks * bs // n))
        await row("step", f"{n:,} creates of {per:,} tokens", lambda: a.step(
            lease, [], [Create(tuple(range(i * per, (i + 1) * per)), "limits") for i in range(n)]))
        # 4. Forks: the most children one call may fork (``max_forks_per_call``, each parent
        #    at most ``max_forks_per_sequence``), of parents as long as the references they
        #    add allow (``max_fork_refs_per_call``).
        k = s.max_forks_per_sequence
        children = min(s.max_forks_per_call, n * k)
        nparents = -(-children // k)
        parent_blocks = max(1, min(s.max_fork_refs_per_call // children, max_blocks // nparents))
        ptoks = parent_blocks * bs
        parents = (await a.step(lease, [], [Create(tuple(range(10**7 + i * ptoks, 10**7 + (i + 1) * ptoks)), "limits")
                                            for i in range(nparents)])).created
        forks = [Update(p.sequence_id, p.num_tokens, fork_grow_to=(0,) * min(k, children - i * k))
                 for i, p in enumerate(parents)]
        await row("step", f"{children} children of {nparents} parents of {parent_blocks} blocks",
                  lambda: a.step(lease, forks, []))
        # 5. Syncs that grant the most blocks at once: a background refill of a pool this
        #    large (its cap: 1% of 2^24 blocks), and a step that needs max_blocks at once.
        epoch = (await a.geometry("limits"))[0]
        await row("sync", f"a background refill (at most {s.max_refill_per_call:,} blocks)", lambda: a.sync(
            lease, [ReserveRequest("limits", epoch, want_blocks=num_blocks)]))
        await row("sync", f"the {max_blocks:,} blocks a step may need at once", lambda: a.sync(
            lease, [ReserveRequest("limits", epoch, need_blocks=max_blocks)]))
        # 6. The placement probe of a create without pool id: every hash of the prompt.
        await row("probe", f"placement of a {tokens:,}-token prompt", lambda: a.step(
            lease, [], [Create(prompt[::-1], "")]))
        # 7. The revoke of a lease holding all of that: the reaper frees it in bounded calls.
        await row("reap", "a revoked lease's sequences and reserve (one bounded call)",
                  lambda: a.revoke_lease(lease))
        # 8. The audit of the pool (Python over a snapshot, on the serving loop): wall clock.
        progress("limits: audit")
        t0 = time.perf_counter()
        await run_audit(a, "limits")
        rows.append(Row("audit", f"a pool of {num_blocks:,} blocks (wall clock, Python)",
                        (time.perf_counter() - t0) * 1e3))
        await store.close()
        await r.aclose()
    return rows


def table(rows: list[Row]) -> str:
    lines = [f"{'script':<8} {'worst allowed call':<62} {'Redis ms':>9}  target",
             "-" * 92]
    for x in rows:
        lines.append(f"{x.script:<8} {x.call:<62} {x.ms:>9.1f}  {'ok' if x.met else 'OVER ' + str(TARGET_MS)}")
    return "\n".join(lines)


def main(settings: Any) -> int:
    rows = asyncio.run(measure(settings, progress=lambda m: print(f"[{m}]", flush=True)))
    print(table(rows))
    over = [x for x in rows if not x.met]
    print(f"\n{len(rows) - len(over)}/{len(rows)} within {TARGET_MS:.0f} ms")
    return 0
