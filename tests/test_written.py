"""A block's hash is announced only once its KV is written (``Client(commit_after_write=
True)``, as engines run it): a create's new blocks, and the blocks that fill later, are
committed only once the writer declares them written (``Sequence.mark_written``). Until
then no other create hits them, no fetch reads them, no copy down is ordered for them;
a writer that frees them first, or dies, leaves no hash behind. In both modes of the SDK,
over one Redis and the local Redis Cluster."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvservice.client import Client

from helpers import TEST_SETTINGS, ServerThread, audit

BS = 4
PROMPT = list(range(1, 14))            # 13 tokens: 3 full blocks and a partial one
OTHERS = [[100 * (i + 1) + t for t in range(12)] for i in range(3)]

pytestmark = pytest.mark.cluster_too


@pytest.fixture
def server(any_redis_url):
    settings = dataclasses.replace(TEST_SETTINGS, reap_recheck=0.2)
    with ServerThread(any_redis_url, settings) as s:
        with Client(s.target, tenant="t1") as admin:
            admin.register_pool("a", num_blocks=16, block_size=BS, host_tier_blocks=8)
            admin.register_pool("b", num_blocks=16, block_size=BS)
        yield s, any_redis_url


def _writer(s: ServerThread, local: bool, **kw) -> Client:
    c = Client(s.target, tenant="t1", local=local, commit_after_write=True, lease_ttl=kw.pop("lease_ttl", 30.0), **kw)
    c.collect_tier_orders = c.collect_fetches = True
    return c


def _reader(s: ServerThread, *, engine: bool = True) -> Client:
    """Another engine's client (its own creates register nothing unwritten), or with
    ``engine=False`` an allocator-only client (its creates commit their full blocks)."""
    c = Client(s.target, tenant="t1", lease_ttl=30.0, commit_after_write=engine)
    c.collect_tier_orders = c.collect_fetches = True
    return c


def _hit(reader: Client, pool: str = "a") -> tuple[int, list[int]]:
    """The cached tokens of a create of PROMPT in ``pool``, and its block table (freed)."""
    seq = reader.create(PROMPT, pool=pool)
    out = seq.num_cached_tokens, seq.block_table
    seq.free()
    return out


@pytest.mark.parametrize("local", [False, True], ids=["remote", "local"])
def test_a_create_s_blocks_are_hit_only_once_the_writer_declares_them_written(server, local):
    s, url = server
    with _writer(s, local) as w, _reader(s) as r:
        seq = w.create(PROMPT, pool="a")
        assert seq.num_cached_tokens == 0 and seq.num_written_tokens == 0
        w.step({seq: [50]})                     # (a step, a flush: nothing is written yet)
        w.flush()
        assert _hit(r)[0] == 0
        seq.mark_written(8)                     # two blocks' KV is there
        w.step({seq: [51]})
        w.flush()
        cached, table = _hit(r)
        assert cached == 8 and table[:2] == seq.block_table[:2]
        seq.mark_written(seq.num_tokens)
        w.flush()                               # (no step: the flush says it)
        cached, table = _hit(r)
        assert cached == 12 and table[:3] == seq.block_table[:3]
        assert seq.num_written_tokens == 15
        seq.free()
    assert audit(url, "a") == []


@pytest.mark.parametrize("local", [False, True], ids=["remote", "local"])
def test_a_writer_that_frees_its_blocks_unwritten_or_dies_leaves_no_hash(server, local):
    s, url = server
    with _writer(s, local) as w, _reader(s) as r:
        seq = w.create(PROMPT, pool="a")
        seq.mark_written(4)                     # one block written, two not
        seq.free()
        w.flush()
        assert _hit(r)[0] == 4
    # A writer killed between its create and its write: its lease is reaped, no hash stays.
    dead = _writer(s, local, lease_ttl=1.0, keepalive=False) if not local else _writer(s, local, lease_ttl=1.0)
    seq = dead.create(list(range(200, 213)), pool="a")
    dead.close(revoke=False)                    # (gone without a word)
    with _reader(s) as r:
        deadline = time.monotonic() + 20
        while r.pool_stats("a").num_sequences:
            assert time.monotonic() < deadline, "the dead writer's lease was not reaped"
            time.sleep(0.1)
        again = r.create(list(range(200, 213)), pool="a")
        assert again.num_cached_tokens == 0
        again.free()
    assert audit(url, "a") == []


def test_another_pool_fetches_only_written_blocks(server):
    s, url = server
    with _writer(s, False) as w, _reader(s) as r:
        seq = w.create(PROMPT, pool="a")
        w.take_tier_orders()
        cached, _ = _hit(r, "b")
        assert cached == 0 and not [o for o in r.take_tier_orders() if o.source_pool_id]
        seq.mark_written(13)
        seq.free()                              # (its full blocks committed as it goes)
        cached, table = _hit(r, "b")
        fetches = [o for o in r.take_tier_orders() if o.source_pool_id]
        assert cached == 12 and [o.source_pool_id for o in fetches] == ["a"] * 3
        assert [o.dst for o in fetches] == table[:3]
        r.settle_tiers("b", fetches[0].epoch, [], list({o.pin_id for o in fetches}), [], [])
    assert audit(url, "a") == [] and audit(url, "b") == []


def test_an_unwritten_block_is_freed_unhashed_so_no_copy_down_is_ordered_for_it(server):
    # (a copy down is ordered when a hashed block is evicted: an unhashed one goes back to
    # the free list, never to the evictable set)
    s, url = server
    with _writer(s, False) as w, _reader(s, engine=False) as filler:
        unwritten = w.create(PROMPT, pool="a")
        unwritten.free()
        stats = filler.pool_stats("a")
        assert (stats.num_free_blocks, stats.num_evictable_blocks) == (16, 0)
        for prompt in OTHERS + [[t + 1 for t in p] for p in OTHERS]:     # (18 blocks: 2 evicted)
            filler.create(prompt, pool="a").free()
        downs = [o for o in filler.take_tier_orders() + w.take_tier_orders() if o.dst_tier]
        assert len(downs) == 2 == filler.pool_stats("a").evictions
        written = w.create(PROMPT, pool="a")
        written.mark_written(13)
        written.free()
        assert filler.pool_stats("a").num_evictable_blocks == 16 - 1      # (its 3 full blocks stay cached)
    assert audit(url, "a") == []
