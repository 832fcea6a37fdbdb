"""A Hypothesis state machine: the real allocator (gRPC server, Lua in a real Redis, the
SDK) driven side by side with an in-memory model of DESIGN §3.

What runs: one ``ServerThread`` (reaper every 0.05 s) over the embedded Redis of the
``redis_url`` fixture for the whole test; every example FLUSHALLs Redis and registers a
fresh pool (``NUM_BLOCKS`` = 32 blocks of ``BS`` = 4 tokens: small, so that creates and
growth run into RESOURCE_EXHAUSTED). Clients: a main one (long lease, no keep-alive
thread), an optional side client (its own lease, same or other tenant; its sequences are
freed by revoking the lease with ``close()``), and once per example a short-lease client
(``lease_ttl`` 0.25 s, no keep-alive) whose sequences the reaper frees when the lease
expires (the rule waits for that, at most 5 s).

Rules: create, append, fork (``Sequence`` methods), free, and ``Client.step`` over several
sequences at once mixing appends, forks (children with and without tokens), frees and
creates; side-client open / revoke; short-lease expiry. Prompts come from three token
families (so that they share prefixes), or extend a live sequence's tokens (hits on blocks
committed late, or committed in the same step).

The model is a re-implementation of the allocator and of the SDK's planning, at the level
of abstract blocks: it predicts, before each call, whether it fails with
RESOURCE_EXHAUSTED (with the exact ``needed`` / ``available``; then nothing may change,
neither on the server nor in the SDK handles) and otherwise every effect: reference
counts, copy-on-write pairs, the prefix cache (chained hashes of full blocks, committed
for prompts at create and for later-filled blocks with the next RPC the sequence takes
part in, including its free: the SDK's deferred commit rule), evictable blocks in LRU
order, and **eviction is modelled** (LRU; the pool is small, evictions do happen and are
counted), sequence ids, which sequences take part in the RPC, and whether a step calls the
allocator at all. Each abstract block is bound, when it is born, to the physical id the
server gave it; the binding must stay injective, so comparing the mapped model tables with
the real ones checks the exact equality structure of physical blocks across sequences
(what is shared with what; after a fork parent and child tables are equal, after a CoW
append the last block differs, a free-list or evicted block is reused only when the model
says it is free or was evicted, an evicted block is exactly the LRU victim).

Checked after every rule: the audit finds nothing (``helpers.StateReader.audit``); pool
stats (free, evictable, used = distinct blocks held by live sequences, free + evictable + used ==
num_blocks, sequences, leases and every counter: evictions, cow_copies,
allocation_failures, prefix tokens queried / hit, blocks allocated, ...); the ref map,
hash -> block map and evictable set (in LRU order) read from Redis; the sharing structure
(one physical block per model block and back); and per live sequence: the SDK
handle's block table == ``client.get(id).block_table`` == the model's (mapped), SDK
num_tokens, the allocator's num_tokens (which lags behind local appends), committed
blocks and num_cached_tokens.
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import event as _event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvservice import errors
from kvservice.allocator import keys
from kvservice.common import hashing
from kvservice.client import Client

from helpers import ServerThread, StateReader, examples, flush, sdk_call, sync_redis

BS = 4
NUM_BLOCKS = 32
TENANT = "sm"
MAX_SEQS = 12          # live sequences, so that every check stays cheap
FAMILY = 1000          # token ids of family f at position i: f * FAMILY + i
SHORT_TTL = 0.25

COUNTERS = ("prefix_queried_tokens", "prefix_hit_tokens", "evictions", "cow_copies",
            "allocation_failures", "blocks_allocated", "sequences_created", "sequences_freed",
            "leases_expired", "sequences_reaped")


# ---------------------------------------------------------------------------- the model

@dataclass
class MBlock:
    ref: int = 0
    hash: str | None = None
    phys: int | None = None        # bound to the server's block id when born
    committed_late: bool = False   # hashed by a commit after its sequence's create


@dataclass
class MSeq:
    sid: str
    owner: str                     # client key
    lease: str
    n: int                         # sequence number in the pool
    tenant: str
    family: int
    tokens: list[int]              # the SDK's view (all tokens)
    server_t: int                  # the allocator's num_tokens (lags behind local appends)
    committed: int                 # committed blocks (SDK and allocator agree after each RPC)
    table: list[int]               # abstract block ids
    private: bool                  # the SDK's "last block is ours alone"
    cached: int                    # num_cached_tokens


@dataclass
class Model:
    free: int = NUM_BLOCKS
    blocks: dict[int, MBlock] = field(default_factory=dict)   # referenced or evictable
    lru: list[int] = field(default_factory=list)              # evictable, oldest first
    h2b: dict[str, int] = field(default_factory=dict)
    seqs: dict[str, MSeq] = field(default_factory=dict)
    leases: set[str] = field(default_factory=set)             # leases attached to the pool
    stats: Counter = field(default_factory=Counter)
    next_seq: int = 0
    next_mid: int = 0

    def new_block(self) -> int:
        self.next_mid += 1
        self.blocks[self.next_mid] = MBlock(ref=1)
        return self.next_mid


@dataclass
class Outcome:
    model: Model | None = None          # the model after the call (None: refused)
    rpc: bool = False
    needed: int = 0                     # RESOURCE_EXHAUSTED numbers
    available: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)   # (src, dst) abstract blocks
    children: dict[str, list[str]] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)               # physical ids
    freed: list[str] = field(default_factory=list)
    riders: int = 0
    hits: int = 0                       # prompt tokens served by the prefix cache
    notes: list[str] = field(default_factory=list)                 # coverage events


_roots: dict[str, bytes] = {}


def block_hashes(tenant: str, tokens: list[int], count: int) -> list[str]:
    """Hex hashes of the first ``count`` full blocks, chained from the tenant's root."""
    if tenant not in _roots:
        _roots[tenant] = hashing.root_hash(tenant)
    return [h.hex() for h in hashing.chain_hashes(_roots[tenant], tokens, BS, count)]


