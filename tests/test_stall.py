"""Bounded work (docs/security.md, "Limits"): every script stalls Redis for every other
caller while it runs, so the per-call limits keep the worst allowed call short; here a
stream of such calls (creates, forks, frees, the largest resyncs, and creates larger than
one call, made in parts), from several clients at once, runs beside another tenant's lease of
2 s, which its keep-alives (every 2/3 s) must keep alive throughout. How long each worst
call holds Redis is measured by ``kvservice limits`` (a bench, not a timed test)."""

from __future__ import annotations

import threading
import time

import pytest

from helpers import TEST_SETTINGS, ServerThread, audit
from kvservice import errors
from kvservice.client import Client
from kvservice.v1 import allocator_pb2 as pb

BS = 16
S = TEST_SETTINGS


def _attack(target: str, stop: threading.Event, first: int, counts: dict[str, int], failures: list) -> None:
    """Worst allowed calls, back to back: the longest create (new blocks, then all cached),
    the most forks of the longest parents the fork budget allows, and the frees."""
    longest = S.max_blocks_per_call * BS
    try:
        with Client(target, tenant="attacker", lease_ttl=30) as c:
            n = first
            while not stop.is_set():
                prompt = list(range(n, n + longest))
                n += longest
                a = c.create(prompt, pool="stall")
                b = c.create(prompt, pool="stall")             # every block but the last cached
                parent_blocks = S.max_fork_refs_per_call // S.max_forks_per_call
                p = c.create(list(range(n, n + parent_blocks * BS)), pool="stall")
                n += parent_blocks * BS
                kids = c.step(forks={p: [[]] * S.max_forks_per_call}).children[p.id]
                # ... and larger than one call: a create of four calls' blocks, staged in parts
                big = c.create(list(range(n, n + 4 * longest)), pool="stall")
                n += 4 * longest
                c.step(frees=[a, b, p, big, *kids])             # (long frees go in parts)
                counts["rounds"] = counts.get("rounds", 0) + 1
    except Exception as exc:  # noqa: BLE001 - reported by the test
        failures.append(exc)


def _resyncs(target: str, stop: threading.Event, counts: dict[str, int], failures: list) -> None:
    """The largest resyncs, back to back: a lease holding max_journal_blocks blocks in
    sequences of the longest table sends its whole state again and again (each one
    dropped and claimed again, in parts of bounded work)."""
    longest = S.max_blocks_per_call
    try:
        with Client(target, tenant="resyncer", lease_ttl=30, local=True) as c:
            seqs = [c.create(list(range(n * longest * BS, (n + 1) * longest * BS)), pool="stall")
                    for n in range(1, 1 + min(S.max_journal_entries, S.max_journal_blocks // longest, 32))]
            c.flush()
            pj = c._journals["stall"]
            request = pb.SyncRequest(lease_id=c.lease_id, pools=[pb.PoolSync(
                pool_id="stall", epoch=pj.epoch, first_entry=pj.first_pending,
                resync=pb.PoolResync(sequences=c._claims(pj)))])
            while not stop.is_set():
                reply = c.stub.Sync(request, timeout=60)
                assert list(reply.pools[0].lost_sequences) == [], "a resync of an intact state lost sequences"
                counts["resyncs"] = counts.get("resyncs", 0) + 1
            counts["resync_blocks"] = sum(len(s.block_table) for s in seqs)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        failures.append(exc)


def test_another_tenants_2s_lease_survives_a_stream_of_worst_case_calls(redis_url):
    with ServerThread(redis_url, S) as server:
        with Client(server.target, tenant="admin") as admin:
            admin.register_pool("stall", num_blocks=1 << 18, block_size=BS)
        # The calls of the stream are the largest one call takes; larger ones go in several
        # (a create one block longer, a fork of one child more, are made all the same).
        with Client(server.target, tenant="probe") as probe:
            big = probe.create(list(range(S.max_blocks_per_call * BS + 1)), pool="stall")
            assert len(big.block_table) == S.max_blocks_per_call + 1
            p = probe.create(list(range(BS)), pool="stall")
            kids = probe.step(forks={p: [[]] * (S.max_forks_per_call + 1)}).children[p.id]
            assert len(kids) == S.max_forks_per_call + 1
        victim = Client(server.target, tenant="victim", lease_ttl=2.0)
        mine = victim.create(list(range(7, 7 + 3 * BS)), pool="stall")
        stop = threading.Event()
        counts: dict[str, int] = {}
        failures: list = []
        attackers = [threading.Thread(target=_attack, args=(server.target, stop, 10**7 * (i + 1), counts, failures))
                     for i in range(3)]
        attackers.append(threading.Thread(target=_resyncs, args=(server.target, stop, counts, failures)))
        for t in attackers:
            t.start()
        try:
            deadline = time.monotonic() + 6.0      # three TTLs of the victim's lease
            while time.monotonic() < deadline and not failures:
                time.sleep(0.1)
                assert victim.lease_error is None, victim.lease_error
        finally:
            stop.set()
            for t in attackers:
                t.join(60)
        assert not failures, failures
        print(f"stream: {counts}")
        assert counts.get("rounds", 0) >= 3 and counts.get("resyncs", 0) >= 2, counts    # (the stream did run)
        # The victim's lease lived throughout: its keep-alives got through, its sequence is there.
        assert victim.lease_error is None
        assert victim.get(mine.id).num_tokens == 3 * BS
        victim.step({mine: [1, 2, 3]})
        victim.close()
        assert audit(redis_url) == []
