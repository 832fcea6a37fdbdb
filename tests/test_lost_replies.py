"""Calls applied whose replies are lost past the retry budget, and a Redis that stalls
(docs/allocator.md, "Steps in doubt"): a real allocator that runs each Step and then holds
its reply past the caller's deadline, or answers UNAVAILABLE, every time; a real Redis
paused for 1.2 s. The caller sees DeadlineExceeded / Unavailable once the budget is spent;
retrying the same step returns what the first attempt made (nothing twice), any other call
settles it first (no wedge, no orphan), and a stall shorter than the budget fails nothing."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import redis

from kvservice import errors
from kvservice.client import Client

from fault_server import DropReply, DroppingServer
from helpers import TEST_SETTINGS, ServerThread, audit, snapshot, stats

BS = 4


@contextlib.contextmanager
def losing(redis_url: str, hang: float, local: bool = False):
    """An allocator that loses (``hang`` 0: UNAVAILABLE; else holds past the deadline) every
    Step reply while its dropper is armed, pool p0 registered, and a client of it; yields
    ``(dropper, client)``."""
    dropper = DropReply("Step", every=True, hang=hang)
    with DroppingServer(redis_url, dropper) as server:
        with Client(server.target, tenant="admin") as admin:
            admin.register_pool("p0", num_blocks=64, block_size=BS)
        with client_of(server, local) as c:
            yield dropper, c


def client_of(server, local: bool = False) -> Client:
    # (a short deadline and budget: each lost reply costs the caller them)
    return Client(server.target, tenant="lost", lease_ttl=30.0, local=local, timeout=1.0, retry_budget=1.5)


def records_of(redis_url: str, c: Client) -> dict[int, dict]:
    return {n: r for n, r in snapshot(redis_url, "p0")["seqs"].items() if r["lease_id"] == c.lease_id}


@pytest.mark.parametrize("hang", [0.0, 1.2], ids=["unavailable", "deadline"])
def test_a_growth_step_whose_replies_are_lost_returns_its_first_outcome_when_retried(redis_url, hang):
    with losing(redis_url, hang) as (dropper, c):
        s = c.create(list(range(1, 7)), pool="p0")
        tokens = list(range(10, 20))               # across three blocks: growth
        dropper.armed = True
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            s.append(tokens)
        dropper.armed = False
        attempts = dropper.handled
        assert attempts >= 2 and s.num_tokens == 6      # applied (and resent), not applied here
        s.append(tokens)                            # the caller retries the same step
        assert s.num_tokens == 16 and len(s.block_table) == 4
        view = c.get(s.id)
        assert (list(view.block_table), view.num_tokens) == (s.block_table, 16)
        assert stats(redis_url, "p0")["num_used_blocks"] == 4     # no block taken twice
        s.append([30, 31])                          # and it goes on
        s.free()
        assert stats(redis_url, "p0")["num_used_blocks"] == 0
        assert audit(redis_url) == []


def test_a_growth_step_whose_replies_are_lost_does_not_wedge_its_sequence(redis_url):
    """The caller does something else: the step in doubt is settled first (sent again, then
    the pool resynchronised to the client's view), and the free goes through."""
    with losing(redis_url, 0.0) as (dropper, c):
        s = c.create(list(range(1, 7)), pool="p0")
        other = c.create(list(range(50, 57)), pool="p0")
        dropper.armed = True
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            s.append(list(range(10, 20)))
        dropper.armed = False
        other.append([60, 61, 62])                 # another step: the doubt settles first
        view = c.get(s.id)
        assert (list(view.block_table), view.num_tokens) == (s.block_table, 6)
        s.free()
        assert set(records_of(redis_url, c)) == {other.number}
        other.free()
        assert stats(redis_url, "p0")["num_used_blocks"] == 0
        assert audit(redis_url) == []


@pytest.mark.parametrize("local", [False, True], ids=["remote", "local"])
def test_a_create_whose_replies_are_lost_returns_its_sequence_when_retried_and_leaves_no_orphan(redis_url, local):
    with losing(redis_url, 1.2, local) as (dropper, c):
        prompt = list(range(1, 12))
        dropper.armed = True
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            c.create(prompt, pool="p0")
        dropper.armed = False
        (made,) = records_of(redis_url, c)         # made once, its reply never came
        seq = c.create(prompt, pool="p0")          # the caller retries: the same sequence
        assert seq.number == made and set(records_of(redis_url, c)) == {made}
        assert stats(redis_url, "p0")["sequences_created"] == 1
        # Lost again, and this time the caller moves on: no orphan after its next call.
        dropper.armed = True
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            c.create(list(range(100, 110)), pool="p0")
        dropper.armed = False
        assert len(records_of(redis_url, c)) == 2
        third = c.create(list(range(200, 205)), pool="p0")
        assert set(records_of(redis_url, c)) == {made, third.number}
        c.flush()
        assert audit(redis_url) == []
    assert audit(redis_url) == []


@pytest.mark.parametrize("local", [False, True], ids=["remote", "local"])
def test_no_step_fails_while_redis_stalls_for_1_2_s_within_the_retry_budget(redis_url, local):
    """Redis paused for 1.2 s (CLIENT PAUSE, every command) under creates without a pool
    (placement), growth and pool listings whose deadline is 0.4 s: each is sent again
    within the retry budget (5 s) and applied once."""
    with ServerThread(redis_url, TEST_SETTINGS) as server:
        with Client(server.target, tenant="admin") as admin:
            for p in ("p0", "p1"):
                admin.register_pool(p, num_blocks=128, block_size=BS)
        c = Client(server.target, tenant="stall", lease_ttl=30.0, local=local, timeout=0.4, retry_budget=5.0)
        admin = redis.Redis.from_url(redis_url)
        try:
            seqs = [c.create(list(range(i * 50, i * 50 + 9))) for i in range(2)]
            timings = []
            for round_ in range(2):
                pause = threading.Thread(target=admin.execute_command, args=("CLIENT", "PAUSE", 1200, "ALL"))
                started = time.monotonic()
                pause.start()
                time.sleep(0.05)
                made = c.step({s: [7, 8, 9, 10, 11] for s in seqs},
                              creates=[list(range(1000 + 100 * round_ + 20 * i, 1000 + 100 * round_ + 20 * i + 6))
                                       for i in range(2)]).created
                listed = [p.pool_id for p in c.pools()]
                timings.append(time.monotonic() - started)
                pause.join()
                assert len(made) == 2 and sorted(listed) == ["p0", "p1"]
                seqs += made
            c.flush()
            created = sum(stats(redis_url, p)["sequences_created"] for p in ("p0", "p1"))
            assert created == len(seqs) == 6, created           # each create made once
            for s in seqs:
                view = c.get(s.id)
                assert list(view.block_table) == s.block_table
            assert audit(redis_url) == []
            print(f"\n{'local' if local else 'remote'}: steps and listings through a 1.2 s stall took "
                  f"{', '.join(f'{t:.2f}' for t in timings)} s")
        finally:
            admin.close()
            c.close()
