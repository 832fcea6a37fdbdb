"""Fetches between pools in the allocator (DESIGN §13, scripts/pin.lua, lib/pins.lua),
through the service: a create whose prefix another pool holds gets fetch orders and a read
pin there; the pin keeps the blocks from eviction until it is released or its deadline
passes; the audit knows pins. Over one Redis and the local Redis Cluster."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvservice import errors
from kvservice.allocator import keys
from kvservice.client import Client
from kvservice.v1 import allocator_pb2 as pb

from helpers import TEST_SETTINGS, ServerThread, audit, is_cluster, sync_redis

BS = 4
PROMPT_A = list(range(1, 14))          # 13 tokens: 3 full blocks (hashed) and a partial one
PROMPT_B = list(range(100, 113))
TTL = 1.5                              # the pins' deadline in these tests (s)

pytestmark = pytest.mark.cluster_too


def _client(s: ServerThread, tenant: str = "t1") -> Client:
    c = Client(s.target, tenant=tenant, lease_ttl=30.0)
    c.collect_tier_orders = c.collect_fetches = True
    return c


@pytest.fixture
def two(any_redis_url):
    settings = dataclasses.replace(TEST_SETTINGS, fetch_pin_ttl=TTL, reap_recheck=0.5)
    with ServerThread(any_redis_url, settings) as s, _client(s) as c:
        c.register_pool("a", num_blocks=6, block_size=BS, host_tier_blocks=6)
        c.register_pool("b", num_blocks=6, block_size=BS)
        yield s, c, any_redis_url


def _fetches(orders) -> list[pb.TierOrder]:
    return [o for o in orders if o.source_pool_id]


def _pins(url: str, pool: str) -> dict[str, str]:
    with sync_redis(url) as r:
        return {k.decode(): v.decode() for k, v in r.hgetall(keys.pool_key(pool, "pins")).items()}


def _cached_in_a(c: Client) -> list[int]:
    """A's three full blocks cached (evictable) in pool a: their block ids."""
    a = c.create(PROMPT_A, pool="a")
    table = list(a.block_table[:3])
    a.free()
    assert not _fetches(c.take_tier_orders())
    return table


def _shard(url: str, pool: str) -> str:
    with sync_redis(url) as r:
        return r.get_node_from_key(keys.pool_key(pool, "meta")).name


def test_a_create_fetches_a_prefix_another_pool_holds_and_the_pin_is_released_when_settled(two):
    server, c, url = two
    if is_cluster(url):                                   # (the pin and the create on two shards)
        assert _shard(url, "a") != _shard(url, "b")
    held = _cached_in_a(c)
    s = c.create(PROMPT_A, pool="b")
    assert s.num_cached_tokens == 12                      # 3 blocks, to be fetched, not computed
    orders = _fetches(c.take_tier_orders())
    assert [(o.pool_id, o.source_pool_id, o.src_tier, o.dst_tier) for o in orders] == [("b", "a", 0, 0)] * 3
    assert [o.src for o in orders] == held and [o.dst for o in orders] == list(s.block_table[:3])
    pin = orders[0].pin_id
    assert len(pin) == 32 and {o.pin_id for o in orders} == {pin}
    assert orders[0].source_epoch == c.pool_stats("a").epoch
    assert audit(url, "a") == [] and audit(url, "b") == []
    stats = c.pool_stats("a")
    assert stats.num_evictable_blocks == 0 and stats.num_used_blocks == 3     # (pinned: referenced)
    pins = _pins(url, "a")
    assert pins["p:" + pin].split()[1:] == [f"b:{b}" for b in held]
    # The pinned blocks are never evicted: pool a gives only its 3 other blocks.
    with pytest.raises(errors.ResourceExhausted):
        c.create(list(range(500, 525)), pool="a")
    big = c.create(list(range(500, 512)), pool="a")
    assert not set(big.block_table) & set(held)
    big.free()
    assert c.settle_tiers("a", orders[0].source_epoch, [], [pin]) == 0
    assert _pins(url, "a") == {}
    assert c.pool_stats("a").num_used_blocks == 0
    assert audit(url, "a") == []
    s.free()
    # Released: a fourth create in b finds A's prefix there now (shared, no fetch).
    again = c.create(PROMPT_A, pool="b")
    assert again.num_cached_tokens == 12 and not _fetches(c.take_tier_orders())
    again.free()


