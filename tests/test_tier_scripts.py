"""The lower tiers in the allocator (DESIGN §12, scripts/lib/tiers.lua), through the
service: copies down on eviction, loads on a hit, settlement, re-registration, the audit.
Over one Redis and the local Redis Cluster."""

from __future__ import annotations

import pytest

from kvservice import errors
from kvservice.client import Client
from kvservice.v1 import allocator_pb2 as pb

from helpers import ServerThread, audit

BS = 4
PROMPT_A = list(range(1, 14))          # 13 tokens: 3 full blocks (hashed) and a partial one
PROMPT_B = list(range(100, 113))


def _settle(c: Client, orders, ok=True) -> int:
    by_pool: dict[tuple[str, int], list] = {}
    for o in orders:
        if o.dst_tier:
            by_pool.setdefault((o.pool_id, o.epoch), []).append(pb.TierSettlement(order=o, ok=ok))
    return sum(c.settle_tiers(p, e, s) for (p, e), s in by_pool.items())


def _tiers(c: Client, pool: str) -> dict[str, pb.TierStats]:
    return {t.tier: t for t in c.pool_stats(pool).tiers}


@pytest.fixture
def tiered(any_redis_url):
    with ServerThread(any_redis_url) as s, Client(s.target, tenant="t1", lease_ttl=30.0) as c:
        c.collect_tier_orders = True
        c.register_pool("p", num_blocks=4, block_size=BS, host_tier_blocks=8)
        yield s, c, any_redis_url


pytestmark = pytest.mark.cluster_too


def _evict_a(c: Client) -> list[pb.TierOrder]:
    """A's three full blocks cached, then evicted by B: their copies down."""
    a = c.create(PROMPT_A, pool="p")
    a.free()
    b = c.create(PROMPT_B, pool="p")
    orders = c.take_tier_orders()
    b.free()
    return orders


def test_an_evicted_hashed_block_is_copied_down_and_a_hit_in_the_host_tier_is_loaded(tiered):
    server, c, url = tiered
    orders = _evict_a(c)
    assert [(o.src_tier, o.dst_tier) for o in orders] == [(0, 1)] * 3
    assert len({o.dst for o in orders}) == 3 and len({o.block_hash for o in orders}) == 3
    host = _tiers(c, "p")["host"]
    assert (host.num_blocks, host.num_pending_blocks, host.num_used_blocks, host.blocks_in) == (8, 3, 0, 3)
    assert audit(url, "p") == []
    # Pending entries are never a hit: A's prompt is recomputed.
    a = c.create(PROMPT_A, pool="p")
    assert a.num_cached_tokens == 0
    b_down = c.take_tier_orders()             # (A's blocks took B's: B's go down meanwhile)
    a.free()
    assert [(o.src_tier, o.dst_tier) for o in b_down] == [(0, 1)] * 3
    assert _settle(c, orders) == 3
    host = _tiers(c, "p")["host"]
    assert (host.num_pending_blocks, host.num_used_blocks, host.confirmed) == (3, 3, 3)
    assert _settle(c, b_down) == 3
    # A's recomputed blocks are cached on the device again: they are shared, not loaded.
    a = c.create(PROMPT_A, pool="p")
    assert a.num_cached_tokens == 12 and not c.take_tier_orders()
    a.free()
    # B's blocks (loaded from the host tier) give way to A's loads: A's content is
    # in the host tier already (no copy down), so only the loads.
    b = c.create(PROMPT_B, pool="p")
    assert b.num_cached_tokens == 12
    b.free()
    b_loads = c.take_tier_orders()
    assert [(o.src_tier, o.dst_tier) for o in b_loads] == [(1, 0)] * 3
    a = c.create(PROMPT_A, pool="p")
    got = c.take_tier_orders()
    loads = [o for o in got if o.dst_tier == 0]
    assert [o.src_tier for o in loads] == [1, 1, 1]
    assert [o.dst for o in loads] == a.block_table[:3]
    assert {o.block_hash for o in loads} == {o.block_hash for o in orders}
    assert got == loads                                 # (B's content is down there already)
    assert a.num_cached_tokens == 12
    host = _tiers(c, "p")["host"]
    assert (host.hit_tokens, host.blocks_out, host.blocks_in, host.num_used_blocks) == (24, 6, 6, 6)
    assert audit(url, "p") == []


