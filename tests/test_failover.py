"""Failover and fencing with real processes (docs/allocator.md, "Failover and fencing"):
a lease outlives a replica's restart when another replica is up, a client paused past
its TTL refuses to write on, and a reply lost after its call was applied is resent and
applied once. Each test prints its figures (run with ``-s`` to see them)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from kvservice import errors
from kvservice.allocator.server import SERVICE_NAME
from kvservice.channel import channel_target, parse_targets, service_config
from kvservice.client import Client
from kvservice.tools.launcher import AllocatorProcess

from fault_server import DropReply, DroppingServer
from helpers import TEST_SETTINGS, ServerThread, audit, stats, suite_credentials

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
BS = 4
TTL = 3.0
REPLICA_ARGS = ("--reap-interval", "0.1")


# ------------------------------------------------------------------ the channel's target


def test_a_comma_list_or_a_list_of_replicas_becomes_one_static_target_and_one_address_stays_as_it_is():
    assert channel_target(parse_targets("127.0.0.1:5001, 127.0.0.1:5002")) == "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    assert channel_target(parse_targets(["127.0.0.1:5001", "localhost:5002"])) == "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    assert channel_target(parse_targets("[::1]:5001,[::1]:5002")) == "ipv6:[::1]:5001,[::1]:5002"
    assert channel_target(parse_targets("allocator.internal:50051")) == "allocator.internal:50051"
    assert channel_target(parse_targets("dns:///allocator:50051")) == "dns:///allocator:50051"
    for bad in ("", " , ", "127.0.0.1:1,[::1]:2", "127.0.0.1,127.0.0.1:2", "127.0.0.1:1,dns:///a:2"):
        with pytest.raises(ValueError):
            channel_target(parse_targets(bad))


def test_the_retry_policy_spends_the_budget_in_five_attempts_on_unavailable_only():
    config = json.loads(service_config(3.0))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]
    assert method["name"] == [{"service": SERVICE_NAME}]
    policy = method["retryPolicy"]
    assert policy["maxAttempts"] == 5 and policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    backoffs = [float(policy["initialBackoff"][:-1]) * policy["backoffMultiplier"] ** i for i in range(4)]
    assert sum(backoffs) == pytest.approx(3.0, rel=0.01)
    assert max(backoffs) == pytest.approx(float(policy["maxBackoff"][:-1]), rel=0.01)
    with pytest.raises(ValueError):
        service_config(0)


# ------------------------------------------------------------------ a replica restarts


class Load(threading.Thread):
    """Calls through the client without a pause: create, grow across a block, free;
    records each round's start and length, and every error."""

    def __init__(self, client: Client) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.rounds: list[tuple[float, float]] = []
        self.failures: list[tuple[float, BaseException]] = []
        self.done = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.done.is_set():
            started = time.monotonic()
            try:
                s = self.client.create([9, 9, i % 50, i % 7, 1], pool="p0")
                s.append([1, 2, 3, 4, 5])
                s.free()
                self.rounds.append((started, time.monotonic() - started))
            except Exception as exc:  # noqa: BLE001 - every error is a finding
                self.failures.append((started, exc))
            i += 1
            time.sleep(0.005)

    def slowest(self, since: float, until: float) -> float:
        return max((d for t, d in self.rounds if since <= t <= until), default=0.0)


