"""Grants (``kvservice/common/grants.py``) and the worker's table of them
(``worker/rights.py``): what a lease may write and read, as an attacker sees it — a forged
or altered grant, another pool's, epoch's, generation's or tenant's, a made-up lease, a
block that changed hands, a dead lease."""

from __future__ import annotations

import dataclasses

import pytest

from kvservice import errors
from kvservice.common.grants import (MAC_BYTES, Grant, move_fields, new_key, order_mac, order_valid, pack_blocks,
                                     unpack_blocks)
from kvservice.v1 import allocator_pb2 as apb
from worker.rights import BlockRights

KEY = new_key()
POOL, EPOCH, GEN = "worker-0", 3, 7


def grant(lease: str, tenant: str, serial: int, write=(), read=(), key: bytes = KEY, **kw) -> Grant:
    fields = dict(pool_id=POOL, epoch=EPOCH, generation=GEN, lease_id=lease, tenant=tenant, serial=serial,
                  write=pack_blocks(write), read=pack_blocks(read))
    fields.update(kw)
    return Grant(**fields).signed(key)


def table() -> BlockRights:
    rights = BlockRights(64, POOL)
    rights.reset(EPOCH, KEY)
    return rights


def admit(rights: BlockRights, *grants, tenant: str | None = "a", generation: int | None = GEN) -> list[int]:
    return rights.admit(grants, tenant, generation, "WriteKV")


def test_blocks_pack_to_uint32_and_back_and_a_mac_sees_every_field_boundary():
    assert unpack_blocks(pack_blocks([0, 5, 2**32 - 1])).tolist() == [0, 5, 2**32 - 1]
    for bad in ([-1], [2**32]):
        with pytest.raises(ValueError):
            pack_blocks(bad)
    with pytest.raises(ValueError, match="4-byte"):
        unpack_blocks(b"abc")
    a, b = grant("ab", "c", 1), grant("a", "bc", 1)
    assert len(a.mac) == MAC_BYTES and a.mac != b.mac
    assert a.valid(KEY) and not a.valid(new_key())
    assert order_valid(KEY, "move", [1, "x", b"y"], order_mac(KEY, "move", [1, "x", b"y"]))
    assert not order_valid(KEY, "pull", [1, "x", b"y"], order_mac(KEY, "move", [1, "x", b"y"]))
    assert not order_valid(KEY, "move", [1, "x", b"y"], b"")
    # (the proto form carries every field)
    assert Grant.from_pb(a.to_pb(apb)) == a


def test_a_lease_writes_and_reads_what_it_was_granted_and_nothing_else():
    rights = table()
    assert admit(rights, grant("A", "a", 1, write=[1, 2, 3], read=[9])) == []
    rights.check("A", write=[1, 2, 3], read=[1, 9], what="Forward")
    for lease, write, read in (("A", [4], []), ("A", [9], []), ("A", [], [10]), ("x", [1], []), ("x", [], [1]),
                               ("", [1], [])):
        with pytest.raises(errors.PermissionDenied) as info:
            rights.check(lease, write=write, read=read, what="Forward")
        assert "Forward:" in str(info.value) and f"pool {POOL}" in str(info.value)


def test_forged_altered_and_foreign_grants_are_refused_and_change_nothing():
    rights = table()
    admit(rights, grant("A", "a", 1, write=[1]))
    cases = [
        (grant("B", "b", 2, write=[1], key=new_key()), "b", errors.PermissionDenied, "not signed"),    # forged
        (dataclasses.replace(grant("B", "b", 2, write=[2]), write=pack_blocks([1])),               # altered
         "b", errors.PermissionDenied, "not signed"),
        (grant("B", "b", 2, write=[1], pool_id="worker-1"), "b", errors.PermissionDenied, "for pool"),
        (grant("B", "b", 2, write=[1], epoch=EPOCH - 1), "b", errors.FailedPrecondition, "epoch"),
        (grant("B", "b", 2, write=[1], generation=GEN - 1), "b", errors.RolledBack, "generation"),
        (grant("A", "a", 2, write=[1, 2]), "b", errors.PermissionDenied, "only by the tenant"),  # (A's, used by b)
    ]
    for g, caller, exc, words in cases:
        with pytest.raises(exc, match=words):
            admit(rights, g, tenant=caller)
    rights.check("A", write=[1])
    for lease in ("A", "B"):
        with pytest.raises(errors.PermissionDenied):
            rights.check(lease, write=[2])
    with pytest.raises(errors.PermissionDenied):
        rights.check("B", read=[1])
    assert rights.refused == len(cases)


