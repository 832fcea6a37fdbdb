"""Sequence.migrate (DESIGN §13) through the service: a live sequence moves to another
pool; its copy's blocks come with fetch orders from the old ones, which stay pinned until
the fetches are settled; the old sequence is freed; a refused migration changes nothing.
In local and remote mode, over one Redis and the local Redis Cluster."""

from __future__ import annotations

import pytest

from kvservice import errors
from kvservice.client import Client

from helpers import ServerThread, audit, keyspace

BS = 4
PROMPT = list(range(1, 15))            # 14 tokens: 3 full blocks and a partial one

pytestmark = pytest.mark.cluster_too


@pytest.fixture(params=["local", "remote"])
def pools(any_redis_url, request):
    with ServerThread(any_redis_url) as s, Client(s.target, tenant="t1", lease_ttl=30.0,
                                                   local=request.param == "local") as c:
        c.collect_tier_orders = True
        c.register_pool("a", num_blocks=8, block_size=BS)
        c.register_pool("b", num_blocks=8, block_size=BS)
        yield s, c, any_redis_url


def _pools_state(url: str) -> dict[bytes, bytes]:
    """The pools' keys (not the lease deadlines, which a keep-alive moves, nor the records
    of the Syncs' request ids)."""
    return {k: v for k, v in keyspace(url).items() if k.startswith((b"kvs:{a}", b"kvs:{b}")) and
            not k.endswith(b":leases") and b":req:" not in k}


def test_a_live_sequence_moves_to_another_pool_block_for_block(pools):
    server, c, url = pools
    s = c.create(PROMPT, pool="a")
    s.append([20, 21, 22])                         # 17 tokens: 4 full blocks committed, 1 partial
    old_table = s.block_table
    copy = s.migrate("b")
    assert s.freed and copy.pool == "b" and copy.num_tokens == 17 and len(copy.block_table) == 5
    orders = c.take_tier_orders()
    assert [(o.pool_id, o.source_pool_id, o.src_tier) for o in orders] == [("b", "a", 0)] * 5
    assert [o.src for o in orders] == old_table and [o.dst for o in orders] == copy.block_table
    assert len({o.pin_id for o in orders}) == 1
    # The old blocks are pinned (referenced) until the fetches are settled.
    assert c.pool_stats("a").num_used_blocks == 5
    c.flush()
    assert audit(url) == []
    c.settle_tiers("a", orders[0].source_epoch, [], [orders[0].pin_id])
    assert c.pool_stats("a").num_used_blocks == 0
    # The copy goes on: commits, growth, a fork; the audit stays clean.
    copy.append([23, 24, 25, 26])
    child = copy.fork([27])
    c.flush()
    assert c.get(copy.id).num_tokens == 21 and audit(url) == []
    child.free()
    copy.free()
    c.flush()
    assert audit(url) == []


def test_a_migration_shares_what_the_destination_caches_and_a_refused_one_changes_nothing(pools):
    server, c, url = pools
    cached = c.create(PROMPT, pool="b")
    cached.free()                                  # (b caches the prompt's 3 full blocks)
    s = c.create(PROMPT, pool="a")
    copy = s.migrate("")                           # (placed: the only other pool)
    orders = c.take_tier_orders()
    assert copy.pool == "b" and len(orders) == 1 and orders[0].dst == copy.block_table[3]
    c.settle_tiers("a", orders[0].source_epoch, [], [orders[0].pin_id])
    c.flush()
    before = _pools_state(url)
    with pytest.raises(errors.InvalidArgument, match="already"):
        copy.migrate("b")
    with pytest.raises(errors.NotFound):
        c.migrate(copy, "nowhere")
    c.collect_tier_orders = False
    with pytest.raises(errors.FailedPrecondition, match="collect_tier_orders"):
        copy.migrate("a")
    c.collect_tier_orders = True
    assert _pools_state(url) == before
    big = c.create(list(range(100, 120)), pool="a")    # (a keeps 3 of its 8 blocks free)
    with pytest.raises(errors.ResourceExhausted):
        copy.migrate("a")
    big.free()
    c.flush()
    assert not copy.freed and not c.take_tier_orders()
    assert c.pool_stats("a").num_used_blocks == 0 and c.pool_stats("b").num_used_blocks == 4 and audit(url) == []
    copy.free()


def test_a_lease_that_never_held_anything_in_the_destination_is_attached_there(pools):
    server, c, url = pools
    s = c.create(PROMPT)                           # (placed: the lease is attached to both pools' records)
    other = "b" if s.pool == "a" else "a"
    copy = s.migrate(other)
    assert copy.pool == other and len(c.take_tier_orders()) == 4
    copy.free()
    c.flush()
    assert c.pool_stats(other).num_sequences == 0
