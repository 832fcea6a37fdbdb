"""Quotas per tenant (docs/security.md): blocks and sequences per pool, live leases. A call
past a quota answers RESOURCE_EXHAUSTED with a QuotaFailure and ErrorInfo QUOTA_EXCEEDED
(the quota and its limit), with nothing changed; the tenant's holdings are its own in
GetPoolStats, and the audit checks them against what its leases hold."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from helpers import TEST_SETTINGS, ServerThread, audit, keyspace
from kvservice import errors
from kvservice.allocator.config import Settings, tenant_quotas
from kvservice.client import Client
from kvservice.common.auth import TokenFile, add_token
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

BS = 4
QUOTAS = dataclasses.replace(TEST_SETTINGS, quota_blocks=12, quota_sequences=6, quota_leases=3,
                             quotas="globex=blocks:1000,leases:0")


@pytest.fixture
def quota_server(redis_url, tmp_path):
    path = str(tmp_path / "tokens")
    tokens = {name: add_token(path, name, role) for name, role in
              (("acme", "tenant"), ("globex", "tenant"), ("ops", "admin"))}
    with ServerThread(redis_url, QUOTAS, tokens=TokenFile(path)) as server:
        channel = grpc.insecure_channel(server.target)
        stub = pb_grpc.AllocatorStub(channel)
        q = type("Quotas", (), {})()
        q.server, q.tokens, q.redis_url = server, tokens, redis_url
        q.call = lambda method, request, who: getattr(stub, method)(
            request, timeout=10, metadata=(("authorization", f"Bearer {tokens[who]}"),))
        q.call("RegisterPool", pb.RegisterPoolRequest(pool_id="q0", geometry=pb.PoolGeometry(
            num_blocks=256, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")), "ops")
        q.client = lambda who, **kw: Client(server.target, token=tokens[who], **kw)
        yield q
        channel.close()
        assert audit(redis_url) == []


def _quota_failure(exc: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo, error_details_pb2.QuotaFailure]:
    status = rpc_status.from_call(exc)
    info, failure = error_details_pb2.ErrorInfo(), error_details_pb2.QuotaFailure()
    for d in status.details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            d.Unpack(info)
        elif d.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
            d.Unpack(failure)
    return info, failure


def _create(q, lease: str, n: int, who: str = "acme", first: int = 0) -> pb.Sequence:
    return q.call("CreateSequence", pb.CreateSequenceRequest(lease_id=lease, token_ids=list(range(first, first + n)),
                                                             pool_id="q0"), who)


def test_the_quotas_setting_parses_and_refuses_garbage():
    assert tenant_quotas("a=blocks:5,leases:2; b.c=sequences:0") == {"a": {"blocks": 5, "leases": 2},
                                                                    "b.c": {"sequences": 0}}
    for bad in ("a", "a=", "a=bytes:5", "a=blocks:-1", "a=blocks:x", "a=blocks:1;a=leases:2", "bad name=blocks:1",
                "a=blocks:99999999999"):
        with pytest.raises(ValueError, match="quotas"):
            Settings(quotas=bad)
    with pytest.raises(ValueError, match="quota_blocks"):
        Settings(quota_blocks=-1)


def test_blocks_quota_refuses_the_create_that_passes_it_and_changes_nothing(quota_server):
    q = quota_server
    lease = q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30), "acme").lease_id
    first = _create(q, lease, 8 * BS, first=100)       # 8 blocks of the 12
    before = keyspace(q.redis_url)
    with pytest.raises(grpc.RpcError) as info:
        _create(q, lease, 5 * BS, first=200)            # 8 + 5 > 12
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant acme holds 8 blocks in pool q0 and asks 5 more: its quota of blocks per pool is 12" \
        in info.value.details()
    detail, failure = _quota_failure(info.value)
    assert detail.reason == "QUOTA_EXCEEDED" and detail.metadata["quota"] == "blocks"
    assert detail.metadata["limit"] == "12"
    assert [v.subject for v in failure.violations] == ["quota/blocks"]
    assert keyspace(q.redis_url) == before
    # Within the quota it goes through; the other tenant has its own (1000 blocks).
    _create(q, lease, 4 * BS, first=300)
    other = q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30), "globex").lease_id
    _create(q, other, 40 * BS, who="globex", first=100)
    # Freed blocks leave the holdings: a create fits again.
    q.call("FreeSequences", pb.FreeSequencesRequest(lease_id=lease, sequence_ids=[first.sequence_id]), "acme")
    _create(q, lease, 8 * BS, first=400)


def test_shared_prefix_blocks_count_in_every_table_that_holds_them(quota_server):
    q = quota_server
    lease = q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30), "acme").lease_id
    _create(q, lease, 5 * BS + 1)                      # 6 blocks, 5 of them cached
    hit = _create(q, lease, 5 * BS + 1)                # 6 references, no new block: 12 in all
    assert hit.num_cached_tokens == 5 * BS
    with pytest.raises(grpc.RpcError) as info:
        _create(q, lease, 1)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_sequences_quota_refuses_the_seventh_sequence(quota_server):
    q = quota_server
    lease = q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30), "acme").lease_id
    seqs = [_create(q, lease, 1, first=10 * i) for i in range(6)]
    with pytest.raises(grpc.RpcError) as info:
        _create(q, lease, 1, first=99)
    detail, _ = _quota_failure(info.value)
    assert detail.metadata["quota"] == "sequences" and detail.metadata["limit"] == "6"
    with pytest.raises(grpc.RpcError) as info:
        q.call("ForkSequence", pb.ForkSequenceRequest(lease_id=lease, sequence_id=seqs[0].sequence_id), "acme")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    q.call("FreeSequences", pb.FreeSequencesRequest(lease_id=lease, sequence_ids=[seqs[0].sequence_id]), "acme")
    q.call("ForkSequence", pb.ForkSequenceRequest(lease_id=lease, sequence_id=seqs[1].sequence_id), "acme")


def test_the_sdk_local_path_stops_at_the_quota_with_its_name(quota_server):
    """The SDK's local path: the reserve it is granted stays within the tenant's quota,
    and a step that needs more raises ResourceExhausted naming the quota; local forks take
    sequence numbers, which the sequences quota bounds."""
    q = quota_server
    with q.client("acme", local=True) as c:
        s = c.create([1, 2, 3], pool="q0")
        with pytest.raises(errors.ResourceExhausted) as info:
            for i in range(20 * BS):
                s.append([1000 + i])
        assert info.value.quota == "blocks" and info.value.limit == 12
        assert info.value.reason == "QUOTA_EXCEEDED"
        assert len(s.block_table) <= 12
        kids = []
        with pytest.raises(errors.ResourceExhausted) as info:
            for _ in range(8):
                kids.append(s.fork())
        assert info.value.quota == "sequences" and info.value.limit == 6
        assert len(kids) <= 5
        c.flush()
        stats = q.call("GetPoolStats", pb.GetPoolStatsRequest(pool_id="q0"), "acme")
        assert stats.tenant == "acme" and stats.quota_blocks == 12 and stats.quota_sequences == 6
        assert stats.tenant_sequences <= 6 and stats.tenant_leases == 1
        # Each child holds its parent's blocks: the references count (the tenant is past
        # its blocks quota now), so a child that needs a block of its own gets none.
        assert stats.tenant_blocks >= 12 * (1 + len(kids))
        with pytest.raises(errors.ResourceExhausted) as info:
            for i in range(BS):
                kids[0].append([5000 + i])
        assert info.value.quota == "blocks"


def test_leases_quota_counts_live_leases_only(quota_server):
    q = quota_server
    leases = [q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30), "acme").lease_id for _ in range(2)]
    short = q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=0.3), "acme").lease_id
    with pytest.raises(grpc.RpcError) as info:
        q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30), "acme")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "its quota of leases is 3" in info.value.details()
    detail, failure = _quota_failure(info.value)
    assert detail.metadata["quota"] == "leases" and [v.subject for v in failure.violations] == ["quota/leases"]
    q.call("RevokeLease", pb.RevokeLeaseRequest(lease_id=leases[0]), "acme")
    fourth = q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30, request_id="x"), "acme").lease_id
    # (a retried grant of a lease it holds is no new lease)
    assert q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30, request_id="x"), "acme").lease_id == fourth
    # Kept alive, a lease stays counted past its first deadline; expired, it is not.
    deadline = time.monotonic() + 5
    while True:
        q.call("KeepAlive", pb.KeepAliveRequest(lease_id=leases[1]), "acme")
        try:
            q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30), "acme")
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "the expired lease still counts"
            time.sleep(0.05)
    with pytest.raises(grpc.RpcError):
        q.call("KeepAlive", pb.KeepAliveRequest(lease_id=short), "acme")
    # globex's lease quota is 0: none.
    for _ in range(5):
        q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30), "globex")


def test_a_tenants_pool_stats_show_its_own_holdings_not_the_others_activity(quota_server):
    q = quota_server
    acme = q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30), "acme").lease_id
    globex = q.call("GrantLease", pb.GrantLeaseRequest(ttl_seconds=30), "globex").lease_id
    _create(q, acme, 2 * BS + 1)
    for i in range(3):
        _create(q, globex, 4 * BS, who="globex", first=50 * i)
    mine = q.call("GetPoolStats", pb.GetPoolStatsRequest(pool_id="q0"), "acme")
    assert (mine.tenant, mine.tenant_blocks, mine.tenant_sequences, mine.tenant_leases) == ("acme", 3, 1, 1)
    assert mine.num_sequences == 0 and mine.sequences_created == 0 and mine.prefix_queried_tokens == 0
    assert mine.num_used_blocks == 15 and mine.num_blocks == 256
    theirs = q.call("GetPoolStats", pb.GetPoolStatsRequest(pool_id="q0"), "globex")
    assert (theirs.tenant_blocks, theirs.tenant_sequences, theirs.quota_blocks) == (12, 3, 1000)
    listed = q.call("ListPools", pb.ListPoolsRequest(), "acme").pools[0].stats
    assert listed.num_sequences == 0 and listed.num_free_blocks == 256 - 15
    admin = q.call("GetPoolStats", pb.GetPoolStatsRequest(pool_id="q0"), "ops")
    assert admin.num_sequences == 4 and admin.sequences_created == 4 and admin.tenant == ""
    # Reaped, a lease leaves its tenant's holdings.
    q.call("RevokeLease", pb.RevokeLeaseRequest(lease_id=acme), "acme")
    mine = q.call("GetPoolStats", pb.GetPoolStatsRequest(pool_id="q0"), "acme")
    assert (mine.tenant_blocks, mine.tenant_sequences, mine.tenant_leases) == (0, 0, 0)