def test_a_block_that_changed_hands_is_refused_to_its_old_holder_even_on_a_replayed_grant():
    rights = table()
    old = grant("A", "a", 1, write=[5, 6])
    admit(rights, old)
    # Block 5 freed by A, then allocated to B (tenant b): B's grant is newer, the block is
    # zeroed before B's call (it held tenant a's K/V).
    assert admit(rights, grant("B", "b", 4, write=[5]), tenant="b") == [5]
    rights.check("B", write=[5], read=[5])
    for write, read in (([5], []), ([], [5])):
        with pytest.raises(errors.PermissionDenied) as info:
            rights.check("A", write=write, read=read)
        assert "B" not in str(info.value) and "tenant" not in str(info.value).replace("another", "")
    admit(rights, old)                               # (A sends its old grant again: nothing changes)
    with pytest.raises(errors.PermissionDenied):
        rights.check("A", read=[5])
    rights.check("A", write=[6])
    rights.check("B", write=[5])
    # Within a tenant, no zeroing: the block holds the tenant's own K/V.
    assert admit(rights, grant("A2", "a", 5, write=[6])) == []


def test_a_shared_block_is_read_by_its_readers_and_written_only_by_its_writer():
    rights = table()
    admit(rights, grant("A", "a", 2, write=[7]))
    admit(rights, grant("C", "a", 3, read=[7]))      # (a prefix-cache hit of the same tenant)
    rights.check("C", read=[7])
    with pytest.raises(errors.PermissionDenied, match="may not write block 7"):
        rights.check("C", write=[7])
    admit(rights, grant("D", "a", 1, read=[7]))      # (a read grant older than the writer's: void)
    with pytest.raises(errors.PermissionDenied):
        rights.check("D", read=[7])
    # The block reallocated: its readers under older grants lose it, newer ones keep it.
    admit(rights, grant("E", "a", 5, read=[7]))
    admit(rights, grant("F", "a", 4, write=[7]))
    rights.check("E", read=[7])
    with pytest.raises(errors.PermissionDenied):
        rights.check("C", read=[7])


def move(src_tier: int, src: int, dst_tier: int, dst: int, serial: int, block_hash: bytes = b"h" * 16,
         key: bytes = KEY, over: dict | None = None) -> apb.TierOrder:
    """A tier order as the allocator signs it (``over``: fields changed after signing)."""
    o = apb.TierOrder(pool_id=POOL, epoch=EPOCH, src_tier=src_tier, src=src, dst_tier=dst_tier, dst=dst,
                      block_hash=block_hash, serial=serial)
    o.order_mac = order_mac(key, "move", move_fields(POOL, EPOCH, serial, src_tier, src, dst_tier, dst, block_hash))
    for name, value in (over or {}).items():
        setattr(o, name, value)
    return o


def test_a_move_runs_only_on_the_allocator_s_order_and_copies_no_block_written_since():
    rights = table()
    admit(rights, grant("A", "a", 4, write=[1, 2]))
    rights.check("A", write=[1, 2], what="Forward")                 # (written under serial 4)
    good = [move(0, 1, 1, 0, serial=5), move(1, 3, 0, 2, serial=5), move(1, 3, 2, 7, serial=5)]
    assert rights.move_refusal(good) == "" and rights.stale_copies(good) == {}
    for forged in (move(0, 1, 1, 0, 5, over={"dst": 1}), move(0, 1, 1, 0, 5, over={"block_hash": b"x" * 16}),
                   move(0, 1, 1, 0, 5, key=new_key()), move(0, 1, 1, 0, 5, over={"order_mac": b""}),
                   move(0, 1, 1, 0, 5, over={"src_tier": 2}), move(0, 1, 1, 0, 5, over={"serial": 9})):
        assert "is not an order of the allocator" in rights.move_refusal([good[0], forged])
    # Block 1 evicted and granted to B at serial 6 with the copy down ordered as of 6: the copy
    # runs until B writes the block (or it is zeroed for B's tenant); then the order is stale.
    order = move(0, 1, 1, 0, serial=6)
    assert admit(rights, grant("B", "b", 6, write=[1]), tenant="b") == [1]      # (zeroed: another tenant)
    assert "written after this copy was ordered" in rights.stale_copies([order])[0]
    rights = table()
    admit(rights, grant("A", "a", 4, write=[1]))
    rights.check("A", write=[1], what="Forward")
    admit(rights, grant("A", "a", 6, write=[1]))                 # (the same tenant: nothing zeroed)
    assert rights.stale_copies([order]) == {}
    rights.check("A", write=[1], what="Forward")                 # (the new writer writes it: stale)
    assert list(rights.stale_copies([order])) == [0]
    # (a worker with no grant key checks nothing)
    assert BlockRights(8, POOL).move_refusal([move(0, 1, 1, 0, 1, over={"order_mac": b""})]) == ""