def test_a_pin_never_released_ends_at_its_deadline(two):
    server, c, url = two
    held = _cached_in_a(c)
    s = c.create(PROMPT_A, pool="b")
    orders = _fetches(c.take_tier_orders())
    assert len(orders) == 3
    assert c.pool_stats("a").num_used_blocks == 3
    deadline = time.monotonic() + TTL + 5
    while _pins(url, "a"):                                # (the reaper sweeps it once due)
        assert time.monotonic() < deadline, _pins(url, "a")
        time.sleep(0.1)
    stats = c.pool_stats("a")
    assert stats.num_used_blocks == 0 and stats.num_evictable_blocks == 3
    assert audit(url, "a") == []
    # Settling it later releases nothing.
    assert c.settle_tiers("a", orders[0].source_epoch, [], [orders[0].pin_id]) == 0
    assert audit(url, "a") == []
    s.free()
    assert held


def test_no_fetch_of_blocks_a_live_sequence_of_the_source_holds_nor_for_a_client_without_fetches(two):
    server, c, url = two
    live = c.create(PROMPT_A, pool="a")               # (its owner may still be writing them)
    s = c.create(PROMPT_A, pool="b")
    assert s.num_cached_tokens == 0 and not _fetches(c.take_tier_orders())
    s.free()
    live.free()
    other = c.create(PROMPT_B, pool="a")
    other.free()
    c.collect_fetches = False
    s = c.create(PROMPT_B, pool="b")
    assert s.num_cached_tokens == 0 and not _fetches(c.take_tier_orders())
    assert _pins(url, "a") == {}
    s.free()


def test_a_prefix_in_the_source_s_host_tier_is_fetched_from_there_and_its_entries_are_not_evicted(two):
    server, c, url = two
    _cached_in_a(c)
    b = c.create(list(range(100, 124)), pool="a")     # (evicts A's blocks: copied down to a's host tier)
    down = c.take_tier_orders()
    assert [(o.src_tier, o.dst_tier) for o in down] == [(0, 1)] * 3
    c.settle_tiers("a", down[0].epoch, [pb.TierSettlement(order=o, ok=True) for o in down])
    entry_of = {o.block_hash: o.dst for o in down}
    s = c.create(PROMPT_A, pool="b")
    orders = _fetches(c.take_tier_orders())
    assert [(o.src_tier, o.src) for o in orders] == [(1, entry_of[o.block_hash]) for o in orders]
    assert len(orders) == 3 and s.num_cached_tokens == 12
    pins = _pins(url, "a")
    assert sorted(k for k in pins if not k.startswith(("p:", "next"))) == sorted(f"h:{o.dst}" for o in down)
    assert audit(url, "a") == []
    # 6 more blocks go down: the host tier's 3 free entries take 3; A's pinned entries
    # are not evicted for the others.
    b.free()
    y = c.create(list(range(200, 224)), pool="a")
    more = c.take_tier_orders()
    assert len(more) == 3 and not {o.dst for o in more} & set(entry_of.values())
    y.free()
    s.free()
    c.settle_tiers("a", orders[0].source_epoch, [], [orders[0].pin_id])
    assert _pins(url, "a") == {} and audit(url, "a") == []


def test_another_tenant_s_prefix_is_never_fetched(two):
    server, c, url = two
    _cached_in_a(c)
    with _client(server, "t2") as other:
        s = other.create(PROMPT_A, pool="b")
        assert s.num_cached_tokens == 0 and not _fetches(other.take_tier_orders())
        s.free()
    assert _pins(url, "a") == {}