def test_a_failed_load_drops_its_entry_and_a_failed_copy_is_never_a_hit(tiered):
    server, c, url = tiered
    orders = sorted(_evict_a(c), key=lambda o: o.src)     # A's blocks 0, 1, 2 (fresh blocks, in order)
    assert _settle(c, orders[:2]) == 2
    assert _settle(c, orders[2:], ok=False) == 1          # the third block's copy failed: dropped
    a = c.create(PROMPT_A, pool="p")
    assert a.num_cached_tokens == 8                       # two blocks loaded, the third recomputed
    loads = [o for o in c.take_tier_orders() if o.dst_tier == 0]
    assert len(loads) == 2
    # The worker found the second load's bytes wrong: its entry is dropped.
    assert c.settle_tiers("p", loads[1].epoch, [pb.TierSettlement(order=loads[1], ok=False)]) == 1
    host = _tiers(c, "p")["host"]
    assert (host.load_failures, host.failed_copies, host.num_used_blocks) == (1, 1, 1)
    assert audit(url, "p") == []


def test_settling_orders_of_an_earlier_epoch_is_refused_and_bad_settlements_change_nothing(tiered):
    server, c, url = tiered
    orders = _evict_a(c)
    device = pb.TierOrder()
    device.CopyFrom(orders[0])
    device.dst_tier = 0
    with pytest.raises(errors.InvalidArgument, match="moves nothing through a lower tier"):
        c.settle_tiers("p", orders[0].epoch, [pb.TierSettlement(order=device, ok=True)])
    short = pb.TierOrder()
    short.CopyFrom(orders[0])
    short.block_hash = b"x"
    with pytest.raises(errors.InvalidArgument, match="16 bytes"):
        c.settle_tiers("p", orders[0].epoch, [pb.TierSettlement(order=short, ok=True)])
    # An order changed by its holder (another entry, another hash) is not the allocator's.
    for field, value in (("dst", orders[0].dst + 1), ("block_hash", bytes(16)), ("serial", 1)):
        forged = pb.TierOrder()
        forged.CopyFrom(orders[0])
        setattr(forged, field, value)
        with pytest.raises(errors.PermissionDenied, match="not an order of the allocator"):
            c.settle_tiers("p", orders[0].epoch, [pb.TierSettlement(order=forged, ok=True)])
    assert _tiers(c, "p")["host"].num_pending_blocks == 3
    c.register_pool("p", num_blocks=4, block_size=BS, host_tier_blocks=8)     # a new epoch
    with pytest.raises(errors.FailedPrecondition) as info:
        _settle(c, orders)
    assert info.value.reason == "EPOCH_CHANGED"
    host = _tiers(c, "p")["host"]
    assert (host.num_pending_blocks, host.num_used_blocks) == (0, 0)
    assert audit(url, "p") == []