def test_dead_leases_a_new_epoch_and_an_unregistered_pool():
    rights = table()
    admit(rights, grant("A", "a", 1, write=[1], read=[2]), grant("B", "a", 2, write=[2]))
    rights.forget(["A", "nobody"])
    for write, read in (([1], []), ([], [2])):
        with pytest.raises(errors.PermissionDenied):
            rights.check("A", write=write, read=read)
    rights.check("B", write=[2])
    # A tenant b gets block 1 after A died: it is zeroed (it held tenant a's K/V).
    assert admit(rights, grant("G", "b", 3, write=[1]), tenant="b") == [1]
    rights.clear()                                   # (a new generation: every holder is granted again)
    with pytest.raises(errors.PermissionDenied):
        rights.check("B", write=[2])
    admit(rights, grant("B", "a", 4, write=[2]))
    rights.check("B", write=[2])
    rights.reset(EPOCH + 1, new_key())
    with pytest.raises(errors.PermissionDenied):
        rights.check("B", write=[2])
    with pytest.raises(errors.FailedPrecondition, match="epoch"):
        admit(rights, grant("B", "a", 9, write=[2]))
    unregistered = BlockRights(8, POOL)
    assert not unregistered.enforced
    unregistered.check("anyone", write=[1], read=[2])     # (no key yet: nothing to check against)
    with pytest.raises(errors.InvalidArgument, match="out of range"):
        admit(table(), grant("A", "a", 1, write=[64]))
    malformed = dataclasses.replace(grant("A", "a", 1), write=b"\x01\x02\x03").signed(KEY)   # (signed, but 3 bytes)
    with pytest.raises(errors.InvalidArgument, match="4-byte"):
        admit(table(), malformed)


def test_a_registration_hands_its_epoch_s_grant_key_to_the_pool_s_worker_only(redis_url):
    from helpers import ServerThread

    from kvservice.v1 import allocator_pb2_grpc as apb_grpc

    geometry = apb.PoolGeometry(num_blocks=16, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                                dtype="float16")
    with ServerThread(redis_url) as server:
        channel = server.channel()
        stub = apb_grpc.AllocatorStub(channel)
        request = apb.RegisterPoolRequest(pool_id="granted", geometry=geometry, request_id="first")
        first = stub.RegisterPool(request, timeout=10)
        retry = stub.RegisterPool(request, timeout=10)           # (the same registration: the same key)
        assert len(first.grant_key) == 32 and (retry.epoch, retry.grant_key) == (first.epoch, first.grant_key)
        again = stub.RegisterPool(apb.RegisterPoolRequest(pool_id="granted", geometry=geometry), timeout=10)
        assert again.epoch == first.epoch + 1 and len(again.grant_key) == 32 and again.grant_key != first.grant_key
        # Nobody else reads it: the registry's readers see no key.
        assert stub.DescribePool(apb.DescribePoolRequest(pool_id="granted"), timeout=10).grant_key == b""
        assert all(p.grant_key == b"" for p in stub.ListPools(apb.ListPoolsRequest(), timeout=10).pools)
        channel.close()


