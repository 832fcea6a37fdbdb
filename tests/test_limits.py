"""``kvservice limits``: the worst allowed call of each script, timed by Redis itself."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from kvservice.allocator.config import Settings
from kvservice.tools.limits import TARGET_MS, measure, table

pytestmark = pytest.mark.e2e


def test_every_script_s_worst_call_is_timed_and_grows_with_its_limit():
    small = Settings(max_blocks_per_call=64, max_items_per_call=16, max_forks_per_sequence=4,
                     max_forks_per_call=16, max_fork_refs_per_call=64, max_release_per_call=64,
                     max_journal_entries=64)
    large = small.replace(max_blocks_per_call=2048, max_items_per_call=256,
                          max_forks_per_sequence=64, max_forks_per_call=512, max_fork_refs_per_call=16384,
                          max_release_per_call=4096, max_journal_entries=512)
    few, many = (asyncio.run(measure(s, progress=lambda m: None, long_tokens=4096 * 16)) for s in (small, large))
    long = [r for r in few if r.call.startswith(("remote:", "local:"))]
    assert [r.script for r in few if r not in long] == ["step"] * 5 + ["sync"] * 4 + [
        "resync", "probe", "reap", "audit", "audit"]
    # The long prompt (4,096 blocks): created, created again, forked, appended, freed in both
    # modes, in parts of max_blocks_per_call (64) blocks: a create's are 4,096 / 64 parts of
    # blocks and as many of hashes.
    assert len(long) == 10 and all(r.ms > 0 for r in long)
    assert "stage" in long[0].script and int(long[0].call.split("(")[-1].split()[0]) >= 2 * 4096 // 64
    for r in few + many:
        assert r.ms > 0, f"{r.script}: {r.call} was not seen in the SLOWLOG"
    # A larger limit allows a longer call: the fork row (16 children x 4 blocks vs 512 x 32) most of all.
    assert many[3].ms > 10 * few[3].ms
    text = table(many)
    assert "worst allowed call" in text and f"OVER {TARGET_MS}" in text


def test_limits_takes_the_allocator_s_flags():
    out = subprocess.run([sys.executable, "-m", "kvservice", "limits", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--max-blocks-per-call" in out.stdout


def test_a_resync_larger_than_the_journal_limits_is_refused_and_changes_nothing(redis_url):
    """A resync's claims are bounded like a journal (max_journal_entries sequences,
    max_journal_blocks blocks): past them, INVALID_ARGUMENT before any script runs."""
    from helpers import ServerThread, keyspace
    import grpc
    from kvservice.v1 import allocator_pb2 as pb
    from kvservice.v1 import allocator_pb2_grpc as pb_grpc

    s = Settings(reap_interval=0.05, max_journal_entries=4, max_journal_blocks=8)
    with ServerThread(redis_url, s) as server, server.channel() as ch:
        stub = pb_grpc.AllocatorStub(ch)
        stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p0", geometry=pb.PoolGeometry(
            num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")), timeout=10)
        lease = stub.GrantLease(pb.GrantLeaseRequest(ttl_seconds=30), timeout=10).lease_id
        claim = lambda n, blocks: pb.SequenceClaim(sequence=n, num_tokens=4 * len(blocks), block_table=blocks,
                                                   last_hash=b"\0" * 16)
        before = keyspace(redis_url)
        for claims, what in (([claim(n, [n]) for n in range(1, 6)], "5 sequences"),
                             ([claim(1, list(range(9)))], "9 blocks")):
            with pytest.raises(grpc.RpcError) as info:
                stub.Sync(pb.SyncRequest(lease_id=lease, pools=[pb.PoolSync(
                    pool_id="p0", epoch=1, first_entry=1, resync=pb.PoolResync(sequences=claims))]), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert "a resync of" in info.value.details() and "at most 4 and 8" in info.value.details()
        assert keyspace(redis_url) == before
