"""The journal of local changes (DESIGN §5), applied by Sync: numbered entries per (lease,
pool), in order, each once; against a real server and both Redis flavours."""

from __future__ import annotations

import grpc
import pytest

from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

from helpers import TEST_SETTINGS, ServerThread, audit, entry, journal_entries, snapshot, stats
from kvservice.journal import COMMIT, COPY, FORK, FREE, GROW

BS = 4


@pytest.fixture
def served(any_redis_url):
    settings = TEST_SETTINGS.replace(reserve_share=0.1, reserve_min_blocks=2)
    with ServerThread(any_redis_url, settings) as server, server.channel() as channel:
        stub = pb_grpc.AllocatorStub(channel)
        stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p0", geometry=pb.PoolGeometry(
            num_blocks=100, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")))
        yield server, stub


class Lease:
    """A lease, its reserve and granted sequence numbers, and its journal's numbering."""

    def __init__(self, stub, tenant: str = "t1") -> None:
        self.stub = stub
        self.id = stub.GrantLease(pb.GrantLeaseRequest(tenant=tenant, ttl_seconds=60)).lease_id
        self.next_entry = 1
        grant = self.sync(want=10, numbers=4)
        self.reserve = list(grant.granted_blocks)
        self.numbers = list(range(grant.first_sequence_number, grant.first_sequence_number + 4))

    def sync(self, entries=(), *, first: int | None = None, want: int = 0, numbers: int = 0) -> pb.PoolReserve:
        first = self.next_entry if first is None else first
        reply = self.stub.Sync(pb.SyncRequest(lease_id=self.id, pools=[pb.PoolSync(
            pool_id="p0", epoch=1, want_blocks=want, first_entry=first, journal=journal_entries(entries),
            want_sequence_numbers=numbers)])).pools[0]
        self.next_entry = max(self.next_entry, reply.applied_entries + 1)
        return reply

    def create(self, tokens: list[int]) -> pb.Sequence:
        return self.stub.CreateSequence(pb.CreateSequenceRequest(lease_id=self.id, pool_id="p0", token_ids=tokens))


def _n(seq: pb.Sequence) -> int:
    return int(seq.sequence_id.rsplit("/", 1)[1].partition("-")[0])


def _get(stub, n: int) -> pb.Sequence:
    return stub.GetSequence(pb.GetSequenceRequest(sequence_id=f"p0/1/{n}"))


def test_growth_and_commits_from_the_journal_are_applied_and_feed_the_prefix_cache(served):
    server, stub = served
    lease = Lease(stub)
    tokens = [10, 11, 12, 13, 14, 15]
    seq = lease.create(tokens)                       # blocks: [full 10-13, partial 14-15]
    tokens += [16, 17, 18]                            # locally: block 1 fills, block 2 starts
    r0 = lease.reserve[0]
    ack = lease.sync([
        entry(COMMIT, _n(seq), 8, parent_hash=seq.last_hash, commits=[tokens[4:8]]),
        entry(GROW, _n(seq), 9, blocks=[r0]),
    ])
    assert ack.applied_entries == 2 and ack.num_reserved_blocks == 9
    now = _get(stub, _n(seq))
    assert list(now.block_table) == [*seq.block_table, r0]
    assert (now.num_tokens, now.num_committed_blocks) == (9, 2)
    hit = lease.create(tokens[:8] + [99])
    assert hit.num_cached_tokens == 8 and list(hit.block_table[:2]) == list(seq.block_table)
    assert stats(server.redis_url, "p0")["num_reserved_blocks"] == 9
    assert audit(server.redis_url) == []


def test_a_resent_batch_is_applied_once_and_a_batch_after_a_gap_not_at_all(served):
    server, stub = served
    lease = Lease(stub)
    seq = lease.create([1, 2, 3, 4, 5])
    batch = [entry(GROW, _n(seq), 9, blocks=[lease.reserve[0]])]
    assert lease.sync(batch, first=1).applied_entries == 1
    before = snapshot(server.redis_url, "p0")
    assert lease.sync(batch, first=1).applied_entries == 1          # the resend: a no-op
    later = [entry(GROW, _n(seq), 13, blocks=[lease.reserve[1]])]
    assert lease.sync(later, first=3).applied_entries == 1          # entry 2 is missing: nothing applied
    after = snapshot(server.redis_url, "p0")
    after.pop("leases"), before.pop("leases")
    assert after == before
    assert lease.sync(batch + later, first=1).applied_entries == 2  # 1 skipped, 2 applied
    assert len(_get(stub, _n(seq)).block_table) == 4
    st = stats(server.redis_url, "p0")
    assert (st["journal_entries"], st["journal_batches"], st["journal_resent_entries"], st["journal_gaps"]) == \
        (2, 4, 2, 1)
    assert audit(server.redis_url) == []


def test_fork_copy_on_write_and_free_locally_journaled(served):
    server, stub = served
    lease = Lease(stub)
    seq = lease.create([1, 2, 3, 4, 5, 6])            # [full, partial (5, 6)]
    child = lease.numbers[0]
    r0 = lease.reserve[0]
    ack = lease.sync([
        entry(FORK, _n(seq), 6, child=child),
        entry(COPY, child, 7, blocks=[r0]),   # the child writes first
        entry(GROW, _n(seq), 7, blocks=[]),   # the parent's block is its own now
        entry(FREE, child, 7),
    ])
    assert ack.applied_entries == 4
    assert ack.num_reserved_blocks == 10                # r0 (partial, freed) went back to the reserve
    assert _get(stub, _n(seq)).num_tokens == 7
    with pytest.raises(grpc.RpcError) as info:
        _get(stub, child)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    st = stats(server.redis_url, "p0")
    assert (st["cow_copies"], st["num_sequences"], st["num_used_blocks"], st["num_reserved_blocks"]) == (1, 1, 2, 10)
    assert audit(server.redis_url) == []


@pytest.mark.parametrize("case", ["block-not-reserved", "shared-block-without-copy", "child-not-granted",
                                  "other-lease", "below-recorded-length", "commit-not-full"])
def test_an_entry_that_does_not_fit_is_refused_and_nothing_of_the_batch_is_applied(served, case):
    server, stub = served
    lease, other = Lease(stub), Lease(stub, tenant="t2")
    seq = lease.create([1, 2, 3, 4, 5, 6])
    n = _n(seq)
    ok = entry(GROW, n, 9, blocks=[lease.reserve[0]])
    bad = {
        "block-not-reserved": entry(GROW, n, 13, blocks=[other.reserve[0]]),
        "shared-block-without-copy": None,
        "child-not-granted": entry(FORK, n, 9, child=10**6),
        "other-lease": entry(FREE, _n(other.create([7, 8])), 2),
        "below-recorded-length": entry(FREE, n, 5),
        "commit-not-full": entry(COMMIT, n, 9, parent_hash=seq.last_hash, commits=[[5, 6, 7, 8], [9, 9, 9, 9]]),
    }[case]
    entries = [ok, bad]
    if case == "shared-block-without-copy":
        entries = [entry(FORK, n, 6, child=lease.numbers[0]),
                   entry(GROW, n, 7, blocks=[])]
    before = snapshot(server.redis_url, "p0")
    with pytest.raises(grpc.RpcError) as info:
        lease.sync(entries)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "journal entry 2" in info.value.details(), info.value.details()
    after = snapshot(server.redis_url, "p0")
    after.pop("leases"), before.pop("leases")
    assert after == before
    assert audit(server.redis_url) == []