def test_a_step_s_grants_name_what_it_gave_the_lease_and_a_worker_s_table_follows_them(redis_url):
    """Through the allocator's gRPC API: creates, a cache hit by another lease of the
    tenant, growth and a fork each come back with the pool's signed grant of exactly the
    blocks the lease got (to write what it allocated, to read what it shares); a worker's
    table fed with them lets each lease write its own blocks and only read shared ones."""
    from helpers import ServerThread

    from kvservice.v1 import allocator_pb2_grpc as apb_grpc

    geometry = apb.PoolGeometry(num_blocks=64, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                                dtype="float16")
    with ServerThread(redis_url) as server:
        channel = server.channel()
        stub = apb_grpc.AllocatorStub(channel)
        pool = stub.RegisterPool(apb.RegisterPoolRequest(pool_id="stepped", geometry=geometry), timeout=10)
        key = pool.grant_key
        leases = [stub.GrantLease(apb.GrantLeaseRequest(tenant=t, ttl_seconds=60), timeout=10).lease_id
                  for t in ("team-a", "team-a", "team-b")]
        prompt = list(range(1, 15))               # (14 tokens: 3 full blocks and 2 tokens)

        def create(lease: str) -> tuple[apb.Sequence, Grant]:
            reply = stub.Step(apb.StepRequest(lease_id=lease, creates=[apb.CreateOp(token_ids=prompt,
                                                                                   pool_id="stepped")]), timeout=10)
            (g,) = reply.grants
            return reply.created[0], Grant.from_pb(g)

        first, g1 = create(leases[0])
        assert g1.valid(key) and (g1.pool_id, g1.epoch, g1.lease_id, g1.tenant) == ("stepped", pool.epoch, leases[0],
                                                                                      "team-a")
        assert g1.generation == pool.generation and g1.serial > 0
        assert unpack_blocks(g1.write).tolist() == list(first.block_table) and g1.read == b""
        second, g2 = create(leases[1])          # (a hit of the same tenant: 3 blocks shared)
        assert second.num_cached_tokens == 12 and g2.serial > g1.serial
        assert unpack_blocks(g2.read).tolist() == list(second.block_table[:3]) == list(first.block_table[:3])
        assert unpack_blocks(g2.write).tolist() == list(second.block_table[3:])
        third, g3 = create(leases[2])           # (another tenant: nothing shared)
        assert g3.read == b"" and not set(third.block_table) & set(first.block_table)
        grown = stub.Step(apb.StepRequest(lease_id=leases[0], updates=[apb.SeqUpdate(
            sequence_id=first.sequence_id, num_tokens=14, grow_to=30)]), timeout=10)
        (g4,) = [Grant.from_pb(g) for g in grown.grants]
        assert unpack_blocks(g4.write).tolist() == list(grown.updates[0].new_blocks) and len(grown.updates[0].new_blocks) == 4
        # A fork that shares nothing new gets no grant; one that grows into the shared partial
        # block gets its copy and its new block.
        assert not stub.ForkSequence(apb.ForkSequenceRequest(lease_id=leases[1], sequence_id=second.sequence_id),
                                     timeout=10).HasField("grant")
        step = stub.Step(apb.StepRequest(lease_id=leases[1], updates=[apb.SeqUpdate(
            sequence_id=second.sequence_id, num_tokens=14, fork_grow_to=[18])]), timeout=10)
        forked = step.updates[0].children[0]
        (g5,) = [Grant.from_pb(g) for g in step.grants]
        assert g5.valid(key) and forked.cow.dst and len(forked.block_table) == 5
        assert sorted(unpack_blocks(g5.write).tolist()) == sorted([forked.cow.dst, forked.block_table[4]])
        # A reserve (the local mode's blocks): granted to write with it.
        synced = stub.Sync(apb.SyncRequest(lease_id=leases[0], pools=[apb.PoolSync(
            pool_id="stepped", epoch=pool.epoch, want_blocks=3, generation=pool.generation)]), timeout=10)
        (reserve,) = synced.pools
        assert len(reserve.granted_blocks) == 3 and Grant.from_pb(reserve.grant).valid(key)
        assert unpack_blocks(reserve.grant.write_blocks).tolist() == list(reserve.granted_blocks)
        assert reserve.grant.serial > g5.serial and reserve.grant.lease_id == leases[0]
        nothing = stub.Sync(apb.SyncRequest(lease_id=leases[0], pools=[apb.PoolSync(
            pool_id="stepped", epoch=pool.epoch, want_blocks=3, generation=pool.generation)]), timeout=10)
        assert not nothing.pools[0].granted_blocks and not nothing.pools[0].HasField("grant")
        made = stub.CreateSequence(apb.CreateSequenceRequest(lease_id=leases[2], token_ids=[7] * 9,
                                                             pool_id="stepped"), timeout=10)
        assert Grant.from_pb(made.grant).valid(key) and unpack_blocks(made.grant.write_blocks).tolist() == \
            list(made.block_table)
        channel.close()

    rights = BlockRights(64, "stepped")
    rights.reset(pool.epoch, key)
    for g in (g1, g2, g3, g4, g5):
        rights.admit([g], g.tenant, pool.generation, "Forward")
    rights.check(leases[0], write=list(first.block_table) + list(grown.updates[0].new_blocks))
    rights.check(leases[1], write=list(second.block_table[3:]) + [forked.cow.dst], read=list(second.block_table))
    for lease, blocks in ((leases[1], first.block_table[:3]), (leases[2], first.block_table[:1]),
                          (leases[0], third.block_table[:1])):
        with pytest.raises(errors.PermissionDenied):
            rights.check(lease, write=list(blocks))
    with pytest.raises(errors.PermissionDenied):
        rights.check(leases[2], read=list(first.block_table[:1]))