def test_disk_entries_outlive_a_re_registration_that_keeps_its_file_and_host_entries_do_not(any_redis_url):
    with ServerThread(any_redis_url) as s, Client(s.target, tenant="t1", lease_ttl=30.0) as c:
        c.collect_tier_orders = True
        c.register_pool("p", num_blocks=2, block_size=BS, host_tier_blocks=2, disk_tier_blocks=8)
        prompts = [[k * 100 + i for i in range(BS + 1)] for k in range(1, 5)]   # one full block each
        for k in range(4):           # each prompt evicts the one before: 1 -> host, ..., 1 -> disk
            c.create(prompts[k], pool="p").free()
            assert _settle(c, c.take_tier_orders()) == (0, 1, 1, 2)[k]
        t = _tiers(c, "p")
        assert (t["host"].num_used_blocks, t["disk"].num_used_blocks, t["disk"].blocks_in) == (2, 1, 1)
        c.register_pool("p", num_blocks=2, block_size=BS, host_tier_blocks=2, disk_tier_blocks=8,
                        disk_tier_kept=True)
        t = _tiers(c, "p")
        assert (t["host"].num_used_blocks, t["disk"].num_used_blocks) == (0, 1)
        assert audit(any_redis_url, "p") == []
        a = c.create(prompts[0], pool="p")          # the first prompt's block: on disk only
        assert a.num_cached_tokens == BS
        assert [(o.src_tier, o.dst_tier, o.dst) for o in c.take_tier_orders()] == [(2, 0, a.block_table[0])]
        a.free()
        assert c.create(prompts[1], pool="p").num_cached_tokens == 0    # (its host entry died)
        assert audit(any_redis_url, "p") == []
        # Without the file (disk_tier_kept false) the disk tier starts empty.
        c.register_pool("p", num_blocks=2, block_size=BS, host_tier_blocks=2, disk_tier_blocks=8)
        assert _tiers(c, "p")["disk"].num_used_blocks == 0
        assert c.create(prompts[0], pool="p").num_cached_tokens == 0
        assert audit(any_redis_url, "p") == []


def test_register_refuses_tier_sizes_out_of_range(any_redis_url):
    with ServerThread(any_redis_url) as s, Client(s.target, tenant="t1") as c:
        with pytest.raises(errors.InvalidArgument, match="host_tier_blocks"):
            c.register_pool("p", num_blocks=4, host_tier_blocks=-1)
        with pytest.raises(errors.InvalidArgument, match="disk_tier_blocks"):
            c.register_pool("p", num_blocks=4, disk_tier_blocks=1 << 25)


def test_a_client_that_runs_no_orders_gets_no_loads(tiered):
    server, c, url = tiered
    _settle(c, _evict_a(c))                    # A's three blocks ready in the host tier
    with Client(server.target, tenant="t1", lease_ttl=30.0) as plain:      # (collect_tier_orders off)
        a = plain.create(PROMPT_A, pool="p")
        assert a.num_cached_tokens == 0        # the lookup stops at the device
        assert plain.take_tier_orders() == []
        a.free()
    assert _tiers(c, "p")["host"].blocks_out == 0
    a = c.create(PROMPT_A, pool="p")           # (A recomputed above is on the device again)
    assert a.num_cached_tokens == 12 and not [o for o in c.take_tier_orders() if o.dst_tier == 0]
    assert audit(url, "p") == []


def test_placement_counts_a_prefix_ready_in_a_lower_tier_for_a_client_that_runs_loads(tiered):
    """Pool p holds A's blocks in its host tier only, pool "a" none of them: counting the
    device alone, the two cost the same and a pool-less create of A goes to "a" (the
    smaller id); a client that runs loads gets p, where 3 blocks are loaded instead of
    computed (docs/allocator.md, "Placement")."""
    server, c, url = tiered
    c.register_pool("a", num_blocks=4, block_size=BS)
    _settle(c, _evict_a(c))                    # A's three blocks ready in p's host tier, none on its device
    with Client(server.target, tenant="t1", lease_ttl=30.0) as plain:      # (collect_tier_orders off)
        a = plain.create(PROMPT_A)
        assert (a.pool, a.num_cached_tokens) == ("a", 0)
        a.free()
        plain.create(PROMPT_B, pool="a").free()        # (A's blocks in "a" evicted: "a" caches none of A)
    a = c.create(PROMPT_A)
    loads = [o for o in c.take_tier_orders() if o.dst_tier == 0]
    assert (a.pool, a.num_cached_tokens, len(loads)) == ("p", 12, 3)
    assert {o.pool_id for o in loads} == {"p"}
    a.free()
    assert audit(url) == []
