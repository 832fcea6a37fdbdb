"""A Hypothesis state machine for the lower tiers (DESIGN §12, scripts/lib/tiers.lua): the
real allocator (gRPC server, Lua in a real Redis, the SDK) driven by creates and frees
that evict blocks (offload orders), hit the host and disk tiers (load orders) and evict
tier entries (host -> disk orders, reused entries), by settlements that confirm or fail
copies, by failed loads, by the hashes of failed loads forgotten (SettleTiers forget) and by
re-registrations that keep the disk tier or not; beside a
model of every tier entry's state (pending with a hash, ready with a hash).

What runs: one ``ServerThread`` over the ``redis_url`` Redis (and the local Redis Cluster);
every example FLUSHALLs and registers a pool of ``NUM_BLOCKS`` = 8 blocks of 4 tokens with
a host tier of 3 entries and a disk tier of 4, so that every tier fills and evicts.

Checked on every order as it comes back: a load names a ready entry of the model, holding
the hash of the created prompt's block it fills (never a pending one, nor one whose copy
failed, nor one of a dropped epoch); a copy down names an entry of its tier (the model
forgets what that entry held: evicted); a host -> disk copy reads a ready host entry with
that hash. After every rule: the audit is clean, and each tier's ready and pending counts
and its counters (blocks in / out, confirmed, load failures, failed copies) equal the
model's.

The examples are derandomized (a fixed seed): the run in CI is the run checked here, and
the test asserts that it reached every transition above (a create aimed at a ready entry
makes loads frequent; a create that finds the small pool full frees the oldest sequence).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvservice import errors
from kvservice.allocator import keys
from kvservice.client import Client
from kvservice.common import hashing
from kvservice.v1 import allocator_pb2 as pb

from helpers import ServerThread, StateReader, examples, flush, sync_redis

BS = 4
NUM_BLOCKS = 8
HOST, DISK = 3, 4
TENANT = "tiers"
NAMES = {1: "host", 2: "disk"}
ROOT = hashing.root_hash(TENANT)


def hashes(tokens: list[int]) -> list[bytes]:
    return list(hashing.chain_hashes(ROOT, tokens, BS, len(tokens) // BS))



CHAIN = {family: hashes([family * 1000 + t for t in range(20)]) for family in range(3)}
CHAINS = {h: (family, i) for family, chain in CHAIN.items() for i, h in enumerate(chain)}


class TierMachine(RuleBasedStateMachine):
    redis_url = ""
    target = ""
    examples = 0
    coverage: Counter = Counter()

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        cls.examples += 1
        flush(self.redis_url)
        self.pool = f"tm{cls.examples}"
        self.client = Client(self.target, tenant=TENANT, lease_ttl=3600.0, keepalive=False)
        self.client.collect_tier_orders = True
        self._register(kept=False)
        self.live: list[Any] = []
        self.ready: dict[tuple[int, int], bytes] = {}      # (tier, entry) -> hash
        self.pending: dict[tuple[int, int], bytes] = {}
        self.copies: dict[tuple[int, int], pb.TierOrder] = {}   # (tier, entry) -> the order that filled it
        self.loads: list[pb.TierOrder] = []                      # the loads of this epoch
        self.counts: Counter = Counter()                    # (tier name, counter) -> n
        self.creates = 0
        self.reregistrations = 0

    def _register(self, kept: bool) -> None:
        p = self.client.register_pool(self.pool, num_blocks=NUM_BLOCKS, block_size=BS, host_tier_blocks=HOST,
                                      disk_tier_blocks=DISK, disk_tier_kept=kept)
        self.epoch = p.epoch

    def teardown(self) -> None:
        self.client.close()

    def _orders(self, prompt: list[int] | None = None, table: list[int] | None = None) -> None:
        """Checks and applies the orders the last call gave."""
        chain = hashes(prompt) if prompt else []
        for o in self.client.take_tier_orders():
            src, dst = (o.src_tier, o.src), (o.dst_tier, o.dst)
            if o.dst_tier == 0:
                assert self.ready.get(src) == o.block_hash, f"load from {src}: not a ready entry with that hash"
                i = table.index(o.dst)
                assert chain[i] == o.block_hash, "a load fills a block with another block's content"
                self.counts[(NAMES[o.src_tier], "blocks_out")] += 1
                self.counts[(NAMES[o.src_tier], "hit_tokens")] += BS
                self.loads.append(o)
                type(self).coverage["load"] += 1
                continue
            if o.src_tier == 1:
                assert self.ready.get(src) == o.block_hash, "a host -> disk copy of an entry not ready"
                del self.ready[src]                        # (evicted from the host tier)
                type(self).coverage["host -> disk (a host entry evicted)"] += 1
            else:
                type(self).coverage["device -> host"] += 1
            if dst in self.ready:
                type(self).coverage[f"{NAMES[o.dst_tier]} entry evicted"] += 1
            assert dst not in self.pending, f"{dst} given again while its copy is pending"
            self.ready.pop(dst, None)
            self.pending[dst] = o.block_hash
            self.copies[dst] = o
            self.counts[(NAMES[o.dst_tier], "blocks_in")] += 1

    @rule(family=st.integers(0, 2), length=st.integers(5, 21))
    def create(self, family, length):
        prompt = [family * 1000 + i for i in range(length)]
        while True:
            try:
                s = self.client.create(prompt, pool=self.pool)
                break
            except errors.ResourceExhausted:
                self._orders()
                if not self.live:
                    type(self).coverage["pool full"] += 1
                    return
                self.live.pop(0).free()      # (the pool is small: the oldest goes and the create is tried again)
                self._orders()
        self._orders(prompt, list(s.block_table))
        self.live.append(s)
        self.creates += 1
        if len(self.live) > 2:       # (a small pool: the oldest goes, its blocks become evictable)
            self.live.pop(0).free()
            self._orders()

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def create_over_a_tier_entry(self, data):
        """A create of the family whose block a ready entry holds, long enough to reach it,
        preferring an entry whose block is not on the device and whose chain's earlier blocks
        are on the device or ready (then a load is sure, unless the pool is full)."""
        held = set(self.ready.values())
        with sync_redis(self.redis_url) as r:
            device = {bytes.fromhex(h.decode()) for h in r.hkeys(keys.pool_key(self.pool, "h2b"))}
        sure = [h for h in held - device
                if all(CHAIN[CHAINS[h][0]][i] in held | device for i in range(CHAINS[h][1]))]
        h = data.draw(st.sampled_from(sorted(sure or held)))
        family, index = CHAINS[h]
        loads = len(self.loads)
        self.create(family, data.draw(st.integers((index + 1) * BS + 1, 21)))
        fresh = [o for o in self.loads[loads:] if self.ready.get((o.src_tier, o.src)) == o.block_hash]
        if fresh and data.draw(st.booleans()):
            # (the worker found the first load's bytes wrong: the engine drops its entry and
            # has its block's hash forgotten)
            self._fail_load(fresh[0])
            self._forget(fresh[0])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        s = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        s.free()
        self._orders()

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def settle(self, data):
        self._settle(data.draw(st.lists(st.sampled_from(sorted(self.pending)), min_size=1, unique=True)), True)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def fail_copy(self, data):
        self._settle([data.draw(st.sampled_from(sorted(self.pending)))], False)

    def _settle(self, picked: list[tuple[int, int]], ok: bool) -> None:
        settled = [pb.TierSettlement(order=self.copies[key], ok=ok) for key in picked]
        assert self.client.settle_tiers(self.pool, self.epoch, settled) == len(picked)
        for key in picked:
            h = self.pending.pop(key)
            if ok:
                self.ready[key] = h
                self.counts[(NAMES[key[0]], "confirmed")] += 1
            else:
                self.counts[(NAMES[key[0]], "failed_copies")] += 1
        type(self).coverage["settled ok" if ok else "copy failed"] += 1

    def _loaded_ready(self) -> list[pb.TierOrder]:
        return [o for o in self.loads if self.ready.get((o.src_tier, o.src)) == o.block_hash]

    @precondition(lambda self: self._loaded_ready())
    @rule(data=st.data())
    def fail_load(self, data):
        """The worker found a load's bytes wrong (SettleTiers, the load's order not ok): its
        entry, still ready with that hash, is dropped."""
        self._fail_load(data.draw(st.sampled_from(self._loaded_ready())))

    def _fail_load(self, o: pb.TierOrder) -> None:
        key = (o.src_tier, o.src)
        assert self.client.settle_tiers(self.pool, self.epoch, [pb.TierSettlement(order=o, ok=False)]) == 1
        del self.ready[key]
        self.counts[(NAMES[key[0]], "load_failures")] += 1
        type(self).coverage["load failed"] += 1

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def forget(self, data):
        """A load that failed leaves its device block without the content its hash says
        (SettleTiers forget, the load's order): the hash goes, when the block still holds
        it, and every tier entry of that hash with it."""
        self._forget(data.draw(st.sampled_from(self.loads)))

    def _forget(self, o: pb.TierOrder) -> None:
        with sync_redis(self.redis_url) as r:
            held = r.hget(keys.pool_key(self.pool, "b2h"), str(o.dst)) == o.block_hash.hex().encode()
        self.client.settle_tiers(self.pool, self.epoch, [], [], [o])
        if held:
            for entries in (self.ready, self.pending):
                for key in [k for k, v in entries.items() if v == o.block_hash]:
                    del entries[key]
            type(self).coverage["hash forgotten"] += 1
        with sync_redis(self.redis_url) as r:
            assert r.hget(keys.pool_key(self.pool, "b2h"), str(o.dst)) != o.block_hash.hex().encode()
            assert not held or not r.hexists(keys.pool_key(self.pool, "h2b"), o.block_hash.hex())

    @precondition(lambda self: self.creates >= 6 and self.reregistrations < 3)
    @rule(kept=st.booleans())
    def reregister(self, kept):
        self.reregistrations += 1
        self.creates = 0
        self._register(kept)
        self.live = []               # (the old epoch's sequences are gone)
        self.client.take_tier_orders()
        self.pending = {}
        self.loads = []
        self.ready = {k: h for k, h in self.ready.items() if kept and k[0] == 2}
        self.counts = Counter()      # (the counters belong to the epoch)
        type(self).coverage["re-registered, disk kept" if kept else "re-registered"] += 1

    @invariant()
    def tiers_agree_with_model(self):
        assert self.reader.audit(self.pool) == []
        stats = {t.tier: t for t in self.client.pool_stats(self.pool).tiers}
        for code, name in NAMES.items():
            t = stats[name]
            assert t.num_used_blocks == sum(1 for k in self.ready if k[0] == code), name
            assert t.num_pending_blocks == sum(1 for k in self.pending if k[0] == code), name
            for field in ("blocks_in", "blocks_out", "hit_tokens", "confirmed", "load_failures", "failed_copies"):
                assert getattr(t, field) == self.counts[(name, field)], (name, field)


@pytest.mark.timeout(600)
@pytest.mark.cluster_too
def test_tier_state_machine(redis_url):
    TierMachine.coverage = Counter()
    with ServerThread(redis_url) as server, StateReader(redis_url) as reader:
        TierMachine.redis_url = redis_url
        TierMachine.reader = reader
        TierMachine.target = server.target
        run_state_machine_as_test(TierMachine, settings=settings(
            max_examples=examples(25, redis_url, fast=False), stateful_step_count=30, deadline=None, report_multiple_bugs=False, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    print("\ntier state machine coverage:", dict(sorted(TierMachine.coverage.items())))
    for needed in ("device -> host", "host -> disk (a host entry evicted)", "load", "settled ok", "copy failed",
                   "load failed", "re-registered, disk kept", "hash forgotten"):
        assert TierMachine.coverage[needed] > 0, needed