def needs_rpc(s: MSeq, added: int) -> bool:
    if added == 0:
        return False
    if len(s.tokens) + added > len(s.table) * BS:
        return True
    return not s.private and len(s.tokens) % BS != 0


def simulate(m0: Model, pool: str, owner: str, lease: str, tenant: str, appends: dict[str, list[int]],
             forks: dict[str, list[list[int]]], frees: list[str], creates: list[tuple[int, list[int]]]) -> Outcome:
    """One ``Client.step`` of client ``owner``: the SDK's plan, then the STEP script."""
    out = Outcome()
    m = copy.deepcopy(m0)
    order = [sid for sid in dict.fromkeys([*frees, *forks, *appends])
             if sid in forks or sid in frees or needs_rpc(m.seqs[sid], len(appends.get(sid, ())))]
    if not order and not creates:
        for sid, tokens in appends.items():
            m.seqs[sid].tokens.extend(tokens)
        out.model = m
        return out
    riders = [sid for sid in appends if sid not in order
              and len(m.seqs[sid].tokens) // BS > m.seqs[sid].committed]
    rider_set = set(riders)
    out.riders = len(riders)
    order += riders
    out.rpc = True

    init = {mid: b.ref for mid, b in m.blocks.items()}
    zero: list[int] = []

    def decref(mid: int) -> None:
        m.blocks[mid].ref -= 1
        assert m.blocks[mid].ref >= 0
        if m.blocks[mid].ref == 0:
            zero.append(mid)

    pre_tokens = {sid: len(m.seqs[sid].tokens) for sid in order}
    # Phase 1: sync lengths, commit full blocks.
    pending: dict[str, int] = {}
    regs: list[tuple[str, int]] = []
    commits: list[tuple[str, int]] = []
    for sid in order:
        rec = m.seqs[sid]
        t = pre_tokens[sid]
        assert not (t > rec.server_t and rec.server_t % BS and m.blocks[rec.table[-1]].ref > 1), \
            "the SDK appended locally into a shared block"
        rec.server_t = t
        full = t // BS
        if full > rec.committed:
            hs = block_hashes(rec.tenant, rec.tokens, full)
            for i in range(rec.committed, full):
                commits.append((hs[i], rec.table[i]))
            rec.committed = full
    # dups: content already cached under h in another block; the block here takes h if
    # this step evicts that block (a hash never disappears while its content is cached).
    dups: dict[str, int] = {}

    def plan_hash(h: str, mid: int) -> None:
        if h not in m.h2b and h not in pending:
            pending[h] = mid
            regs.append((h, mid))
        elif h in m.h2b and h not in dups:
            dups[h] = mid

    for h, mid in commits:
        if m.blocks[mid].hash is None:
            plan_hash(h, mid)
    if commits and set(frees) & {sid for sid in order if pre_tokens[sid] // BS > m0.seqs[sid].committed}:
        out.notes.append("commit with the free")
    # Phase 2: frees (last block first).
    for sid in order:
        if sid in frees:
            for mid in reversed(m.seqs[sid].table):
                decref(mid)
            out.freed.append(sid)

    def grow(rec: MSeq, g: int) -> None:
        if g <= rec.server_t:
            return
        nb = len(rec.table)
        if rec.server_t % BS and m.blocks[rec.table[-1]].ref > 1:
            src = rec.table[-1]
            dst = m.new_block()
            m.blocks[src].ref -= 1
            rec.table[-1] = dst
            out.copies.append((src, dst))
        for _ in range(math.ceil(g / BS) - nb):
            rec.table.append(m.new_block())
        rec.server_t = g

    # Phase 3: forks; children share everything, then grow.
    kids: dict[str, list[tuple[MSeq, list[int]]]] = {}
    for sid in order:
        rec = m.seqs[sid]
        for tokens in forks.get(sid, []) if sid not in rider_set else []:
            child = MSeq("", owner, lease, 0, rec.tenant, rec.family, rec.tokens[:pre_tokens[sid]] + tokens,
                         rec.server_t, rec.committed, list(rec.table), bool(tokens), rec.cached)
            for mid in child.table:
                m.blocks[mid].ref += 1
            grow(child, pre_tokens[sid] + len(tokens))
            kids.setdefault(sid, []).append((child, tokens))
    # Phase 4: growth.
    for sid in order:
        added = len(appends.get(sid, ())) if sid not in rider_set else 0
        if added:
            grow(m.seqs[sid], pre_tokens[sid] + added)
    # Phase 5: creates (longest cached run of full prompt blocks, never the last token).
    made: list[MSeq] = []
    for family, tokens in creates:
        n = len(tokens)
        nfull = n // BS
        hs = block_hashes(tenant, tokens, nfull)
        hits: list[int] = []
        for i in range(min((n - 1) // BS, nfull)):
            mid = pending.get(hs[i])
            if mid is None:
                mid = m.h2b.get(hs[i])
            if mid is None:
                break
            hits.append(mid)
            if m.blocks[mid].committed_late:
                out.notes.append("prefix hit on a block committed after its create")
            if mid not in init:
                out.notes.append("prefix hit on a block allocated in the same step")
            elif init[mid] == 0:
                out.notes.append("prefix hit revives an evictable block")
            elif m.blocks[mid].ref == 0:
                out.notes.append("prefix hit on a block freed in the same step")
            elif mid in pending.values():
                out.notes.append("prefix hit on a block committed in the same step")
        table = []
        for mid in hits:
            m.blocks[mid].ref += 1
            table.append(mid)
        for i in range(len(hits), math.ceil(n / BS)):
            mid = m.new_block()
            table.append(mid)
            if i < nfull:
                plan_hash(hs[i], mid)
        rec = MSeq("", owner, lease, 0, tenant, family, list(tokens), n, nfull, table, True, len(hits) * BS)
        m.stats["prefix_queried_tokens"] += n
        m.stats["prefix_hit_tokens"] += rec.cached
        out.hits += rec.cached
        made.append(rec)

    nplace = sum(1 for mid in m.blocks if mid not in init)
    released = 0
    for mid, r0 in init.items():
        r = m.blocks[mid].ref
        if r0 == 0 and r > 0:
            released -= 1
        if r0 > 0 and r == 0:
            released += 1
    available = m.free + len(m0.lru) + released
    if nplace > available:
        out.needed, out.available = nplace, available
        return out

    # Write phase: hashes, revivals, zeros to the evictable set / free list, allocation.
    late = {mid for _, mid in commits}
    for h, mid in regs:
        m.blocks[mid].hash = h
        m.blocks[mid].committed_late = mid in late
        if mid in late:
            out.notes.append("late commit registered")
        m.h2b[h] = mid
    m.lru = [mid for mid in m.lru if m.blocks[mid].ref == 0]
    done = set()
    for mid in zero:
        b = m.blocks[mid]
        if b.ref == 0 and init.get(mid, 0) > 0 and mid not in done:
            done.add(mid)
            if b.hash is not None:
                m.lru.append(mid)
            else:
                m.free += 1
                del m.blocks[mid]
    take = min(nplace, m.free)
    m.free -= take
    victims, m.lru = m.lru[:nplace - take], m.lru[nplace - take:]
    for mid in victims:
        b = m.blocks.pop(mid)
        keep = dups.get(b.hash)
        if keep is not None and keep in m.blocks and m.blocks[keep].ref > 0:
            m.blocks[keep].hash = b.hash
            m.h2b[b.hash] = keep
            out.notes.append("an evicted block's hash moves to the block with its content")
        else:
            del m.h2b[b.hash]
        out.evicted.append(b.phys)
    m.stats["evictions"] += len(victims)
    m.stats["blocks_allocated"] += nplace
    m.stats["cow_copies"] += len(out.copies)

    # Sequence records: ids (children first, then creates), SDK-side state.
    for sid in order:
        for child, tokens in kids.get(sid, []):
            m.next_seq += 1
            child.n = m.next_seq
            child.sid = hashing.sequence_id(pool, 1, child.n, child.lease)
            m.seqs[child.sid] = child
            out.children.setdefault(sid, []).append(child.sid)
        if sid in frees:
            del m.seqs[sid]
            continue
        rec = m.seqs[sid]
        tokens = appends.get(sid, [])
        if tokens:
            rec.tokens.extend(tokens)
            rec.private = True
        elif sid in forks:
            rec.private = False
    for sid, tokens in appends.items():
        if sid not in order:
            m.seqs[sid].tokens.extend(tokens)
    for rec in made:
        m.next_seq += 1
        rec.n = m.next_seq
        rec.sid = hashing.sequence_id(pool, 1, rec.n, rec.lease)
        m.seqs[rec.sid] = rec
        out.created.append(rec.sid)
    if made:
        m.leases.add(lease)
    m.stats["sequences_created"] += sum(len(k) for k in kids.values()) + len(made)
    m.stats["sequences_freed"] += len(out.freed)
    out.model = m
    return out


def reap(m: Model, lease: str) -> list[str]:
    """The REAP script for one expired (or revoked) lease; returns the freed ids."""
    members = sorted((f"{lease}:{s.n}", sid) for sid, s in m.seqs.items() if s.lease == lease)
    zero: list[int] = []
    for _, sid in members:
        for mid in reversed(m.seqs.pop(sid).table):
            b = m.blocks[mid]
            b.ref -= 1
            if b.ref == 0:
                zero.append(mid)
    for mid in zero:
        b = m.blocks.get(mid)
        if b is not None and b.ref == 0 and mid not in m.lru:
            if b.hash is not None:
                m.lru.append(mid)
            else:
                m.free += 1
                del m.blocks[mid]
    if lease in m.leases:
        m.leases.discard(lease)
        m.stats["leases_expired"] += 1
    m.stats["sequences_reaped"] += len(members)
    m.stats["sequences_freed"] += len(members)
    return [sid for _, sid in members]


# ---------------------------------------------------------------------------- strategies

prompts = st.tuples(st.integers(0, 2), st.integers(1, 26),
                    st.one_of(st.just([]), st.lists(st.integers(0, 2), min_size=1, max_size=2)))
growth = st.one_of(st.tuples(st.just("nat"), st.integers(1, 3)), st.tuples(st.just("nat"), st.integers(4, 9)),
                   st.tuples(st.just("rnd"), st.lists(st.integers(0, 2), min_size=1, max_size=6)))
child_tokens = st.one_of(st.just(None), growth)


def make_prompt(p: tuple[int, int, list[int]]) -> tuple[int, list[int]]:
    family, n, tail = p
    return family, [family * FAMILY + i for i in range(n)] + list(tail)


def make_tokens(s: MSeq, g: tuple | None) -> list[int]:
    """Tokens to append: the family's natural continuation (shared hashes) or small ids."""
    if g is None:
        return []
    if g[0] == "nat":
        start = len(s.tokens)
        return [s.family * FAMILY + start + i for i in range(g[1])]
    return list(g[1])


# ---------------------------------------------------------------------------- the machine

def sdk_state(s) -> tuple:
    """Everything a ``Sequence`` handle holds locally."""
    return (s.block_table, s.num_tokens, s.num_cached_tokens, s.freed, s._committed, s._private,
            list(s._tail), s._last_hash)


def event(name: str) -> None:
    """A Hypothesis event, also counted in ``AllocatorMachine.coverage`` (printed with -s)."""
    AllocatorMachine.coverage[name] += 1
    _event(name)


class AllocatorMachine(RuleBasedStateMachine):
    redis_url = ""
    target = ""
    redis: Any                # a blocking Redis client (a cluster client on a cluster)
    examples = 0
    coverage: Counter = Counter()

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        cls.examples += 1
        flush(self.redis_url)
        self.pool = f"sm{cls.examples}"
        self.model = Model()
        self.handles = {}
        self.clients: dict[str, Client] = {}
        self.tenants: dict[str, str] = {}
        self.sides = 0
        self.short_done = False
        self._open("main", TENANT)
        self.main.register_pool(self.pool, num_blocks=NUM_BLOCKS, block_size=BS)

    @property
    def main(self) -> Client:
        return self.clients["main"]

    def _open(self, key: str, tenant: str, ttl: float = 3600.0) -> Client:
        c = Client(self.target, tenant=tenant, lease_ttl=ttl, keepalive=False)
        self.clients[key] = c
        self.tenants[key] = tenant
        return c

    def teardown(self) -> None:
        for c in self.clients.values():
            try:
                c.close()
            except errors.KvsError:
                pass

    # -- helpers

    def live(self, owner: str | None = None) -> list[str]:
        return sorted(sid for sid, s in self.model.seqs.items()
                      if (owner is None or s.owner == owner) and s.owner in self.clients)

    def owners(self) -> list[str]:
        return sorted({s.owner for s in self.model.seqs.values() if s.owner in self.clients})

    def room(self) -> bool:
        return len(self.model.seqs) < MAX_SEQS

    def call(self, owner: str, how: str, *, appends=None, forks=None, frees=(), creates=(),
             expiring: bool = False) -> Outcome | None:
        """Runs one SDK call and the model side by side; returns the outcome (None when a
        short lease expired under the call: then nothing changed)."""
        appends, forks, frees, creates = dict(appends or {}), dict(forks or {}), list(frees), list(creates)
        c = self.clients[owner]
        exp = simulate(self.model, self.pool, owner, c.lease_id, self.tenants[owner],
                       appends, forks, frees, creates)
        h = self.handles
        rpcs = c.rpc_count
        before = {sid: sdk_state(x) for sid, x in h.items() if x.client is c}
        result = None
        try:
            result, made, child = sdk_call(c, h, self.pool, how, appends, forks, frees, creates)
        except errors.ResourceExhausted as e:
            assert exp.model is None, f"unexpected RESOURCE_EXHAUSTED: {e.message}"
            assert (e.needed, e.available, e.pool_id) == (exp.needed, exp.available, self.pool)
            assert e.partial is None and c.rpc_count == rpcs + 1
            assert {sid: sdk_state(h[sid]) for sid in before} == before, "a refused step changed SDK handles"
            self.model.stats["allocation_failures"] += 1
            event(f"resource exhausted ({how})")
            return exp
        except errors.FailedPrecondition as e:
            if expiring and "expired" in e.message:
                event("short lease expired under a call")
                return None
            raise
        assert exp.model is not None, f"expected RESOURCE_EXHAUSTED ({exp.needed} > {exp.available})"
        self.model = exp.model
        assert c.rpc_count == rpcs + (1 if exp.rpc else 0)
        if result is not None:
            assert result.rpc == exp.rpc
            assert {p: [k.id for k in kids] for p, kids in result.children.items()} == exp.children
            assert [k.id for k in result.created] == exp.created
            new = result.created + [k for kids in result.children.values() for k in kids]
        elif how == "create":
            assert [made.id] == exp.created
            new = [made]
        elif how == "fork":
            assert [child.id] == [k for kids in exp.children.values() for k in kids]
            new = [child]
        else:
            new = []
        for s in new:
            h[s.id] = s
        for sid in exp.freed:
            assert h.pop(sid).freed
        self.bind(exp)
        if result is not None:
            phys = [(self.model.blocks[a].phys, self.model.blocks[b].phys) for a, b in exp.copies]
            assert [(p.src, p.dst) for p in result.copies] == phys
            assert all(p.pool == self.pool for p in result.copies)
        for sid in exp.freed[:1]:
            with pytest.raises(errors.NotFound):
                self.main.get(sid)
        if exp.copies:
            event("copy-on-write")
        if exp.evicted:
            event("eviction")
        if not exp.rpc:
            event("step without RPC")
        if exp.riders:
            event("commit riders")
        for note in dict.fromkeys(exp.notes):
            event(note)
        if exp.hits:
            event("prefix hit")
        if how == "step" and len(exp.freed) + len(exp.children) + len(exp.created) + len(appends) > 2:
            event("step with >2 items")
        return exp

    def bind(self, exp: Outcome) -> None:
        """Binds newly born abstract blocks to the physical ids the server gave them."""
        m = self.model
        owner = {b.phys: mid for mid, b in m.blocks.items() if b.phys is not None}
        born = set()
        for sid, s in m.seqs.items():
            table = self.handles[sid].block_table
            assert len(table) == len(s.table), (sid, table, s.table)
            for mid, phys in zip(s.table, table):
                b = m.blocks[mid]
                if b.phys is None:
                    assert 0 <= phys < NUM_BLOCKS
                    assert phys not in owner, f"block {phys} given out while the model holds it ({sid})"
                    b.phys = phys
                    owner[phys] = mid
                    born.add(phys)
                else:
                    assert b.phys == phys, (sid, table, [m.blocks[x].phys for x in s.table])
        assert all(b.phys is not None for b in m.blocks.values())
        assert set(exp.evicted) <= born, "an evicted block was not reused"

    def reaped(self, lease: str) -> None:
        for sid in reap(self.model, lease):
            self.handles.pop(sid)

    # -- rules

    def draw_prompt(self, data, candidates: list[str]) -> tuple[int, list[int]]:
        """A fresh prompt, or a live sequence's tokens plus a few (hits on blocks committed
        late, or in the same step)."""
        if candidates and data.draw(st.booleans()):
            s = self.model.seqs[data.draw(st.sampled_from(candidates))]
            return s.family, s.tokens + make_tokens(s, data.draw(growth))
        return make_prompt(data.draw(prompts))

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def create(self, data):
        owner = data.draw(st.sampled_from(sorted(self.clients)))
        self.call(owner, "create", creates=[self.draw_prompt(data, self.live())])

    @precondition(lambda self: self.live())
    @rule(data=st.data(), g=growth)
    def append(self, data, g):
        sid = data.draw(st.sampled_from(self.live()))
        s = self.model.seqs[sid]
        self.call(s.owner, "append", appends={sid: make_tokens(s, g)})

    @precondition(lambda self: self.live() and self.room())
    @rule(data=st.data(), g=child_tokens)
    def fork(self, data, g):
        sid = data.draw(st.sampled_from(self.live()))
        s = self.model.seqs[sid]
        self.call(s.owner, "fork", forks={sid: [make_tokens(s, g)]})

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        self.call(self.model.seqs[sid].owner, "free", frees=[sid])

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def step(self, data):
        """Several sequences of one client in one call: appends, forks, frees, creates."""
        owner = data.draw(st.sampled_from(self.owners()))
        chosen = data.draw(st.lists(st.sampled_from(self.live(owner)), min_size=1, max_size=4, unique=True))
        appends, forks, frees = {}, {}, []
        budget = MAX_SEQS - len(self.model.seqs)
        for sid in chosen:
            s = self.model.seqs[sid]
            kinds = ["append", "free", "skip"] + (["fork", "append+fork"] if budget > 0 else [])
            kind = data.draw(st.sampled_from(kinds))
            if kind == "free":
                frees.append(sid)
            if kind in ("fork", "append+fork"):
                n = data.draw(st.integers(1, min(2, budget)))
                budget -= n
                forks[sid] = [make_tokens(s, data.draw(child_tokens)) for _ in range(n)]
            if kind in ("append", "append+fork"):
                appends[sid] = make_tokens(s, data.draw(growth))
        creates = [self.draw_prompt(data, chosen) for _ in range(data.draw(st.integers(0, min(2, max(budget, 0)))))]
        self.call(owner, "step", appends=appends, forks=forks, frees=frees, creates=creates)

    @precondition(lambda self: "side" not in self.clients and self.sides < 2)
    @rule(tenant=st.sampled_from([TENANT, "other"]))
    def open_side_client(self, tenant):
        self.sides += 1
        self._open("side", tenant)

    @precondition(lambda self: self.live("side"))
    @rule()
    def revoke_side_client(self):
        event("revoke with live sequences")
        c = self.clients.pop("side")
        lease = c.lease_id
        c.close()                       # RevokeLease frees its sequences before it returns
        self.reaped(lease)

    @precondition(lambda self: not self.short_done and self.room())
    @rule(ps=st.lists(prompts, min_size=1, max_size=3), fork=st.booleans())
    def short_lease_expires(self, ps, fork):
        """A client with a short lease (SHORT_TTL) and no keep-alive: the reaper frees its sequences."""
        self.short_done = True
        c = self._open("short", TENANT, ttl=SHORT_TTL)
        try:
            alive = True
            for p in ps:
                if self.call("short", "create", creates=[make_prompt(p)], expiring=True) is None:
                    alive = False
                    break
            mine = self.live("short")
            if fork and alive and mine and self.room():
                self.call("short", "fork", forks={mine[0]: [[]]}, expiring=True)
            mine = self.live("short")
            if c.lease_id in self.model.leases:
                deadline = time.monotonic() + 5
                while self.main.pool_stats(self.pool).leases_expired <= self.model.stats["leases_expired"]:
                    assert time.monotonic() < deadline, "the reaper did not free an expired lease in 5 s"
                    time.sleep(0.02)
                handles = [self.handles[sid] for sid in mine]
                self.reaped(c.lease_id)
                event(f"short lease reaped with {len(mine)} sequences")
                for s in handles[:1]:
                    with pytest.raises(errors.FailedPrecondition, match="expired"):
                        s.free()
        finally:
            del self.clients["short"]
            c.close(revoke=False)

    # -- the checks

    @invariant()
    def server_agrees_with_model(self):
        m = self.model
        assert self.reader.audit() == []
        st_ = self.main.pool_stats(self.pool)
        used = sum(1 for b in m.blocks.values() if b.ref > 0)
        assert used + len(m.lru) + m.free == NUM_BLOCKS
        assert (st_.num_used_blocks, st_.num_evictable_blocks, st_.num_free_blocks) == (used, len(m.lru), m.free)
        assert st_.num_free_blocks + st_.num_evictable_blocks + st_.num_used_blocks == st_.num_blocks == NUM_BLOCKS
        assert (st_.num_sequences, st_.num_leases) == (len(m.seqs), len(m.leases))
        assert {k: getattr(st_, k) for k in COUNTERS} == {k: m.stats[k] for k in COUNTERS}
        held = {b for s in m.seqs.values() for b in s.table}
        assert held == {mid for mid, b in m.blocks.items() if b.ref > 0}
        for mid, b in m.blocks.items():
            assert b.ref == sum(s.table.count(mid) for s in m.seqs.values())

        # The raw state (one MULTI: cheaper than helpers.snapshot's event loop).
        with self.redis.pipeline(transaction=True) as pipe:
            for name in ("ref", "h2b"):
                pipe.hgetall(keys.pool_key(self.pool, name))
            pipe.zrange(keys.pool_key(self.pool, "evict"), 0, -1)     # by LRU clock
            ref, h2b, evict = pipe.execute()
        assert {int(b): int(r) for b, r in ref.items()} == {b.phys: b.ref for b in m.blocks.values() if b.ref > 0}
        assert [int(b) for b in evict] == [m.blocks[mid].phys for mid in m.lru]
        assert {h.decode(): int(b) for h, b in h2b.items()} == {h: m.blocks[mid].phys for h, mid in m.h2b.items()}

        sharing: dict[int, int] = {}       # physical block -> abstract block, over all tables
        for sid, s in m.seqs.items():
            h = self.handles[sid]
            server = self.main.get(sid)
            mapped = [m.blocks[mid].phys for mid in s.table]
            assert h.block_table == list(server.block_table) == mapped, sid
            for mid, phys in zip(s.table, server.block_table):
                assert sharing.setdefault(phys, mid) == mid, f"block {phys} shared where the model has two blocks"
            assert len(s.table) == math.ceil(len(s.tokens) / BS)
            assert h.num_tokens == len(s.tokens)
            assert server.num_tokens == s.server_t
            assert server.num_committed_blocks == s.committed
            assert h.num_cached_tokens == server.num_cached_tokens == s.cached
            assert not h.freed
        assert len(set(sharing.values())) == len(sharing), "one model block split over two physical blocks"


# Passing: well under a minute. Failing: Hypothesis shrinks for up to 5 minutes more.
@pytest.mark.timeout(600)
@pytest.mark.cluster_too
def test_allocator_state_machine(redis_url):
    with ServerThread(redis_url) as server, sync_redis(redis_url) as r, StateReader(redis_url) as reader:
        AllocatorMachine.redis_url = redis_url
        AllocatorMachine.reader = reader
        AllocatorMachine.target = server.target
        AllocatorMachine.redis = r
        run_state_machine_as_test(AllocatorMachine, settings=settings(
            max_examples=examples(30, redis_url), stateful_step_count=30, deadline=None, report_multiple_bugs=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    print("\nstate machine coverage:", dict(sorted(AllocatorMachine.coverage.items())))