def _wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} after {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.parametrize("local", [True, False], ids=["local", "remote"])
def test_a_3s_lease_survives_a_replica_restart_when_a_second_replica_is_up(redis_url, local):
    a = AllocatorProcess(redis_url, args=REPLICA_ARGS).start()
    b = AllocatorProcess(redis_url, args=REPLICA_ARGS).start()
    restarted = None
    try:
        with Client(a.target, tenant="admin") as admin:
            admin.register_pool("p0", num_blocks=512, block_size=BS)
        c = Client(f"{a.target},{b.target}", tenant="failover", lease_ttl=TTL, local=local)
        held = [c.create(list(range(n)), pool="p0") for n in (3, 6, 11)]
        load = Load(c)
        load.start()
        time.sleep(1.0)

        # A dies; B alone serves for longer than the TTL.
        killed = time.monotonic()
        a.kill()
        time.sleep(TTL + 0.5)
        restarted = AllocatorProcess(redis_url, args=REPLICA_ARGS, port=a.port).start()
        outage = time.monotonic() - killed
        a.stop()
        for s in held:
            s.append([7])
        # B stops (gracefully); the restarted A alone serves for longer than the TTL.
        stopped = time.monotonic()
        b.stop()
        time.sleep(TTL + 0.5)
        load.done.set()
        load.join(30)

        assert load.failures == [], f"calls failed during the outage: {load.failures[:3]}"
        assert c.lease_error is None
        for s in held:
            s.append([8, 9, 10, 11])                     # no LeaseExpired, locally or at the allocator
        c.flush()
        for s in held:
            view = c.get(s.id)
            assert (list(view.block_table), view.num_tokens) == (s.block_table, s.num_tokens)
        assert audit(redis_url) == []
        assert stats(redis_url, "p0")["num_sequences"] == len(held)
        after_kill, after_stop = load.slowest(killed - 0.5, killed + 2), load.slowest(stopped - 0.5, stopped + 2)
        print(f"\n{'local' if local else 'remote'}: A down {outage:.2f} s, B down since; "
              f"{len(load.rounds)} rounds, {len(load.failures)} failed; slowest round around A's kill "
              f"{after_kill * 1000:.0f} ms, around B's stop {after_stop * 1000:.0f} ms; "
              f"median round {sorted(d for _, d in load.rounds)[len(load.rounds) // 2] * 1000:.1f} ms")
        c.close()
        st = stats(redis_url, "p0")
        assert st["num_used_blocks"] == 0 and st["num_sequences"] == 0
        assert audit(redis_url) == []
    finally:
        for p in (a, b, restarted):
            if p is not None:
                p.stop()


def test_a_call_waits_out_the_restart_of_the_only_replica_within_the_retry_budget(redis_url):
    a = AllocatorProcess(redis_url, args=REPLICA_ARGS).start()
    restarted = AllocatorProcess(redis_url, args=REPLICA_ARGS, port=a.port)
    ready: list[float] = []
    restart = threading.Thread(target=lambda: (restarted.start(), ready.append(time.monotonic())), daemon=True)
    try:
        with Client(a.target, tenant="single", lease_ttl=30.0, retry_budget=5.0) as c:
            c.register_pool("p0", num_blocks=64, block_size=BS)
            s = c.create([1, 2, 3], pool="p0")
            a.kill()
            killed = time.monotonic()
            restart.start()
            s.append([4, 5, 6])                          # a Step while nobody serves
            took = time.monotonic() - killed
            restart.join(30)
            print(f"\nthe only replica was down {ready[0] - killed:.2f} s; a Step sent meanwhile took "
                  f"{took:.2f} s (retry budget 5 s)")
            assert list(c.get(s.id).block_table) == s.block_table
        assert audit(redis_url) == []
    finally:
        if restart.is_alive():
            restart.join(30)
        a.stop()
        restarted.stop()


# ------------------------------------------------------------------ a client paused past its TTL

PAUSED = r"""
import sys
from kvservice import errors
from kvservice.client import Client

target, mode, append = sys.argv[1], sys.argv[2], sys.argv[3]
client = Client(target, tenant="paused", lease_ttl=1.5, local=mode == "local")
seq = client.create([1, 2, 3, 4, 5], pool="p0")          # 2 blocks of 4: the last one private
client.flush()
print(seq.id, seq.block_table, flush=True)
sys.stdin.readline()
tokens = [6] if append == "within" else [6, 7, 8, 9]      # stays in the last block, or needs a new one
try:
    seq.append(tokens)
    print("appended", seq.num_tokens, seq.block_table, flush=True)
except errors.LeaseExpired as exc:
    print("LeaseExpired", seq.num_tokens, flush=True)
except errors.KvsError as exc:
    print(type(exc).__name__, exc.reason, flush=True)
"""


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: out.put(proc.stdout.readline()), daemon=True).start()
    try:
        return out.get(timeout=timeout).strip()
    except queue.Empty:
        return ""


@pytest.mark.parametrize("mode,append", [("local", "within"), ("local", "across"), ("remote", "within"),
                                         ("remote", "across")])