def test_a_pool_less_create_goes_where_its_prefix_is_and_a_stale_pin_release_is_refused(two):
    server, c, url = two
    _cached_in_a(c)
    s = c.create(PROMPT_A)
    assert s.pool == "a" and s.num_cached_tokens == 12 and not _fetches(c.take_tier_orders())
    s.free()
    with pytest.raises(errors.InvalidArgument, match="pin id"):
        c.settle_tiers("a", s.epoch, [], ["not-a-pin"])
    with pytest.raises(errors.FailedPrecondition):
        c.settle_tiers("a", s.epoch + 1, [], ["0" * 32])


def _changed(order: pb.TierOrder, **fields) -> pb.TierOrder:
    out = pb.TierOrder()
    out.CopyFrom(order)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def test_the_blocks_of_failed_fetches_lose_their_hash_on_the_fetch_orders_only(two):
    """SettleTiers forget: the blocks that fetches failed to fill lose the hash their orders
    name; a referenced one stays in its table, free once freed, and no create hits it. Only
    the allocator's orders count: an order its holder changed is refused, and one whose
    block holds another hash forgets nothing."""
    server, c, url = two
    _cached_in_a(c)
    s = c.create(PROMPT_A, pool="b")
    orders = _fetches(c.take_tier_orders())
    assert len(orders) == 3 and s.num_cached_tokens == 12
    c.settle_tiers("a", orders[0].source_epoch, [], [orders[0].pin_id])
    with pytest.raises(errors.PermissionDenied, match="not an order of the allocator"):
        c.settle_tiers("b", s.epoch, [], [], [_changed(orders[1], block_hash=orders[0].block_hash)])
    with pytest.raises(errors.InvalidArgument, match="for pool .b. at epoch"):
        c.settle_tiers("a", orders[0].source_epoch, [], [], [orders[1]])
    c.settle_tiers("b", s.epoch, [], [], orders[1:])          # (the second and third fetches failed)
    # (the second order again, aimed at the first block: that block holds another hash, kept)
    c.settle_tiers("b", s.epoch, [], [], [_changed(orders[1], dst=orders[0].dst)])
    s.free()
    stats = c.pool_stats("b")
    assert (stats.num_evictable_blocks, stats.num_free_blocks) == (1, 5)   # (the forgotten two: free)
    assert audit(url, "b") == []
    c.collect_fetches = False
    again = c.create(PROMPT_A, pool="b")
    assert again.num_cached_tokens == 4 and again.block_table[0] == orders[0].dst
    again.free()
    assert audit(url, "a") == [] and audit(url, "b") == [] and _pins(url, "a") == {}


def test_a_forgotten_hash_leaves_the_lower_tiers_too(two):
    server, c, url = two
    _cached_in_a(c)
    filler = c.create(list(range(300, 324)), pool="a")   # (evicts A's blocks: copied down)
    down = c.take_tier_orders()
    c.settle_tiers("a", down[0].epoch, [pb.TierSettlement(order=o, ok=True) for o in down])
    filler.free()

    def host_used() -> int:
        return {t.tier: t for t in c.pool_stats("a").tiers}["host"].num_used_blocks
    assert host_used() == 3
    top = c.create(PROMPT_A, pool="a")                   # (loaded from the host tier)
    assert top.num_cached_tokens == 12
    loads = [o for o in c.take_tier_orders() if o.dst == top.block_table[0]]
    assert [(o.src_tier, o.dst_tier) for o in loads] == [(1, 0)]
    c.settle_tiers("a", top.epoch, [], [], loads)             # (the load of the first block failed)
    assert host_used() == 2
    top.free()
    s = c.create(PROMPT_A, pool="b")                     # (no chain left to fetch)
    assert s.num_cached_tokens == 0 and not _fetches(c.take_tier_orders())
    s.free()
    assert audit(url, "a") == [] and audit(url, "b") == []
