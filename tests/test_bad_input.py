"""Every malformed, unknown, stale or unsatisfiable request to every RPC (issue item 6).

One table: each row names an RPC, builds a raw request against a shared baseline state
(registered pools, live / forked / prefix-hit / freed sequences, cached blocks, leases
that are live, foreign, revoked, expired or unknown, a re-registered pool), and states
the status code and a part of the message that must name what was wrong. For every row
the test dumps the whole Redis keyspace (counters aside: every pool's allocation keys
among it) before the call, then checks that it is unchanged (the keys that changed are
named) and the audit is clean, then the code and the message (and, for RESOURCE_EXHAUSTED, the ErrorInfo and
QuotaFailure details). Raw gRPC stubs are used so that nothing is checked on the client
side. Non-integer counts cannot be sent at all (every count is a protobuf int64): the
SDK's TypeError for them is tested at the end.

``ListPools`` takes no input, so it has no row in the table; it is covered (with every
other RPC) by the Redis-unreachable test.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvservice.allocator.config import Settings
from kvservice.allocator.embedded import EmbeddedRedis
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

from conftest import CLUSTER, FLAVORS
from helpers import (TEST_SETTINGS, ServerThread, StateReader, all_keys, audit, credentials_for, flush, snapshot,
                     sync_redis)

#: (each test also runs on a local 3-primary Redis Cluster)
pytestmark = pytest.mark.cluster_too

BS = 4
NUM_BLOCKS = 64
#: The test settings, with request ids remembered for the whole run (the baseline's are reused).
S = TEST_SETTINGS.replace(request_ttl=3600.0, max_sequence_tokens=4096)
IA, NF, FP, PD, RE = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                      grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
                      grpc.StatusCode.RESOURCE_EXHAUSTED)
RPCS = [m.name for m in pb.DESCRIPTOR.services_by_name["Allocator"].methods]
UNKNOWN_LEASE = "feedfacefeedface"


def geometry(**over: Any) -> pb.PoolGeometry:
    g = dict(num_blocks=NUM_BLOCKS, block_size=BS, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
    g.update(over)
    return pb.PoolGeometry(**g)


# ------------------------------------------------------------------ baseline


@dataclass
class Base:
    """Ids of the baseline state that the rows refer to (``{b.<name>}`` in messages)."""

    target: str
    redis_url: str
    stub: Any
    A: str = ""          # the main live lease (tenant t1)
    B: str = ""          # another live lease (tenant t2)
    R: str = ""          # revoked
    E: str = ""          # expired and reaped
    U: str = UNKNOWN_LEASE
    main: str = ""       # p0, 10 tokens: 2 committed blocks + a partial block shared with `fork`
    fork: str = ""       # child of main
    hit: str = ""        # same prompt as main: its 2 full blocks came from the prefix cache
    priv: str = ""       # p0, 9 tokens in 3 private blocks, 1 committed (grown by a step)
    freed: str = ""      # created then freed: its 3 full blocks are cached (evictable)
    other: str = ""      # a sequence of lease B
    r_seq: str = ""      # lease R's sequence (freed by the revoke)
    e_seq: str = ""      # lease E's sequence (reaped)
    stale: str = ""      # p1 at epoch 1; p1 is at epoch 2 now
    p1_seq: str = ""     # p1 at epoch 2
    priv_hash: bytes = b""
    main_hash: bytes = b""
    reader: Any = None   # a StateReader of the Redis
    redis: Any = None    # a client of the Redis

    @property
    def other_untagged(self) -> str:
        return self.other.rpartition("-")[0]

    def future(self, sid: str) -> str:
        pool, _, n = sid.split("/")
        return f"{pool}/9/{n.partition('-')[0]}"


def _build_baseline(target: str, redis_url: str) -> Base:
    channel = credentials_for(target).channel(target)
    st = pb_grpc.AllocatorStub(channel)
    b = Base(target, redis_url, st)
    st.RegisterPool(pb.RegisterPoolRequest(pool_id="p0", geometry=geometry(), request_id="rid-reg"))
    st.RegisterPool(pb.RegisterPoolRequest(pool_id="p1", geometry=geometry(num_blocks=16)))
    b.A = st.GrantLease(pb.GrantLeaseRequest(tenant="t1", ttl_seconds=3600, request_id="rid-lease")).lease_id
    b.B = st.GrantLease(pb.GrantLeaseRequest(tenant="t2", ttl_seconds=3600)).lease_id

    def create(lease: str, tokens: list[int], pool: str = "p0", rid: str = "") -> pb.Sequence:
        return st.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, token_ids=tokens, pool_id=pool,
                                                          request_id=rid))

    main = create(b.A, list(range(10)), rid="rid-create")
    b.main, b.main_hash = main.sequence_id, main.last_hash
    b.fork = st.ForkSequence(pb.ForkSequenceRequest(lease_id=b.A, sequence_id=b.main,
                                                    request_id="rid-fork")).sequence_id
    hit = create(b.A, list(range(10)))
    assert hit.num_cached_tokens == 8
    b.hit = hit.sequence_id
    b.freed = create(b.A, list(range(100, 112))).sequence_id
    st.FreeSequences(pb.FreeSequencesRequest(lease_id=b.A, sequence_ids=[b.freed], request_id="rid-free"))
    b.priv = create(b.A, list(range(200, 206))).sequence_id
    st.Step(pb.StepRequest(lease_id=b.A, request_id="rid-step", updates=[
        pb.SeqUpdate(sequence_id=b.priv, num_tokens=6, grow_to=9)]))
    priv = st.GetSequence(pb.GetSequenceRequest(sequence_id=b.priv))
    assert (priv.num_tokens, len(priv.block_table), priv.num_committed_blocks) == (9, 3, 1)
    b.priv_hash = priv.last_hash
    b.other = create(b.B, list(range(300, 306))).sequence_id

    b.R = st.GrantLease(pb.GrantLeaseRequest(tenant="t1", ttl_seconds=3600)).lease_id
    b.r_seq = create(b.R, list(range(400, 409))).sequence_id
    assert st.RevokeLease(pb.RevokeLeaseRequest(lease_id=b.R)).num_sequences_freed == 1

    b.E = st.GrantLease(pb.GrantLeaseRequest(tenant="t1", ttl_seconds=S.min_lease_ttl)).lease_id
    b.e_seq = create(b.E, list(range(500, 509))).sequence_id

    b.stale = create(b.A, list(range(600, 606)), pool="p1").sequence_id
    st.RegisterPool(pb.RegisterPoolRequest(pool_id="p1", geometry=geometry(num_blocks=16)))
    b.p1_seq = create(b.A, list(range(700, 706)), pool="p1").sequence_id
    assert b.stale.startswith("p1/1/") and b.p1_seq.startswith("p1/2/")

    # Wait until the reaper has freed the expired lease's sequence: the state is then still.
    deadline = time.monotonic() + 10
    n_e = int(b.e_seq.rsplit("/", 1)[1].partition("-")[0])
    while n_e in snapshot(redis_url, "p0")["seqs"]:
        assert time.monotonic() < deadline, "the reaper did not free the expired lease's sequence"
        time.sleep(0.02)
    assert b.E not in snapshot(redis_url, "p0")["leases"]
    assert audit(redis_url) == []
    return b


@pytest.fixture(scope="module", params=[*FLAVORS, CLUSTER])
def base(request, redis_servers):
    """One baseline per Redis flavour (and on a local cluster), shared by every row (no
    row may change it)."""
    url = redis_servers(request.param).url
    flush(url)
    with ServerThread(url, S) as server:
        b = _build_baseline(server.target, url)
        b.reader, b.redis = StateReader(url), sync_redis(url)
        try:
            yield b
        finally:
            b.reader.close()
            b.redis.close()


# ------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Row:
    rpc: str
    name: str
    build: Callable[[Base], Any]
    code: grpc.StatusCode
    message: str | tuple[str, ...]   # str.format(b=base): each must appear in the status message
    needed: int | None = None     # RESOURCE_EXHAUSTED: the blocks the details must report


def upd(sid: str, **kw: Any) -> pb.SeqUpdate:
    kw.setdefault("num_tokens", -1)
    return pb.SeqUpdate(sequence_id=sid, **kw)


def commit(index: int, tokens: list[int]) -> pb.BlockCommit:
    return pb.BlockCommit(index=index, token_ids=tokens)


ROWS: list[Row] = []


def row(rpc: str, name: str, build: Callable[[Base], Any], code: grpc.StatusCode, message: str | tuple[str, ...],
        needed: int | None = None) -> None:
    ROWS.append(Row(rpc, name, build, code, message, needed))


# -- RegisterPool: every bad field, on the live pool p0 (a success would wipe it) and on a new id.
def reg(pool_id: str = "p0", rid: str = "", worker: str = "", **geo: Any) -> Callable[[Base], Any]:
    return lambda b: pb.RegisterPoolRequest(pool_id=pool_id, geometry=geometry(**geo), request_id=rid,
                                            worker_address=worker)


row("RegisterPool", "no-geometry", lambda b: pb.RegisterPoolRequest(pool_id="p0"), IA, "geometry is required")
for pid in ("bad pool!", "-p", "p:0", "a" * 65, "pööl"):
    row("RegisterPool", f"malformed-pool-id-{pid[:8]}", reg(pid), IA, f"malformed pool_id {pid!r}")
for pid in ("p0", "newpool"):
    row("RegisterPool", f"{pid}-num-blocks-0", reg(pid, num_blocks=0), IA, "num_blocks must be in 1..16777216, got 0")
    row("RegisterPool", f"{pid}-num-blocks-negative", reg(pid, num_blocks=-5), IA, "got -5")
    for bs in (0, 3, 6, 512, -4):
        row("RegisterPool", f"{pid}-block-size-{bs}", reg(pid, block_size=bs), IA,
            f"block_size must be a power of two in 1..256, got {bs}")
row("RegisterPool", "num-blocks-too-many", reg(num_blocks=(1 << 24) + 1), IA, f"got {(1 << 24) + 1}")
row("RegisterPool", "num-layers-0", reg(num_layers=0), IA, "num_layers must be in 1..4096, got 0")
row("RegisterPool", "num-kv-heads-negative", reg(num_kv_heads=-1), IA, "num_kv_heads must be in 1..4096, got -1")
row("RegisterPool", "head-dim-0", reg(head_dim=0), IA, "head_dim must be in 1..4096, got 0")
row("RegisterPool", "head-dim-4097", reg(head_dim=4097), IA, "head_dim must be in 1..4096, got 4097")
row("RegisterPool", "dtype-empty", reg(dtype=""), IA, "dtype must be one of float32, float16, bfloat16, got ''")
row("RegisterPool", "dtype-int8", reg(dtype="int8"), IA, "got 'int8'")
row("RegisterPool", "worker-address-too-long", reg(worker="w" * 257), IA, "worker_address is longer than 256")
row("RegisterPool", "host-tier-negative", lambda b: pb.RegisterPoolRequest(
    pool_id="p0", geometry=geometry(), host_tier_blocks=-1), IA, "host_tier_blocks must be in 0..16777216, got -1")
row("RegisterPool", "disk-tier-too-many", lambda b: pb.RegisterPoolRequest(
    pool_id="p0", geometry=geometry(), disk_tier_blocks=(1 << 24) + 1), IA,
    f"disk_tier_blocks must be in 0..16777216, got {(1 << 24) + 1}")
row("RegisterPool", "malformed-request-id", reg(rid="bad rid"), IA, "malformed request_id 'bad rid'")
row("RegisterPool", "request-id-too-long", reg(rid="r" * 129), IA, "malformed request_id")
row("RegisterPool", "reused-request-id", reg(rid="rid-reg", num_blocks=32), IA,
    "request_id rid-reg was already used with different arguments")

# -- DescribePool / GetPoolStats / Audit: the pool id.
for rpc, msg_cls in (("DescribePool", pb.DescribePoolRequest), ("GetPoolStats", pb.GetPoolStatsRequest),
                     ("Audit", pb.AuditRequest)):
    bad_ids = ("bad pool!", "a" * 65, "p0/1") if rpc == "Audit" else ("", "bad pool!", "a" * 65, "p0/1")
    for pid in bad_ids:
        row(rpc, f"malformed-pool-id-{pid[:8]}", lambda b, c=msg_cls, p=pid: c(pool_id=p), IA,
            f"malformed pool_id {pid!r}")
    row(rpc, "unknown-pool", lambda b, c=msg_cls: c(pool_id="nope"), NF, "pool nope is not registered")

# -- SettleTiers: the pool id, its epoch, the orders settled or forgotten (a made-up order
# is no order of the allocator: its order_mac does not match).
def tier_order(pid: str = "p0", epoch: int = 1, **over: Any) -> pb.TierOrder:
    fields = dict(pool_id=pid, epoch=epoch, src_tier=0, src=0, dst_tier=1, dst=0, block_hash=b"h" * 16,
                  order_mac=b"m" * 16)
    fields.update(over)
    return pb.TierOrder(**fields)


def settle(pid: str = "p0", epoch: int = 1, n: int = 1, **over: Any) -> Callable[[Base], Any]:
    return lambda b: pb.SettleTiersRequest(pool_id=pid, epoch=epoch,
                                           settled=[pb.TierSettlement(order=tier_order(pid, epoch, **over), ok=True)] * n)


for pid in ("", "bad pool!", "a" * 65):
    row("SettleTiers", f"malformed-pool-id-{pid[:8]}", settle(pid), IA, f"malformed pool_id {pid!r}")
row("SettleTiers", "unknown-pool", settle("nope"), NF, "pool nope is not registered")
row("SettleTiers", "epoch-0", settle(epoch=0), IA, f"epoch must be in 1..{2**31 - 1}, got 0")
row("SettleTiers", "stale-epoch", settle("p1", epoch=1), FP, "pool p1 is at epoch 2, not 1")
row("SettleTiers", "device-to-device", settle(dst_tier=0), IA, "settled[0].order moves nothing through a lower tier")
row("SettleTiers", "tier-3", settle(dst_tier=3), IA, "settled[0].order: tiers are 0 (device), 1 (host), 2 (disk); got 3")
row("SettleTiers", "entry-negative", settle(dst=-2), IA, "settled[0].order.dst -2 is out of range")
row("SettleTiers", "hash-short", settle(block_hash=b"x"), IA, "settled[0].order.block_hash must be 16 bytes, got 1")
row("SettleTiers", "another-pool", lambda b: pb.SettleTiersRequest(pool_id="p0", epoch=1, settled=[
    pb.TierSettlement(order=tier_order("p1", 2))]), IA, "settled[0].order is for pool 'p1' at epoch 2, not p0 at epoch 1")
row("SettleTiers", "a-fetch", settle(source_pool_id="p1"), IA, "settled[0].order is a fetch")
row("SettleTiers", "too-many", settle(n=65_537), IA, "at most 65536 settlements per call, got 65537")
row("SettleTiers", "made-up-order", settle(), PD, "settled[0].order is not an order of the allocator")
row("SettleTiers", "forget-a-copy", lambda b: pb.SettleTiersRequest(pool_id="p0", epoch=1, forget=[tier_order()]),
    IA, "forget[0] fills no device block (dst_tier 1)")
row("SettleTiers", "forget-made-up", lambda b: pb.SettleTiersRequest(pool_id="p0", epoch=1, forget=[
    tier_order(src_tier=1, dst_tier=0)]), PD, "forget[0] is not an order of the allocator")
row("SettleTiers", "forget-too-many", lambda b: pb.SettleTiersRequest(pool_id="p0", epoch=1,
                                                                      forget=[tier_order(dst_tier=0)] * 65_537),
    IA, "at most 65536 forget orders per call, got 65537")

# -- MigrateSequence (priv: 1 committed block, last hash priv_hash), DrainPool, UnregisterPool.
def migrate(b: Base, sid: str = "", pool: str = "p1", hashes: bytes | None = None, lease: str = "") -> Any:
    return pb.MigrateSequenceRequest(lease_id=lease or b.A, sequence_id=sid or b.priv, pool_id=pool,
                                     block_hashes=b.priv_hash if hashes is None else hashes)


row("MigrateSequence", "another-lease-s-sequence", lambda b: migrate(b, sid=b.other), NF, "not found")
row("MigrateSequence", "unknown-sequence", lambda b: migrate(b, sid=b.future(b.priv)), NF, "not found")
row("MigrateSequence", "hashes-short", lambda b: migrate(b, hashes=b""), IA,
    "has 1 committed blocks: block_hashes needs 16 bytes, got 0")
row("MigrateSequence", "same-pool", lambda b: migrate(b, pool="p0"), IA, "is in pool p0 already")
row("MigrateSequence", "unknown-pool", lambda b: migrate(b, pool="nope"), NF, "pool nope is not registered")
row("MigrateSequence", "malformed-lease", lambda b: migrate(b, lease="x!"), IA, "malformed lease_id 'x!'")
row("DrainPool", "unknown-pool", lambda b: pb.DrainPoolRequest(pool_id="nope"), NF, "pool nope is not registered")
row("DrainPool", "malformed-pool-id", lambda b: pb.DrainPoolRequest(pool_id="bad pool!"), IA,
    "malformed pool_id 'bad pool!'")
row("UnregisterPool", "unknown-pool", lambda b: pb.UnregisterPoolRequest(pool_id="nope"), NF,
    "pool nope is not registered")
row("UnregisterPool", "not-draining", lambda b: pb.UnregisterPoolRequest(pool_id="p0"), FP,
    "pool p0 is not being drained")

# -- Heartbeat: the pool id and the worker's epoch (p1 is at epoch 2).
for pid in ("", "bad pool!", "a" * 65, "p0/1"):
    row("Heartbeat", f"malformed-pool-id-{pid[:8]}", lambda b, p=pid: pb.HeartbeatRequest(pool_id=p, epoch=1), IA,
        f"malformed pool_id {pid!r}")
row("Heartbeat", "unknown-pool", lambda b: pb.HeartbeatRequest(pool_id="nope", epoch=1), NF,
    "pool nope is not registered")
for e in (0, -1, 2**31):
    row("Heartbeat", f"epoch-{e}", lambda b, e=e: pb.HeartbeatRequest(pool_id="p1", epoch=e), IA,
        f"epoch must be in 1..{2**31 - 1}, got {e}")
row("Heartbeat", "stale-epoch", lambda b: pb.HeartbeatRequest(pool_id="p1", epoch=1), FP,
    "pool p1 is at epoch 2, not 1 (re-registered since)")
row("Heartbeat", "future-epoch", lambda b: pb.HeartbeatRequest(pool_id="p1", epoch=3), FP,
    "pool p1 is at epoch 2, not 3")


# -- GrantLease.
def grant(tenant: str = "t1", ttl: float = 30.0, rid: str = "") -> Callable[[Base], Any]:
    return lambda b: pb.GrantLeaseRequest(tenant=tenant, ttl_seconds=ttl, request_id=rid)


for ttl in (0.0, -1.0, 0.05, 3601.0, math.inf, math.nan):
    row("GrantLease", f"ttl-{ttl}", grant(ttl=ttl), IA, f"ttl_seconds must be in 0.1..3600.0, got {ttl}")
for tenant in ("bad tenant", "-t", "t" * 65, "t:1"):
    row("GrantLease", f"malformed-tenant-{tenant[:8]}", grant(tenant), IA, f"malformed tenant {tenant!r}")
row("GrantLease", "malformed-request-id", grant(rid="bad/rid"), IA, "malformed request_id 'bad/rid'")
row("GrantLease", "reused-request-id", grant(ttl=60.0, rid="rid-lease"), IA,
    "request_id rid-lease was already used with different arguments")

# -- KeepAlive / RevokeLease: the lease id.
for rpc, cls in (("KeepAlive", pb.KeepAliveRequest), ("RevokeLease", pb.RevokeLeaseRequest)):
    for lid in ("", "bad lease", "l" * 65, "a:b"):
        row(rpc, f"malformed-lease-{lid[:8]}", lambda b, c=cls, l=lid: c(lease_id=l), IA, f"malformed lease_id {lid!r}")
    row(rpc, "unknown-lease", lambda b, c=cls: c(lease_id=b.U), NF, "lease {b.U} not found")
row("KeepAlive", "revoked-lease", lambda b: pb.KeepAliveRequest(lease_id=b.R), FP, "lease {b.R} was revoked")
row("KeepAlive", "expired-lease", lambda b: pb.KeepAliveRequest(lease_id=b.E), FP, "lease {b.E} has expired")


# -- Sync: the lease (checked by its keep-alive) and each pool's part (checked before it).
def sync(lease: Callable[[Base], str] = lambda b: b.A, rid: str = "", **pool: Any) -> Callable[[Base], Any]:
    fields = {"pool_id": "p0", "epoch": 1, **pool}
    return lambda b: pb.SyncRequest(lease_id=lease(b), request_id=rid, pools=[pb.PoolSync(**fields)])


for lid in ("", "bad lease", "l" * 65, "a:b"):
    row("Sync", f"malformed-lease-{lid[:8]}", sync(lambda b, l=lid: l), IA, f"malformed lease_id {lid!r}")
row("Sync", "unknown-lease", sync(lambda b: b.U), NF, "lease {b.U} not found")
row("Sync", "revoked-lease", sync(lambda b: b.R), FP, "lease {b.R} was revoked")
row("Sync", "expired-lease", sync(lambda b: b.E), FP, "lease {b.E} has expired")
row("Sync", "malformed-request-id", sync(rid="bad rid"), IA, "malformed request_id 'bad rid'")
row("Sync", "malformed-pool-id", sync(pool_id="bad pool!"), IA, "malformed pool_id 'bad pool!'")
row("Sync", "unknown-pool", sync(pool_id="nope"), NF, "pool nope is not registered")
row("Sync", "epoch-0", sync(epoch=0), IA, "pool p0: epoch must be in 1..2147483647, got 0")
row("Sync", "stale-epoch", sync(pool_id="p1", epoch=1), FP, "pool p1 is at epoch 2, not 1 (re-registered since)")
row("Sync", "want-negative", sync(want_blocks=-1), IA, "pool p0: want_blocks -1 is out of range")
row("Sync", "returned-outside-the-pool", sync(returned_blocks=[NUM_BLOCKS]), IA,
    f"pool p0: returned block {NUM_BLOCKS} is outside 0..{NUM_BLOCKS - 1}")
row("Sync", "returned-twice", sync(returned_blocks=[3, 3]), IA, "pool p0: a returned block appears twice")
row("Sync", "pool-twice", lambda b: pb.SyncRequest(lease_id=b.A, pools=[pb.PoolSync(pool_id="p0", epoch=1)] * 2), IA,
    "pool p0 appears twice in one Sync")


def journal(**columns: Any) -> pb.JournalEntries:
    """One GROW entry of sequence 1 to 1 token, with ``columns`` replaced."""
    one = {"kinds": [1], "sequences": [1], "num_tokens": [1], "children": [0], "num_blocks": [0], "num_commits": [0]}
    return pb.JournalEntries(**{**one, **columns})


J1 = "pool p0: journal entry 1:"
row("Sync", "journal-columns-differ", sync(first_entry=1, journal=journal(sequences=[1, 2])), IA,
    "pool p0: the journal's columns have different lengths (kinds 1, sequences 2, num_tokens 1, children 1, "
    "num_blocks 1, num_commits 1)")
row("Sync", "journal-first-entry-0", sync(first_entry=0, journal=journal()), IA,
    "pool p0: first_entry 0 is out of range (entries are numbered from 1)")
row("Sync", "journal-unknown-kind", sync(first_entry=1, journal=journal(kinds=[9])), IA, f"{J1} unknown kind 9")
row("Sync", "journal-sequence-0", sync(first_entry=1, journal=journal(sequences=[0])), IA,
    f"{J1} sequence 0 is out of range")
row("Sync", "journal-blocks-do-not-add-up", sync(first_entry=1, journal=journal(num_blocks=[2], blocks=[1])), IA,
    f"{J1} num_blocks 2: the entries' num_blocks must be >= 0 and add up to the 1 blocks sent")
row("Sync", "journal-block-outside-the-pool",
    sync(first_entry=1, journal=journal(num_blocks=[1], blocks=[NUM_BLOCKS])), IA,
    f"{J1} block {NUM_BLOCKS} is outside 0..{NUM_BLOCKS - 1}")
row("Sync", "journal-commit-tokens-short", sync(first_entry=1, journal=journal(num_commits=[1], commit_tokens=[1])),
    IA, f"{J1} num_commits 1: the entries' num_commits must be >= 0, and {BS} commit_tokens per commit (1 sent)")
row("Sync", "journal-parent-hash-missing",
    sync(first_entry=1, journal=journal(num_commits=[1], commit_tokens=[1] * BS)), IA,
    "pool p0: parent_hashes must hold 16 bytes per entry with commits (1), got 0")
row("Sync", "journal-bad-token",
    sync(first_entry=1, journal=journal(num_commits=[1], commit_tokens=[-1] * BS, parent_hashes=bytes(16))), IA,
    f"{J1} token id -1 is outside 0..2147483647")
row("Sync", "journal-child-on-grow", sync(first_entry=1, journal=journal(children=[5])), IA,
    f"{J1} only FORK entries name a child")
row("Sync", "journal-copy-without-block", sync(first_entry=1, journal=journal(kinds=[2])), IA,
    f"{J1} COPY carries one block, got 0")

# -- Sequence ids, shared by GetSequence, Step, ForkSequence and FreeSequences.
MALFORMED_SIDS = ["", "p0", "p0/1", "p0/x/1", "p0/1/x", "p0/1/2/3", "bad pool/1/1", "p0/-1/1", "p0/1/-1",
                  "p0/1/\u00b2", "p0/\u0661/1", "p0/1/" + "9" * 40]
SEQ_CASES: list[tuple[str, Callable[[Base], str], grpc.StatusCode, str]] = [
    *[(f"malformed-sequence-id-{i}", (lambda b, s=s: s), IA, f"malformed sequence_id {s!r}")
      for i, s in enumerate(MALFORMED_SIDS)],
    ("unknown-pool", lambda b: "nope/1/1", NF, "pool nope is not registered"),
    ("unknown-sequence", lambda b: b.freed, NF, "sequence {b.freed} not found"),
    ("never-created-sequence", lambda b: "p0/1/999", NF, "sequence p0/1/999 not found"),
    ("stale-epoch", lambda b: b.stale, FP, "sequence {b.stale} belongs to epoch 1 but pool p1 was re-registered"),
    ("future-epoch", lambda b: b.future(b.priv), NF, "not found"),
]
for name, sid, code, msg in SEQ_CASES:
    row("GetSequence", name, lambda b, sid=sid: pb.GetSequenceRequest(sequence_id=sid(b)), code, msg)
    row("Step", name, lambda b, sid=sid: pb.StepRequest(lease_id=b.A, updates=[upd(sid(b), grow_to=12)]), code, msg)
    row("ForkSequence", name, lambda b, sid=sid: pb.ForkSequenceRequest(lease_id=b.A, sequence_id=sid(b)), code, msg)
    row("FreeSequences", name, lambda b, sid=sid: pb.FreeSequencesRequest(lease_id=b.A, sequence_ids=[sid(b)]),
        code, msg)
# One bad id among good ones: nothing is freed.
row("FreeSequences", "unknown-among-good", lambda b: pb.FreeSequencesRequest(
    lease_id=b.A, sequence_ids=[b.priv, b.hit, b.freed]), NF, "sequence {b.freed} not found")
row("Step", "unknown-among-good", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, grow_to=12), upd(b.hit, free=True), upd(b.freed, grow_to=20)]), NF, "sequence {b.freed} not found")

def _with(msg: Any, **fields: Any) -> Any:
    for k, v in fields.items():
        setattr(msg, k, v)
    return msg


def _on(rpc: str, b: Base, lease: str, sid: str) -> Any:
    if rpc == "Step":
        return pb.StepRequest(lease_id=lease, updates=[upd(sid, grow_to=12)])
    if rpc == "ForkSequence":
        return pb.ForkSequenceRequest(lease_id=lease, sequence_id=sid)
    return pb.FreeSequencesRequest(lease_id=lease, sequence_ids=[sid])


# -- Leases of the calls that change sequences.
LEASE_CALLS: dict[str, Callable[[Base, str], Any]] = {
    "CreateSequence": lambda b, l: pb.CreateSequenceRequest(lease_id=l, token_ids=[1, 2, 3], pool_id="p0"),
    "Step": lambda b, l: pb.StepRequest(lease_id=l, updates=[upd(b.priv, grow_to=12)]),
    "ForkSequence": lambda b, l: pb.ForkSequenceRequest(lease_id=l, sequence_id=b.priv),
    "FreeSequences": lambda b, l: pb.FreeSequencesRequest(lease_id=l, sequence_ids=[b.priv]),
}
for rpc, call in LEASE_CALLS.items():
    for lid in ("", "bad lease", "l" * 65):
        row(rpc, f"malformed-lease-{lid[:8]}", lambda b, c=call, l=lid: c(b, l), IA, f"malformed lease_id {lid!r}")
    row(rpc, "unknown-lease", lambda b, c=call: c(b, b.U), NF, "lease {b.U} not found")
    row(rpc, "revoked-lease", lambda b, c=call: c(b, b.R), FP, ("lease {b.R}", "revoked"))
    row(rpc, "expired-lease", lambda b, c=call: c(b, b.E), FP, "lease {b.E} has expired")
    row(rpc, "malformed-request-id", lambda b, c=call: _with(c(b, b.A), request_id="bad rid!"), IA,
        "malformed request_id 'bad rid!'")
    if rpc != "CreateSequence":
        # A sequence id's tag is its lease's: to another lease, the id names nothing...
        row(rpc, "sequence-of-another-lease", lambda b, r=rpc: _on(r, b, b.A, b.other), NF,
            "sequence {b.other} not found")
        row(rpc, "other-lease-on-my-sequence", lambda b, r=rpc: _on(r, b, b.B, b.priv), NF,
            "sequence {b.priv} not found")
        # ... and untagged (a server without authentication takes that), the pool refuses it.
        row(rpc, "untagged-sequence-of-another-lease", lambda b, r=rpc: _on(r, b, b.A, b.other_untagged), PD,
            "sequence {b.other_untagged} belongs to another lease")
        row(rpc, "revoked-lease-own-sequence", lambda b, r=rpc: _on(r, b, b.R, b.r_seq), FP,
            ("lease {b.R}", "revoked"))
        row(rpc, "expired-lease-own-sequence", lambda b, r=rpc: _on(r, b, b.E, b.e_seq), FP,
            "lease {b.E} has expired")
        row(rpc, "unknown-lease-in-other-pool", lambda b, r=rpc: _on(r, b, b.U, b.p1_seq), NF, "lease {b.U} not found")
        row(rpc, "revoked-lease-in-other-pool", lambda b, r=rpc: _on(r, b, b.R, b.p1_seq), FP,
            ("lease {b.R}", "revoked"))
        row(rpc, "expired-lease-in-other-pool", lambda b, r=rpc: _on(r, b, b.E, b.p1_seq), FP,
            "lease {b.E} has expired")


# -- Reused request ids (the first call with each id is part of the baseline).
row("CreateSequence", "reused-request-id", lambda b: pb.CreateSequenceRequest(
    lease_id=b.A, request_id="rid-create", token_ids=list(range(11)), pool_id="p0"), IA,
    "request_id rid-create was already used with different arguments")
row("Step", "reused-request-id", lambda b: pb.StepRequest(lease_id=b.A, request_id="rid-step", updates=[
    upd(b.priv, num_tokens=9, grow_to=10)]), IA, "request_id rid-step was already used with different arguments")
row("ForkSequence", "reused-request-id", lambda b: pb.ForkSequenceRequest(
    lease_id=b.A, request_id="rid-fork", sequence_id=b.priv), IA,
    "request_id rid-fork was already used with different arguments")
row("FreeSequences", "reused-request-id", lambda b: pb.FreeSequencesRequest(
    lease_id=b.A, request_id="rid-free", sequence_ids=[b.priv]), IA,
    "request_id rid-free was already used with different arguments")

# -- Prompts: CreateSequence and the creates of a Step.
PROMPT_CASES: list[tuple[str, dict[str, Any], grpc.StatusCode, str, int | None]] = [
    ("empty-prompt", dict(token_ids=[]), IA, "a create needs a non-empty prompt", None),
    ("token-id-negative", dict(token_ids=[1, -1, 2]), IA, "prompt: token id -1 is outside 0..2147483647", None),
    ("token-id-2**31", dict(token_ids=[1, 2**31]), IA, "prompt: token id 2147483648 is outside 0..2147483647", None),
    ("token-id-int64-max", dict(token_ids=[2**63 - 1]), IA, f"token id {2**63 - 1} is outside", None),
    ("prompt-too-long", dict(token_ids=[1] * (S.max_sequence_tokens + 1)), IA,
     f"prompt of {S.max_sequence_tokens + 1} tokens, a sequence holds at most {S.max_sequence_tokens}", None),
    ("unknown-pool", dict(token_ids=[1, 2], pool_id="nope"), NF, "pool nope is not registered", None),
    ("malformed-pool", dict(token_ids=[1, 2], pool_id="bad pool"), IA, "malformed pool_id 'bad pool'", None),
    ("extra-key-too-long", dict(token_ids=[1, 2], extra_key=b"k" * 1025), IA, "extra_key is longer than 1024", None),
    ("not-enough-blocks", dict(token_ids=list(range(1000, 1000 + 100 * BS)), pool_id="p0"), RE,
     "pool p0: needed 100 blocks", 100),
]
for name, fields, code, msg, needed in PROMPT_CASES:
    row("CreateSequence", name, lambda b, f=fields: pb.CreateSequenceRequest(lease_id=b.A, **{"pool_id": "p0", **f}),
        code, msg, needed)
    if needed is not None:   # the good create in front needs one more block
        msg, needed = msg.replace(f"needed {needed} ", f"needed {needed + 1} "), needed + 1
    row("Step", f"create-{name}", lambda b, f=fields: pb.StepRequest(lease_id=b.A, creates=[
        pb.CreateOp(token_ids=[7, 8, 9], pool_id="p0"), pb.CreateOp(**{"pool_id": "p0", **f})]), code, msg, needed)

row("Step", "create-pool-role-unknown", lambda b: pb.StepRequest(lease_id=b.A, creates=[
    pb.CreateOp(token_ids=[1, 2], pool_id="p0", pool_role="decode")]), IA, 'pool_role must be empty or "store", got')
row("Step", "create-pool-role-store-naming-an-engine-pool", lambda b: pb.StepRequest(lease_id=b.A, creates=[
    pb.CreateOp(token_ids=[1, 2], pool_id="p0", pool_role="store")]), IA,
    'a create names pool p0 (role both) with pool_role "store"')

# -- Step: sizes, update fields, commits, growth.
row("Step", "empty-step", lambda b: pb.StepRequest(lease_id=b.A), IA, "a step needs at least one update or create")
row("Step", "too-many-creates", lambda b: pb.StepRequest(lease_id=b.A, creates=[
    pb.CreateOp(token_ids=[i], pool_id="p0") for i in range(S.max_items_per_call + 1)]), IA,
    f"too many items: {S.max_items_per_call + 1} in one call, at most {S.max_items_per_call}")
row("Step", "too-many-updates", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, grow_to=12)] * (S.max_items_per_call + 1)), IA, "too many items")
row("Step", "too-many-items-mixed", lambda b: pb.StepRequest(
    lease_id=b.A, updates=[upd(b.priv, grow_to=12)],
    creates=[pb.CreateOp(token_ids=[i], pool_id="p0") for i in range(S.max_items_per_call)]), IA,
    f"too many items: {S.max_items_per_call + 1} in one call")
row("Step", "too-many-forks", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, fork_grow_to=[0] * (S.max_forks_per_sequence + 1))]), IA,
    f"{S.max_forks_per_sequence + 1} forks, at most {S.max_forks_per_sequence} per step")
row("Step", "duplicate-sequence", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, grow_to=12), upd(b.priv, grow_to=13)]), IA, "sequence {b.priv} appears twice in one step")
row("Step", "duplicate-sequence-free-twice", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.hit, free=True), upd(b.hit, free=True)]), IA, "sequence {b.hit} appears twice in one step")
for value in (-2, 0, 2**31):
    row("Step", f"num-tokens-{value}", lambda b, v=value: pb.StepRequest(lease_id=b.A, updates=[
        upd(b.priv, num_tokens=v, grow_to=12)]), IA,
        "num_tokens must be >= 1" if value == 0 else f"num_tokens {value} is out of range")
row("Step", "num-tokens-below-allocator", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, num_tokens=5, grow_to=12)]), IA, "num_tokens 5 is below the allocator's 9")
row("Step", "num-tokens-beyond-block-table", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, num_tokens=13, grow_to=14)]), IA, "num_tokens 13 exceeds its block table (3 blocks of 4)")
row("Step", "append-into-shared-block-without-step", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.main, num_tokens=11, grow_to=13)]), FP, "appended into its shared last block without a step")
row("Step", "grow-to-negative", lambda b: pb.StepRequest(lease_id=b.A, updates=[upd(b.priv, grow_to=-1)]), IA,
    "grow_to -1 is out of range")
row("Step", "grow-to-2**31", lambda b: pb.StepRequest(lease_id=b.A, updates=[upd(b.priv, grow_to=2**31)]), IA,
    "grow_to 2147483648 is out of range")
row("Step", "grow-to-below-num-tokens", lambda b: pb.StepRequest(lease_id=b.A, updates=[upd(b.priv, grow_to=5)]),
    IA, "grow_to 5 is below num_tokens 9")
row("Step", "grow-beyond-sequence-blocks", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, grow_to=2**31 - 1)]), IA, f"a sequence holds at most {S.max_sequence_tokens}")
row("Step", "fork-grow-beyond-sequence-blocks", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, fork_grow_to=[2**31 - 1] * 3)]), IA, f"a sequence holds at most {S.max_sequence_tokens}")
# (more than one call's work: carried out in parts, and refused as a whole before any part)
row("Step", "grow-beyond-blocks-per-call", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, grow_to=S.max_blocks_per_call * BS), upd(b.hit, grow_to=S.max_blocks_per_call * BS)]), RE,
    f"pool p0: needed {2 * S.max_blocks_per_call - 6} blocks", 2 * S.max_blocks_per_call - 6)
row("Step", "fork-grow-to-negative", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, fork_grow_to=[10, -1])]), IA, "fork_grow_to -1 is out of range")
row("Step", "fork-grow-to-below-num-tokens", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, fork_grow_to=[10, 3])]), IA, "fork_grow_to 3 is below num_tokens 9")
row("Step", "free-and-grow", lambda b: pb.StepRequest(lease_id=b.A, updates=[upd(b.priv, free=True, grow_to=12)]),
    IA, "sequence {b.priv} cannot be freed and forked or grown in one step")
row("Step", "free-and-fork", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, free=True, fork_grow_to=[0])]), IA, "cannot be freed and forked or grown")
row("Step", "not-enough-blocks-grow", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, grow_to=NUM_BLOCKS * BS)]), RE,
    f"pool p0: needed {NUM_BLOCKS - 3} blocks", NUM_BLOCKS - 3)
row("Step", "not-enough-blocks-fork", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, fork_grow_to=[NUM_BLOCKS * BS])]), RE, f"needed {NUM_BLOCKS - 3 + 1} blocks", NUM_BLOCKS - 2)
# Commits: b.priv holds 9 tokens, block 0 committed; block 1 is full and may be committed.
GOOD_BLOCK = [204, 205, 206, 207]


def commit_step(commits: list[pb.BlockCommit], num_tokens: int = 9, parent: bytes | None = None,
                **kw: Any) -> Callable[[Base], Any]:
    return lambda b: pb.StepRequest(lease_id=b.A, updates=[upd(
        b.priv, num_tokens=num_tokens, parent_hash=b.priv_hash if parent is None else parent,
        commits=commits, **kw)])


row("Step", "commit-too-few-tokens", commit_step([commit(1, GOOD_BLOCK[:3])]), IA,
    "sequence {b.priv}: block 1 has 3 tokens, a full block has 4")
row("Step", "commit-too-many-tokens", commit_step([commit(1, GOOD_BLOCK + [1])]), IA, "block 1 has 5 tokens")
row("Step", "commit-no-tokens", commit_step([commit(1, [])]), IA, "block 1 has 0 tokens")
row("Step", "commits-not-consecutive", commit_step([commit(1, GOOD_BLOCK), commit(3, GOOD_BLOCK)],
                                                   num_tokens=12), IA, "commits must be consecutive blocks")
row("Step", "commits-repeated", commit_step([commit(1, GOOD_BLOCK), commit(1, GOOD_BLOCK)]), IA,
    "commits must be consecutive blocks")
row("Step", "commit-wrong-start", commit_step([commit(0, [200, 201, 202, 203])]), IA,
    "commit starts at block 0 but 1 blocks are committed")
row("Step", "commit-negative-index", commit_step([commit(-1, GOOD_BLOCK)]), IA, "commit starts at block -1")
row("Step", "commit-block-not-full", commit_step([commit(1, GOOD_BLOCK), commit(2, [208, 209, 210, 211])]), IA,
    "block 2 is not full at num_tokens 9")
row("Step", "commit-token-id-negative", commit_step([commit(1, [204, -1, 206, 207])]), IA,
    "token id -1 is outside 0..2147483647")
row("Step", "commit-token-id-2**31", commit_step([commit(1, [204, 2**31, 206, 207])]), IA,
    "token id 2147483648 is outside")
row("Step", "commit-without-num-tokens", commit_step([commit(1, GOOD_BLOCK)], num_tokens=-1), IA,
    "commits need num_tokens")
row("Step", "parent-hash-wrong-length", commit_step([commit(1, GOOD_BLOCK)], parent=b"\x01" * 5), IA,
    "parent_hash must be 16 bytes")
row("Step", "parent-hash-empty", commit_step([commit(1, GOOD_BLOCK)], parent=b""), IA,
    "parent_hash must be 16 bytes")
row("Step", "parent-hash-mismatch", commit_step([commit(1, GOOD_BLOCK)], parent=b"\x00" * 16), IA,
    "parent_hash does not match its last committed block")
row("Step", "commit-ok-but-grow-below", commit_step([commit(1, GOOD_BLOCK)], grow_to=4), IA,
    "grow_to 4 is below num_tokens 9")
row("Step", "commit-ok-but-foreign-sequence-too", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, num_tokens=9, parent_hash=b.priv_hash, commits=[commit(1, GOOD_BLOCK)]),
    upd(b.other, grow_to=12)]), NF, "sequence {b.other} not found")
row("Step", "good-creates-then-bad-update", lambda b: pb.StepRequest(
    lease_id=b.A, creates=[pb.CreateOp(token_ids=list(range(10)), pool_id="p0")],
    updates=[upd(b.priv, grow_to=5)]), IA, "grow_to 5 is below num_tokens 9")
row("Step", "good-pool-then-stale-pool", lambda b: pb.StepRequest(lease_id=b.A, updates=[
    upd(b.priv, grow_to=12), upd(b.stale, grow_to=12)]), FP, "sequence {b.stale} belongs to epoch 1")

# -- ForkSequence: the parent's length.
row("ForkSequence", "num-tokens-negative", lambda b: pb.ForkSequenceRequest(
    lease_id=b.A, sequence_id=b.priv, num_tokens=-5), IA, "num_tokens -5 is out of range")
row("ForkSequence", "num-tokens-2**31", lambda b: pb.ForkSequenceRequest(
    lease_id=b.A, sequence_id=b.priv, num_tokens=2**31), IA, "num_tokens 2147483648 is out of range")
row("ForkSequence", "num-tokens-below-allocator", lambda b: pb.ForkSequenceRequest(
    lease_id=b.A, sequence_id=b.priv, num_tokens=5), IA, "num_tokens 5 is below the allocator's 9")
row("ForkSequence", "num-tokens-beyond-block-table", lambda b: pb.ForkSequenceRequest(
    lease_id=b.A, sequence_id=b.priv, num_tokens=13), IA, "num_tokens 13 exceeds its block table")
row("ForkSequence", "appended-into-shared-block", lambda b: pb.ForkSequenceRequest(
    lease_id=b.A, sequence_id=b.main, num_tokens=11), FP, "appended into its shared last block without a step")

# -- FreeSequences: the list.
row("FreeSequences", "no-sequence-ids", lambda b: pb.FreeSequencesRequest(lease_id=b.A), IA,
    "at least one sequence_id")
row("FreeSequences", "too-many-sequence-ids", lambda b: pb.FreeSequencesRequest(
    lease_id=b.A, sequence_ids=[f"p0/1/{n}" for n in range(S.max_items_per_call + 1)]), IA,
    f"too many items: {S.max_items_per_call + 1} in one call, at most {S.max_items_per_call}")
row("FreeSequences", "duplicate-sequence", lambda b: pb.FreeSequencesRequest(
    lease_id=b.A, sequence_ids=[b.hit, b.priv, b.hit]), IA, "sequence {b.hit} appears twice in one step")


# ------------------------------------------------------------------ checks


def dump(r) -> dict[str, Any]:
    """Every key and value in a Redis (client ``r``), counters (the pools' stats hashes) aside:
    two pipelined round trips (each key's type, then its value) per node."""
    keys = [k for k in all_keys(r) if not k.endswith(b":stats")]
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.type(key)
    kinds = [kind.decode() for kind in pipe.execute()]
    read = {"string": lambda p, k: p.get(k), "hash": lambda p, k: p.hgetall(k),
            "list": lambda p, k: p.lrange(k, 0, -1), "set": lambda p, k: p.smembers(k),
            "zset": lambda p, k: p.zrange(k, 0, -1, withscores=True)}
    pipe = r.pipeline(transaction=False)
    read_keys = [(key, kind) for key, kind in zip(keys, kinds) if kind in read]
    for key, kind in read_keys:
        read[kind](pipe, key)
    out: dict[str, Any] = {key.decode(): kind for key, kind in zip(keys, kinds) if kind not in read}
    out.update({key.decode(): value for (key, _), value in zip(read_keys, pipe.execute())})
    return out


def check_exhausted_details(err: grpc.RpcError, row_: Row, available: int) -> None:
    status = rpc_status.from_call(err)
    assert status is not None, "RESOURCE_EXHAUSTED without google.rpc.Status details"
    assert status.code == RE.value[0] and status.message == err.details()
    infos, quotas = [], []
    for d in status.details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            infos.append(error_details_pb2.ErrorInfo())
            d.Unpack(infos[-1])
        elif d.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
            quotas.append(error_details_pb2.QuotaFailure())
            d.Unpack(quotas[-1])
    assert len(infos) == 1 and len(quotas) == 1, status
    info = infos[0]
    assert info.reason == "BLOCKS_EXHAUSTED" and info.domain == "kvservice"
    assert dict(info.metadata) == {"pool_id": "p0", "needed": str(row_.needed), "available": str(available)}
    assert [v.subject for v in quotas[0].violations] == ["pool/p0"]
    assert f"needed {row_.needed} blocks, {available} available" in quotas[0].violations[0].description


def test_the_table_covers_every_rpc():
    covered = {r.rpc for r in ROWS}
    assert covered | {"ListPools"} == set(RPCS), set(RPCS) - covered
    ids = [f"{r.rpc}-{r.name}" for r in ROWS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("row_", ROWS, ids=[f"{r.rpc}-{r.name}" for r in ROWS])
def test_bad_request_is_refused_and_changes_nothing(base: Base, row_: Row):
    request = row_.build(base)
    before = dump(base.redis)
    available = None
    if row_.code == RE:
        s = base.reader.stats("p0")
        available = s["num_free_blocks"] + s["num_evictable_blocks"]
    try:
        reply = getattr(base.stub, row_.rpc)(request, timeout=30)
        err = None
    except grpc.RpcError as exc:
        err = exc
    # The state is checked first, so that a wrong answer that also changed it says so.
    after = dump(base.redis)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"{row_.rpc} changed {changed} (answer: {err.code().name if err else reply})"
    assert base.reader.audit() == []
    assert err is not None, f"{row_.rpc} succeeded: {reply}"
    wanted = [m.format(b=base) for m in ((row_.message,) if isinstance(row_.message, str) else row_.message)]
    details = err.details() or ""
    assert (err.code(), all(m in details for m in wanted)) == (row_.code, True), \
        f"{row_.rpc}: got {err.code().name} {details!r}; want {row_.code.name} with {wanted!r}"
    if row_.code == RE:
        check_exhausted_details(err, row_, available)


# ------------------------------------------------------------------ not over the wire


def test_sdk_rejects_non_integer_token_ids_before_any_rpc(client, server):
    """"Non-integer counts" cannot travel: every count and token id is a protobuf int64
    (a float, str or bool there is refused by protobuf itself). The SDK checks the token
    ids it takes as Python values (appends, fork tokens, prompts) with TypeError before
    it sends anything."""
    client.register_pool("p0", num_blocks=NUM_BLOCKS, block_size=BS)
    seq = client.create(list(range(6)), pool="p0")
    before = snapshot(server.redis_url, "p0")
    calls = client.rpc_count
    state = (seq.num_tokens, seq.block_table)
    for bad in (1.5, "3", True, None, 2.0):
        with pytest.raises(TypeError):
            client.step({seq: [7, bad]})
        with pytest.raises(TypeError):
            seq.append([bad])
        with pytest.raises(TypeError):
            seq.append([1, 2, 3, bad])       # would cross a block boundary: an RPC otherwise
        with pytest.raises(TypeError):
            client.step(forks={seq: [[bad]]})
        with pytest.raises(TypeError):
            seq.fork([1, bad])
        with pytest.raises(TypeError):
            client.create([1, bad], pool="p0")
        with pytest.raises(TypeError):
            client.step(creates=[[bad]])
    assert client.rpc_count == calls
    assert (seq.num_tokens, seq.block_table) == state
    assert snapshot(server.redis_url, "p0") == before
    # The sequence is intact: a good append still works.
    seq.append([1, 2, 3])
    assert client.get(seq.id).num_tokens == 9
    assert audit(server.redis_url) == []


# ------------------------------------------------------------------ Redis down


def _every_rpc_request(pool: str, lease: str, sid: str) -> dict[str, Any]:
    return {
        "RegisterPool": pb.RegisterPoolRequest(pool_id=pool, geometry=geometry()),
        "ListPools": pb.ListPoolsRequest(),
        "DescribePool": pb.DescribePoolRequest(pool_id=pool),
        "GetPoolStats": pb.GetPoolStatsRequest(pool_id=pool),
        "Heartbeat": pb.HeartbeatRequest(pool_id=pool, epoch=1),
        "GrantLease": pb.GrantLeaseRequest(tenant="t1", ttl_seconds=30),
        "KeepAlive": pb.KeepAliveRequest(lease_id=lease),
        "RevokeLease": pb.RevokeLeaseRequest(lease_id=lease),
        "CreateSequence": pb.CreateSequenceRequest(lease_id=lease, token_ids=[1, 2, 3], pool_id=pool),
        "Step": pb.StepRequest(lease_id=lease, updates=[upd(sid, grow_to=12)],
                               creates=[pb.CreateOp(token_ids=[4, 5], pool_id=pool)]),
        "ForkSequence": pb.ForkSequenceRequest(lease_id=lease, sequence_id=sid),
        "FreeSequences": pb.FreeSequencesRequest(lease_id=lease, sequence_ids=[sid]),
        "GetSequence": pb.GetSequenceRequest(sequence_id=sid),
        "Audit": pb.AuditRequest(),
        "SettleTiers": pb.SettleTiersRequest(pool_id=pool, epoch=1, settled=[pb.TierSettlement(
            order=tier_order(pool), ok=True)]),
        "Sync": pb.SyncRequest(lease_id=lease, pools=[pb.PoolSync(pool_id=pool, epoch=1, want_blocks=4)]),
        "MigrateSequence": pb.MigrateSequenceRequest(lease_id=lease, sequence_id=sid, pool_id=pool),
        "DrainPool": pb.DrainPoolRequest(pool_id=pool),
        "UnregisterPool": pb.UnregisterPoolRequest(pool_id=pool, force=True),
    }


@pytest.mark.parametrize("flavor", FLAVORS)
def test_every_rpc_answers_unavailable_when_redis_is_unreachable(flavor):
    r = EmbeddedRedis(flavor).start()
    try:
        with ServerThread(r.url, Settings(reap_interval=0.05), reap=False) as server:
            stub = pb_grpc.AllocatorStub(server.channel())
            stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p0", geometry=geometry()))
            lease = stub.GrantLease(pb.GrantLeaseRequest(tenant="t1", ttl_seconds=30)).lease_id
            sid = stub.CreateSequence(pb.CreateSequenceRequest(lease_id=lease, token_ids=[1, 2, 3],
                                                               pool_id="p0")).sequence_id
            r.stop()
            requests = _every_rpc_request("p0", lease, sid)
            assert set(requests) == set(RPCS)
            for rpc, request in requests.items():
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as info:
                    getattr(stub, rpc)(request, timeout=30)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (rpc, info.value.details())
                assert "the allocator's Redis is unreachable" in info.value.details(), rpc
                assert time.monotonic() - t0 < 10, f"{rpc} took {time.monotonic() - t0:.1f}s to fail"
    finally:
        r.stop()