def test_a_client_paused_past_its_ttl_refuses_its_next_append_after_it_resumes(redis_url, tmp_path, mode, append):
    script = tmp_path / "paused.py"
    script.write_text(PAUSED)
    with ServerThread(redis_url, TEST_SETTINGS.replace(reserve_min_blocks=2)) as server:
        with Client(server.target, tenant="admin") as admin:
            admin.register_pool("p0", num_blocks=8, block_size=BS)
        creds = suite_credentials()       # (the client process presents the suite's credentials)
        proc = subprocess.Popen([sys.executable, str(script), server.target, mode, append], cwd=ROOT,
                                env={**os.environ, "KVSERVICE_TLS_CA": creds.ca, "KVSERVICE_TOKEN": creds.token},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = _read_line(proc, 60)
            assert line, f"the client never got ready (exit {proc.poll()}):\n{proc.stderr.read()[-3000:]}"
            seq_id = line.split()[0]
            os.kill(proc.pid, signal.SIGSTOP)
            paused = time.monotonic()
            with Client(server.target, tenant="other", lease_ttl=30.0) as other:
                def reaped() -> bool:
                    try:
                        other.get(seq_id)
                        return False
                    except errors.NotFound:
                        return True
                reaped_after = _wait(reaped, 30, "the paused client's lease was never reaped")
                # Another tenant now holds every block of the pool, the paused client's among them.
                taker = other.create(list(range(100, 100 + 8 * BS)), pool="p0")
                assert len(taker.block_table) == 8
                os.kill(proc.pid, signal.SIGCONT)
                resumed = time.monotonic()
                proc.stdin.write("go\n")
                proc.stdin.flush()
                outcome = _read_line(proc, 30)
                print(f"\n{mode} append {append} its block: lease reaped {reaped_after:.2f} s into a "
                      f"{resumed - paused:.2f} s pause (TTL 1.5 s); after SIGCONT: {outcome!r}")
                assert outcome.startswith("LeaseExpired"), outcome
                assert outcome.split()[1] == "5"          # nothing was appended
                assert list(other.get(taker.id).block_table) == taker.block_table
            assert audit(redis_url) == []
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(10)
            proc.stdin.close()
            proc.stdout.close()
            proc.stderr.close()


# ------------------------------------------------------------------ a reply lost after the call was applied


def _run_steps(c: Client) -> list:
    """The same changes every time: creates, growth across blocks, a fork, a free."""
    a = c.create(list(range(1, 7)), pool="p0")
    b = c.create(list(range(1, 10)), pool="p0")
    a.append([7, 8, 9, 10, 11])
    kid = a.fork([12])
    b.append([13, 14, 15])
    b.free()
    kid.append([16, 17, 18, 19])
    return [a, kid]


def _lease_state(c: Client, redis_url: str, seqs: list) -> tuple[int, int, int, int]:
    """(sequences, the pool's last applied journal entry for the lease, referenced blocks,
    journal entries applied): after a flush, the referenced blocks are the tables' blocks."""
    (holding,) = [h for h in c.audit("p0").leases if h.lease_id == c.lease_id]
    st = stats(redis_url, "p0")
    assert st["num_used_blocks"] == len({b for s in seqs for b in s.block_table})
    assert holding.num_reserved_blocks == st["num_reserved_blocks"]
    return holding.num_sequences, holding.applied_entries, st["num_used_blocks"], st.get("journal_entries", 0)


@pytest.mark.parametrize("method,local", [("Sync", True), ("Step", False)])
def test_a_call_applied_whose_reply_is_lost_is_resent_and_applied_once(redis_url, method, local):
    outcomes = {}
    for drop in (False, True):                       # the same run without, then with a lost reply
        redis_flush(redis_url)
        dropper = DropReply(method)
        with DroppingServer(redis_url, dropper) as server:
            with Client(server.target, tenant="admin") as admin:
                admin.register_pool("p0", num_blocks=256, block_size=BS)
            c = Client(server.target, tenant="lost", lease_ttl=30.0, local=local, flush_interval=3600)
            try:
                c.flush()
                seqs = _run_steps(c)
                handled = dropper.handled
                dropper.armed = drop
                started = time.monotonic()
                if local:
                    c.flush()                        # the Sync whose reply is lost
                else:
                    seqs[0].append([20, 21, 22, 23, 24])   # the Step whose reply is lost
                took = time.monotonic() - started
                c.flush()
                assert dropper.dropped == int(drop)
                assert dropper.handled - handled >= 1 + int(drop)   # the resend reached the handler too
                for s in seqs:
                    view = c.get(s.id)
                    assert (list(view.block_table), view.num_tokens) == (s.block_table, s.num_tokens)
                assert audit(redis_url) == []
                outcomes[drop] = _lease_state(c, redis_url, seqs)
                if drop:
                    print(f"\n{method}: reply lost once, resent and answered in {took * 1000:.0f} ms; "
                          f"(sequences, applied entries, blocks in tables, entries applied) = {outcomes[drop]}")
            finally:
                c.close()
    assert outcomes[True] == outcomes[False]          # applied once: as if no reply had been lost


def test_a_sync_whose_every_reply_is_lost_is_sent_again_as_it_was(redis_url):
    """The retry policy gives up on a Sync that was applied: the blocks it was returning
    stay unusable and the blocks it granted are not lost, since the same request (same
    request id) is sent again until it is answered."""
    dropper = DropReply("Sync", every=True)
    with DroppingServer(redis_url, dropper) as server:
        with Client(server.target, tenant="admin") as admin:
            admin.register_pool("p0", num_blocks=64, block_size=4)
        c = Client(server.target, tenant="a", lease_ttl=30.0, local=True, flush_interval=3600, retry_budget=0.2)
        try:
            c.flush()
            seqs = [c.create([1, 2, 3, 4, 5 + i], pool="p0") for i in range(6)]   # partial last blocks
            c.flush()
            c.step(frees=seqs)                # 6 partial blocks back in the reserve: a surplus to return
            dropper.armed = True
            with pytest.raises(errors.Unavailable):
                c.flush()                     # applied (the surplus returned), every reply lost
            dropper.armed = False
            assert dropper.dropped >= 2
            with Client(server.target, tenant="b", lease_ttl=30.0) as other:
                theirs = other.create(list(range(100, 124)), pool="p0")    # from the free list
                mine = c.create([7, 7, 7, 7], pool="p0")
                mine.append([8])              # a block from the reserve, never one returned
                assert not set(theirs.block_table) & set(mine.block_table), (theirs.block_table, mine.block_table)
                c.flush()
                assert c.journal_error is None and c.lease_error is None
                assert audit(redis_url) == []
                held = stats(redis_url, "p0")["num_reserved_blocks"]
                assert held == c.reserved_blocks(), (held, c.reserved_blocks())
        finally:
            c.close()
    assert audit(redis_url) == []


def redis_flush(url: str) -> None:
    r = redis.Redis.from_url(url)
    r.flushall()
    r.close()
