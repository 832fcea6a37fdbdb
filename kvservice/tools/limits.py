"""``kvservice limits``: how long the worst call that the per-call limits allow holds Redis.

Every script runs alone in Redis: while one runs, every other caller waits (a lease whose
keep-alive waits too long expires). The per-call limits (``max_items_per_call``,
``max_blocks_per_call``, ``max_release_per_call``, ``max_forks_per_sequence``,
``max_forks_per_call``, ``max_fork_refs_per_call``) bound what one script call does; this
tool builds, for each script, the largest call they allow, runs it against a private Redis
through the allocator, and reads how long Redis spent in it from Redis's own SLOWLOG
(microseconds of execution, no network). The audit, which is Python over a snapshot, is
timed by wall clock.

A caller never meets those limits: operations larger than one call are carried out in
bounded calls (docs/allocator.md, "Big operations in bounded calls"). The last rows do it
at full size: a prompt of ``--long-tokens`` (default 1,048,576) created, created again from
the prefix cache, forked, appended past a block boundary and freed, as a Step (the SDK's
remote mode) and as a journal (its local mode); each row shows the median and the largest
of all the script calls the operation made.

It prints one row per worst case, with the target (~10 ms on the CI machine). Usage::

    kvservice limits [--long-tokens N] [--max-blocks-per-call N ...]   # the allocator's flags: try other limits
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

#: The longest a script may hold Redis (docs/security.md).
TARGET_MS = 10.0
#: SLOWLOG entries kept (some servers log the commands a script calls as well: an
#: operation of many calls logs tens of thousands).
SLOWLOG_LEN = 200_000


#: Each worst case runs this many times (fresh inputs each time); the target is judged on
#: the median (the first calls into a fresh Redis also pay its memory's growth: the
#: largest is printed beside it).
REPEAT = 5


@dataclass(slots=True)
class Row:
    script: str
    call: str
    ms: float          # the median of the script calls the row made
    max_ms: float = 0.0
    #: False: a figure shown beside the Redis stalls, not one of them (no target).
    stall: bool = True
    #: Judged on the largest call (an operation of many calls), not the median.
    worst: bool = False

    @property
    def met(self) -> bool:
        return not self.stall or (self.max_ms if self.worst else self.ms) <= TARGET_MS


async def _script_ms(r: Any, run: Callable[[], Awaitable[Any]], names: dict[str, str]) -> dict[str, list[float]]:
    """Runs ``run`` and returns, per script, the durations of its EVALSHA calls that Redis
    logged meanwhile (ms)."""
    await r.slowlog_reset()
    await run()
    out: dict[str, list[float]] = {}
    for entry in await r.slowlog_get(SLOWLOG_LEN):
        cmd = [c.decode() if isinstance(c, bytes) else str(c) for c in entry["command"].split()[:2]] \
            if isinstance(entry["command"], (bytes, str)) else []
        if len(cmd) == 2 and cmd[0].upper() == "EVALSHA" and cmd[1] in names:
            out.setdefault(names[cmd[1]], []).append(entry["duration"] / 1000)
    return out


async def measure(settings: Any, progress: Callable[[str], None] = print, long_tokens: int = 1 << 20) -> list[Row]:
    """The worst allowed call of each script under ``settings`` (an allocator Settings),
    and the script calls of operations on a prompt of ``long_tokens``."""
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
        await r.config_set("slowlog-max-len", SLOWLOG_LEN)
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
        epoch = (await a.geometry("limits"))[0]
        used = [10**6]     # the first token no row has used

        def tokens_from(n: int) -> tuple[int, ...]:
            base = used[0]
            used[0] += n
            return tuple(range(base, base + n))

        async def row(script: str, call: str, make: Callable[[int], Awaitable[Any]]) -> None:
            progress(f"limits: {script}: {call}")
            times: list[float] = []
            for i in range(REPEAT):
                times += (await _script_ms(r, lambda: make(i), names)).get(script, [])
            times.sort()
            median = times[len(times) // 2] if times else 0.0
            rows.append(Row(script, call, median, times[-1] if times else 0.0))

        async def create(prompts: list[tuple[int, ...]], who: str = lease) -> list[Any]:
            return (await a.step(who, [], [Create(p, "limits") for p in prompts])).created

        # 1. One create of the longest prompt the limits allow (its blocks: at most
        #    max_blocks), and the same prompt again: every block a prefix-cache hit.
        tokens = max_blocks * bs
        prompts = [tokens_from(tokens) for _ in range(REPEAT)]
        await row("step", f"one create of {tokens:,} tokens ({tokens // bs:,} new blocks)",
                  lambda i: create([prompts[i]]))
        await row("step", f"one create of {tokens:,} cached tokens ({tokens // bs - 1:,} hits)",
                  lambda i: create([prompts[i]]))
        # 2. As many creates as one call takes, sharing the block budget.
        n = s.max_items_per_call
        per = max(1, max_blocks * bs // n)
        await row("step", f"{n:,} creates of {per:,} tokens", lambda i: create([tokens_from(per) for _ in range(n)]))
        # 3. Forks: the most children one call may fork (``max_forks_per_call``, each parent
        #    at most ``max_forks_per_sequence``), of parents as long as the references they
        #    add allow (``max_fork_refs_per_call``).
        k = s.max_forks_per_sequence
        children = min(s.max_forks_per_call, n * k)
        nparents = -(-children // k)
        parent_blocks = max(1, min(s.max_fork_refs_per_call // children, max_blocks // nparents))
        parents = [await create([tokens_from(parent_blocks * bs) for _ in range(nparents)]) for _ in range(REPEAT)]
        await row("step", f"{children} children of {nparents} parents of {parent_blocks} blocks",
                  lambda i: a.step(lease, [Update(p.sequence_id, p.num_tokens, fork_grow_to=(0,) * min(k, children - j * k))
                                           for j, p in enumerate(parents[i])], []))
        # 4. The frees of one Step: sequences of max_blocks_per_call blocks,
        #    max_release_per_call blocks in all.
        longest = max_blocks
        nfree = max(1, s.max_release_per_call // longest)
        victims = [[(await create([tokens_from(longest * bs)]))[0] for _ in range(nfree)] for _ in range(REPEAT)]
        await row("step", f"frees of {nfree} sequences of {longest} blocks", lambda i: a.step(
            lease, [Update(v.sequence_id, v.num_tokens, free=True) for v in victims[i]], []))
        # 5. Syncs that grant the most blocks at once: a background refill of a pool this
        #    large (its cap: 1% of 2^24 blocks), and a step that needs the most at once
        #    (granted max_blocks_per_call per script call).
        await row("sync", f"a background refill (at most {s.max_refill_per_call:,} blocks)", lambda i: a.sync(
            lease, [ReserveRequest("limits", epoch, want_blocks=num_blocks)]))
        need = min(s.max_journal_blocks, 16 * max_blocks)
        await row("sync", f"{need:,} blocks a step needs at once ({max_blocks:,} per script call)", lambda i: a.sync(
            lease, [ReserveRequest("limits", epoch, need_blocks=min(s.max_journal_blocks, (i + 2) * need))]))
        # 6. The longest journals: max_journal_entries decode entries (a block and its
        #    commit each, as a decode step logs them), and frees of the longest sequences;
        #    the allocator applies a journal in script calls of bounded work.
        await _journals(a, s, row, bs, epoch, tokens_from)
        # 7. A resync (after Redis lost acknowledged writes): the lease's whole state in the
        #    pool, as large as a resync may be, every claim kept.
        await _resync(a, s, row, bs, epoch, tokens_from)
        # 8. The placement probe of a create without pool id: the prompt's hashes, a slice
        #    per call.
        await row("probe", f"placement of a {tokens:,}-token prompt", lambda i: a.step(
            lease, [], [Create(prompts[i][::-1], "")]))
        # 8b. Operations larger than one call, at full size, in both SDK modes.
        rows += await _long(a, r, names, lease, epoch, bs, long_tokens, tokens_from, progress)
        # 9. The revoke of a lease holding all of that: the reaper frees it in bounded calls
        #    (the median and the largest of all of them).
        await row("reap", "a revoked lease's sequences and reserve (bounded calls)",
                  lambda i: a.revoke_lease(lease) if i == 0 else asyncio.sleep(0))
        # 10. The audit of the pool: a snapshot read in pieces (the longest Redis command of
        #    it), checked in a thread (the longest pause of the serving event loop meanwhile).
        progress("limits: audit")
        await r.slowlog_reset()
        lags: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append((time.perf_counter() - t) * 1e3 - 1)

        tick = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        await run_audit(a, "limits")
        took = time.perf_counter() - t0
        done.set()
        await tick
        reads = sorted(e["duration"] / 1000 for e in await r.slowlog_get(SLOWLOG_LEN)
                       if not str(e["command"]).upper().lstrip("B'").startswith(("EVALSHA", "SLOWLOG")))
        rows.append(Row("audit", f"a pool of {num_blocks:,} blocks: its longest Redis read ({took:.1f} s in all)",
                        reads[-1] if reads else 0.0, reads[-1] if reads else 0.0))
        lags.sort()
        rows.append(Row("audit", "... meanwhile, the longest pause of the serving event loop",
                        lags[-1] if lags else 0.0, lags[-1] if lags else 0.0, stall=False))
        await store.close()
        await r.aclose()
    return rows


async def _journals(a: Any, s: Any, row: Callable[..., Awaitable[Any]], bs: int, epoch: int,
                    tokens_from: Callable[[int], tuple[int, ...]]) -> None:
    """The sync rows of the longest journals (leases of their own, one per repetition)."""
    from kvservice.allocator.domain import Create, JournalColumns, ReserveRequest, parse_sequence_id

    async def decode_journal() -> tuple[str, JournalColumns]:
        """A lease with max_journal_entries sequences of one full block each, and a journal
        of one entry each: a block from its reserve, and the commit of the block it fills."""
        lease = (await a.grant_lease("limits-journal", 3600.0)).lease_id
        n = s.max_journal_entries
        per = max(1, min(s.max_items_per_call, s.max_blocks_per_call))
        seqs = []
        for start in range(0, n, per):
            seqs += (await a.step(lease, [], [Create(tokens_from(bs), "limits")
                                              for _ in range(start, min(n, start + per))])).created
        _, grants = await a.sync(lease, [ReserveRequest("limits", epoch, need_blocks=n)])
        cols, parents = JournalColumns(), []
        for seq, b in zip(seqs, list(grants[0].granted_blocks)[:n]):
            for name, value in (("kinds", 1), ("sequences", parse_sequence_id(seq.sequence_id)[2]),
                                ("num_tokens", 2 * bs), ("children", 0), ("num_blocks", 1), ("num_commits", 1)):
                getattr(cols, name).append(value)
            cols.blocks.append(b)
            cols.commit_tokens.extend(tokens_from(bs))
            parents.append(seq.last_hash)
        return lease, dataclasses.replace(cols, parent_hashes=b"".join(parents))

    async def free_journal() -> tuple[str, JournalColumns]:
        """A lease with 8 sequences of the longest table, and a journal freeing them."""
        lease = (await a.grant_lease("limits-journal", 3600.0)).lease_id
        longest = s.max_blocks_per_call
        cols = JournalColumns()
        for _ in range(8):
            seq = (await a.step(lease, [], [Create(tokens_from(longest * bs), "limits")])).created[0]
            for name, value in (("kinds", 5), ("sequences", parse_sequence_id(seq.sequence_id)[2]),
                                ("num_tokens", seq.num_tokens), ("children", 0), ("num_blocks", 0),
                                ("num_commits", 0)):
                getattr(cols, name).append(value)
        return lease, cols

    for what, build in ((f"a journal of {s.max_journal_entries:,} decode entries (a block and a commit each)",
                         decode_journal),
                        (f"a journal freeing 8 sequences of {s.max_blocks_per_call} blocks", free_journal)):
        built = [await build() for _ in range(REPEAT)]
        await row("sync", what, lambda i: a.sync(built[i][0], [ReserveRequest("limits", epoch, first_entry=1,
                                                                               entries=built[i][1])]))


async def _resync(a: Any, s: Any, row: Callable[..., Awaitable[Any]], bs: int, epoch: int,
                  tokens_from: Callable[[int], tuple[int, ...]]) -> None:
    """The resync row: leases holding the most a resync may claim (sequences of at most
    max_blocks_per_call blocks, max_journal_blocks in all), each resynced whole (in script
    calls of bounded work: the median and the largest of all of them)."""
    from kvservice.allocator.domain import Create, ReserveRequest, SequenceClaim, parse_sequence_id

    longest = s.max_blocks_per_call
    count = min(s.max_journal_entries, max(1, s.max_journal_blocks // longest))
    count = min(count, 64)      # (64 sequences of the longest table: what the tool builds in seconds)
    leases = []
    for _ in range(REPEAT):
        lease = (await a.grant_lease("limits-resync", 3600.0)).lease_id
        claims = []
        for _ in range(count):
            seq = (await a.step(lease, [], [Create(tokens_from(longest * bs), "limits")])).created[0]
            claims.append(SequenceClaim(parse_sequence_id(seq.sequence_id)[2], seq.num_tokens, tuple(seq.block_table),
                                        seq.num_committed_blocks, seq.last_hash, b"".join(seq.block_hashes),
                                        seq.num_cached_tokens))
        leases.append((lease, tuple(claims)))
    await row("resync", f"a resync of {count} sequences of {longest} blocks ({count * longest:,}; in parts)",
              lambda i: a.sync(leases[i][0], [ReserveRequest("limits", epoch, first_entry=1, resync=leases[i][1])]))


async def _long(a: Any, r: Any, names: dict[str, str], lease: str, epoch: int, bs: int, n: int,
                tokens_from: Callable[[int], tuple[int, ...]], progress: Callable[[str], None]) -> list[Row]:
    """One row per operation on a prompt of ``n`` tokens, larger than one call: every script
    call it made (of any script), their median and the largest. Remote mode: Steps; local
    mode: the same prompt's sequence changed by a journal (Sync), as the SDK sends it."""
    from kvservice.allocator.domain import Create, JournalColumns, ReserveRequest, Update, parse_sequence_id
    from kvservice.journal import FORK, FREE, GROW

    rows: list[Row] = []

    async def timed(mode: str, call: str, run: Callable[[], Awaitable[Any]]) -> Any:
        progress(f"limits: {mode}: {call}")
        out: list[Any] = []

        async def go() -> None:
            out.append(await run())

        got = await _script_ms(r, go, names)
        got.pop("lease_keepalive", None)        # (a Sync's keep-alive: not the operation)
        times = sorted(t for ts in got.values() for t in ts)
        rows.append(Row("+".join(sorted(got)), f"{mode}: {call} ({len(times)} call{'s' if len(times) != 1 else ''})",
                        times[len(times) // 2] if times else 0.0, times[-1] if times else 0.0, worst=True))
        return out[0]

    blocks = -(-n // bs)
    prompt = tokens_from(n)
    size = f"{n:,}-token prompt ({blocks:,} blocks)"
    step = a.step
    a_seq = (await timed("remote", f"create of a {size}", lambda: step(lease, [], [Create(prompt, "limits")]))
             ).created[0]
    b_seq = (await timed("remote", f"the same prompt again ({(n - 1) // bs:,} blocks cached)",
                         lambda: step(lease, [], [Create(prompt, "limits")]))).created[0]
    kid = (await timed("remote", f"fork of the {blocks:,}-block sequence", lambda: step(
        lease, [Update(a_seq.sequence_id, a_seq.num_tokens, fork_grow_to=(0,))], []))).updates[0].children[0]
    await timed("remote", "its child appended past a block boundary", lambda: step(
        lease, [Update(kid.sequence_id, kid.num_tokens, grow_to=-(-kid.num_tokens // bs) * bs + 1)], []))
    await timed("remote", f"free of the {blocks:,}-block sequences", lambda: step(
        lease, [Update(x.sequence_id, -1, free=True) for x in (a_seq, b_seq, kid)], []))
    # Local mode: a lease of its own whose journal forks, grows and frees the sequence.
    local = (await a.grant_lease("limits-local", 3600.0)).lease_id
    seq = (await a.step(local, [], [Create(prompt, "limits")])).created[0]
    number = parse_sequence_id(seq.sequence_id)[2]
    _, grants = await a.sync(local, [ReserveRequest("limits", epoch, need_blocks=2, want_sequence_numbers=1)])
    grant = grants[0]
    child = grant.first_sequence_number
    spare = list(grant.granted_blocks)[:2]
    t = seq.num_tokens
    t1 = -(-t // bs) * bs + 1

    def journal(rows_: list[tuple[int, int, int, int, list[int]]]) -> JournalColumns:
        cols = JournalColumns()
        for kind, n_, tokens, ch, blks in rows_:
            for name, value in (("kinds", kind), ("sequences", n_), ("num_tokens", tokens), ("children", ch),
                                ("num_blocks", len(blks)), ("num_commits", 0)):
                getattr(cols, name).append(value)
            cols.blocks.extend(blks)
        return cols

    entries = [(FORK, number, t, child, []), (GROW, child, t1, 0, spare[:1]), (GROW, number, t1, 0, spare[1:2]),
               (FREE, child, t1, 0, []), (FREE, number, t1, 0, [])]
    what = ["fork of the sequence", "its child appended past a block boundary", "the parent appended likewise",
            "free of the child", "free of the parent"]
    for k, (entry, call) in enumerate(zip(entries, what)):
        await timed("local", f"a journal entry: {call}", lambda k=k, entry=entry: a.sync(local, [ReserveRequest(
            "limits", epoch, first_entry=k + 1, entries=journal([entry]))]))
    await a.revoke_lease(local)
    return rows


def table(rows: list[Row]) -> str:
    """The rows as text: the script(s), the call, the median and the largest Redis time,
    and the verdict (on the median; on the largest for an operation of many calls, marked *)."""
    lines = [f"{'script':<11} {'worst allowed call':<74} {'Redis ms':>9} {'largest':>8}  target",
             "-" * 116]
    for x in rows:
        verdict = ("ok" if x.met else f"OVER {TARGET_MS}") if x.stall else "(not Redis)"
        mark = "*" if x.worst else " "
        lines.append(f"{x.script:<11} {x.call:<74} {x.ms:>9.1f} {x.max_ms:>8.1f}{mark} {verdict}")
    return "\n".join(lines)


def main(settings: Any, long_tokens: int = 1 << 20) -> int:
    rows = asyncio.run(measure(settings, progress=lambda m: print(f"[{m}]", flush=True), long_tokens=long_tokens))
    print(table(rows))
    stalls = [x for x in rows if x.stall]
    over = [x for x in stalls if not x.met]
    print(f"\n{len(stalls) - len(over)}/{len(stalls)} Redis stalls within {TARGET_MS:.0f} ms")
    return 0
