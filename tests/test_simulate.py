"""The KV memory simulator: buddy allocator, accounting of every policy, sharing, CLI.

The paged policies run on a real allocator process (embedded Redis) through the SDK.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import client_env
from kvservice import cli
from kvservice.client import Client
from kvservice.simulate.buddy import Buddy, order_of
from kvservice.simulate.contiguous import reservation
from kvservice.simulate.paged import local_allocator
from kvservice.simulate.runner import POLICIES, simulate
from kvservice.simulate.sharing import parallel_sampling
from kvservice.simulate.workload import PRESETS, SimRequest, generate, prompt_tokens, summary

pytestmark = pytest.mark.e2e

SHARES = ("token_utilization", "reservation", "internal_frag", "external_frag", "reserved_unused", "free")
STATES = ("token", "reservation", "internal", "external", "reserved_unused", "free")


@pytest.fixture(scope="module")
def target():
    with local_allocator() as t:
        yield t


# ---------------------------------------------------------------- buddy allocator

def test_buddy_splits_lowest_first_and_merges_buddies():
    b = Buddy(16)
    assert [b.alloc(3), b.alloc(4), b.alloc(8)] == [0, 4, 8]
    assert b.size_of(0) == 4 and b.free_slots == 0 and b.largest_free == 0
    assert b.alloc(1) is None
    b.free(0)
    b.free(4)                                   # 0+4 and 4+4 merge into 0+8
    assert b.free_blocks() == [(0, 8)] and b.largest_free == 8
    b.check()
    b.free(8)
    assert b.free_blocks() == [(0, 16)] and len(b) == 0
    b.check()


def test_buddy_regions_of_a_capacity_that_is_not_a_power_of_two():
    first = Buddy(10)
    assert first.regions == [(0, 3), (8, 1)]
    assert [first.alloc(2), first.alloc(2), first.alloc(4), first.alloc(2)] == [0, 2, 4, 8]
    b = Buddy(10, fit="best")
    assert b.alloc(16) is None and b.alloc(9) is None
    assert b.alloc(2) == 8                      # the smallest block that fits: the tail region
    assert b.alloc(8) == 0
    b.free(8)
    b.free(0)
    assert b.free_blocks() == [(0, 8), (8, 2)]  # never merged across regions
    assert b.largest_free == 8 and b.free_slots == 10
    b.check()
    with pytest.raises(KeyError):
        b.free(3)
    with pytest.raises(ValueError):
        b.alloc(0)
    assert order_of(1) == 0 and order_of(5) == 3 and order_of(8) == 3


def _aligned_free(capacity_regions, used: dict[int, int], size: int, below: int | None = None) -> bool:
    """The model: an aligned range of ``size`` inside a region overlapping no used block
    (starting below ``below`` if given)."""
    for base, top in capacity_regions:
        for start in range(base, base + (1 << top) - size + 1, size):
            if below is not None and start >= below:
                break
            if all(start + size <= o or o + s <= start for o, s in used.items()):
                return True
    return False


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 96), fit=st.sampled_from(["first", "best"]),
       ops=st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 10 ** 6)), max_size=60))
def test_buddy_matches_a_simple_model(capacity, fit, ops):
    b = Buddy(capacity, fit=fit)
    used: dict[int, int] = {}                   # offset -> block size
    for is_alloc, size, pick in ops:
        if is_alloc or not used:
            rounded = 1 << order_of(size)
            expect = _aligned_free(b.regions, used, rounded)
            offset = b.alloc(size)
            assert (offset is not None) == expect
            if offset is not None:
                base, top = max((r for r in b.regions if r[0] <= offset), key=lambda r: r[0])
                assert (offset - base) % rounded == 0 and offset + rounded <= base + (1 << top)
                if fit == "first":              # no lower aligned free range of that size
                    assert not _aligned_free(b.regions, used, rounded, below=offset)
                assert all(offset + rounded <= o or o + s <= offset for o, s in used.items())
                used[offset] = rounded
        else:
            offset = sorted(used)[pick % len(used)]
            b.free(offset)
            del used[offset]
        b.check()
        assert b.free_slots == capacity - sum(used.values())
        assert b.largest_free == max((1 << k for k in range(8) if _aligned_free(b.regions, used, 1 << k)),
                                     default=0)


# ---------------------------------------------------------------- workloads

def test_generate_is_seeded_clipped_and_near_the_preset_means():
    a = generate("sharegpt", 3000, seed=5, rate=2.0)
    assert a == generate("sharegpt", 3000, seed=5, rate=2.0) != generate("sharegpt", 3000, seed=6, rate=2.0)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.final_len <= 2048 for r in a)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a) and a[0].arrival == 0
    s = summary(a)
    assert 140 < s["mean_prompt"] < 180 and 310 < s["mean_output"] < 370
    assert 1300 < s["last_arrival"] < 1700      # 3,000 arrivals at 2 per step
    short = generate("alpaca", 300, seed=1, rate=1.0, max_len=64)
    assert all(r.final_len <= 64 for r in short)
    sys_reqs = generate("system-prompt", 3, seed=2, rate=1.0)
    p = [prompt_tokens(r, 2) for r in sys_reqs]
    k = PRESETS["system-prompt"].shared_prefix
    assert p[0][:k] == p[1][:k] == p[2][:k] and p[0][k:] != p[1][k:]
    with pytest.raises(ValueError, match="unknown workload"):
        generate("nope", 1, seed=0, rate=1.0)


def test_reservations_of_the_contiguous_policies():
    assert reservation("max", 10, 20, 2048) == 2048
    assert reservation("pow2", 10, 20, 2048) == 42 and reservation("pow2", 1500, 600, 2048) == 2048
    assert reservation("oracle", 10, 20, 2048) == 30


# ---------------------------------------------------------------- accounting, every policy

def _small_trace() -> list[SimRequest]:
    """Alpaca lengths behind a 32-token shared prefix, every third request with two
    samples, and one request longer than the model's maximum length."""
    base = generate("alpaca", 45, seed=11, rate=2.0, max_len=200)
    reqs = [dataclasses.replace(r, prompt_len=r.prompt_len + 32, shared_prefix=32, n=2 if r.id % 3 == 0 else 1)
            for r in base]
    return reqs + [SimRequest(45, 5, 200, 100)]


@pytest.fixture(scope="module")
def small_runs(target):
    reqs = _small_trace()
    runs, steps = {}, {}
    for policy in POLICIES:
        seen = steps[policy] = []
        runs[policy] = simulate(reqs, policy, capacity_tokens=1024, block_size=16, max_len=256,
                                target=target, seed=11, workload="alpaca+prefix", debug=True,
                                on_step=seen.append, timeline_points=50)
    return reqs, runs, steps


def test_every_step_stays_within_capacity_and_the_shares_add_up(small_runs):
    reqs, runs, steps = small_runs
    for policy, r in runs.items():
        assert steps[policy], policy
        for s in steps[policy]:
            assert 0 <= s["allocated"] <= s["capacity"] == 1024, (policy, s)
            assert sum(s[k] for k in STATES) == 1024
            assert min(s[k] for k in STATES) >= 0
            # the SDK's lease reserve: paged runs only, at most the study allocator's cap of 4 blocks
            assert s["reserved_unused"] <= (4 * 16 if policy.startswith("paged") else 0), (policy, s)
        assert abs(sum(r[k] for k in SHARES) - 1) < 1e-9, policy
        assert r["completed"] + r["failed"] == r["num_requests"] == len(reqs), policy
        assert r["failed"] == 1, policy         # the request longer than max_len
        assert r["measured_regime"] and r["measured_steps"] > 0
        assert len(r["timeline"]["step"]) <= 50 and set(r["timeline"]) >= {"token", "free", "running"}
        assert r["audit_ok"], policy


def test_paged_runs_end_clean_and_beat_every_contiguous_policy(small_runs):
    _, runs, _ = small_runs
    for policy in ("paged", "paged-shared"):
        r = runs[policy]
        assert r["audit_ok"] and r["num_used_blocks"] == 0 and r["block_size"] == 16
        assert 0 < r["peak_blocks"] <= 64
        assert r["token_utilization"] > max(runs[p]["token_utilization"] for p in ("max", "pow2", "oracle"))
        assert r["external_frag"] == 0
        assert 0 < r["reserved_unused"] <= 4 / 64 and r["peak_reserved_blocks"] == 4
    assert runs["max"]["internal_frag"] > runs["oracle"]["internal_frag"]
    assert runs["max"]["token_utilization"] < runs["oracle"]["token_utilization"]
    shared = runs["paged-shared"]
    assert shared["cow_copies"] > 0 and shared["prefix_hit_tokens"] > 0
    # Sharing the prefix and the samples' prompts lets more requests run at once.
    assert shared["max_concurrency"] > runs["paged"]["max_concurrency"]
    assert runs["max"]["block_size"] == 1 and runs["max"]["avg_block_table_len"] == 0
    assert all(runs[p]["reserved_unused"] == 0 for p in ("max", "pow2", "oracle"))


def test_paged_policies_need_a_target_and_a_power_of_two_block():
    with pytest.raises(ValueError, match="target"):
        simulate([], "paged", capacity_tokens=1024)
    with pytest.raises(ValueError, match="block_size"):
        simulate([], "paged", capacity_tokens=1024, block_size=24, target="x:1")
    with pytest.raises(ValueError, match="unknown policy"):
        simulate([], "best", capacity_tokens=1024)


# ---------------------------------------------------------------- external fragmentation

def test_holes_strand_a_contiguous_request_but_not_a_paged_one(target):
    # Contiguous: 10 blocks of 16 tokens, buddy regions of 8 and 2 blocks.
    b = Buddy(10)
    seqs = [b.alloc(2) for _ in range(4)]        # four 32-token sequences
    assert seqs == [0, 2, 4, 6]
    b.free(seqs[1])
    b.free(seqs[3])                             # holes at blocks 2-3 and 6-7; 8-9 untouched
    assert b.free_slots == 6 >= 4 and b.largest_free == 2
    assert b.alloc(4) is None                   # a 64-token request does not fit
    b.check()
    # Paged, on the allocator: the same story in a registered 10-block pool.
    with Client(target, tenant="frag") as client:
        client.register_pool("frag-10", num_blocks=10, block_size=16)
        live = [client.create(list(range(100 * i, 100 * i + 32)), pool="frag-10") for i in range(4)]
        assert all(len(s.block_table) == 2 for s in live)
        client.step(frees=[live[1], live[3]])
        big = client.create(list(range(5000, 5064)), pool="frag-10")
        table = big.block_table
        assert len(table) == 4 and len(set(table)) == 4
        assert table != list(range(table[0], table[0] + 4))     # not one contiguous range
        assert client.pool_stats("frag-10").num_used_blocks == 8
        client.step(frees=[live[0], live[2], big])
        assert client.audit("frag-10").ok


def test_the_runner_counts_external_fragmentation_for_buddy_placement_only(target):
    # Oracle places the four 32-slot reservations at 128 (the tail region), 0, 32 and 64 of
    # 160 slots; the first and third end at step 2, leaving 32-slot holes at 32, 96 and
    # 128: 96 free slots, no aligned 64.
    reqs = [SimRequest(0, 0, 30, 2), SimRequest(1, 0, 16, 16), SimRequest(2, 0, 30, 2),
            SimRequest(3, 0, 16, 16), SimRequest(4, 3, 60, 4)]
    oracle = simulate(reqs, "oracle", capacity_tokens=160, max_len=160, debug=True)
    assert oracle["external_frag"] > 0 and oracle["failures"] == 1
    # Paged in the same 10 blocks: nothing is stranded, and the 64-token request does not
    # wait: refused first for the 4 blocks in the SDK's lease reserve (granted for growth,
    # in no table), the SDK gives them back and the create goes through...
    steps: list[dict] = []
    paged = simulate(reqs, "paged", capacity_tokens=160, block_size=16, max_len=160, target=target, debug=True,
                     on_step=steps.append)
    assert paged["external_frag"] == 0 and paged["failures"] == 0
    assert not [s for s in steps if s["waiting"]]
    # ... as with room for the reserve besides.
    roomy = simulate(reqs, "paged", capacity_tokens=160 + 4 * 16, block_size=16, max_len=160, target=target,
                     debug=True)
    assert roomy["external_frag"] == 0 and roomy["failures"] == 0
    assert oracle["completed"] == paged["completed"] == roomy["completed"] == 5
    assert roomy["steps"] < oracle["steps"]


# ---------------------------------------------------------------- parallel sampling

def test_parallel_sampling_shares_the_prompt(target):
    r = parallel_sampling(target, prompt_len=2000, n=4, output_len=100, block_size=16)
    assert r["physical_blocks"] == r["minimum_blocks"] == 125 + 4 * 7
    assert r["independent_blocks"] == r["independent_measured"] == 4 * 132
    assert r["sample_tokens"] == [2100] * 4
    assert r["saving"] > 0.5 and r["audit_ok"] and r["num_used_blocks"] == 0
    odd = parallel_sampling(target, prompt_len=2001, n=4, output_len=20, block_size=16)
    assert odd["physical_blocks"] == odd["minimum_blocks"] and odd["cow_copies"] == 3


# ---------------------------------------------------------------- command line

def test_cli_prints_a_json_list(target):
    out = subprocess.run(
        [sys.executable, "-m", "kvservice", "simulate", "--workload", "alpaca", "--requests", "40",
         "--max-len", "512", "--capacity-tokens", "2048", "--policies", "max,oracle,paged",
         "--target", target, "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **client_env()})
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert [r["policy"] for r in results] == ["max", "oracle", "paged"]
    for r in results:
        assert {"policy", "block_size", "token_utilization", "reservation", "internal_frag", "external_frag",
                "failures", "max_concurrency", "completed"} <= set(r)
        assert "timeline" not in r and r["completed"] == 40 and r["seed"] == 0
    assert "40/40" in out.stderr                # the progress lines


@pytest.mark.parametrize("argv, name", [
    (["--policies", "max,best"], "--policies"),
    (["--block-sizes", "16,24"], "--block-sizes"),
    (["--requests", "0"], "--requests"),
    (["--workload", "chat"], "--workload"),
])
def test_cli_rejects_bad_arguments(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate", *argv])
    assert exc.value.code == 2
    assert name in capsys.readouterr().err


def test_cli_rejects_a_capacity_below_the_maximum_length(capsys):
    assert cli.main(["simulate", "--capacity-tokens", "1000", "--max-len", "2048"]) == 2
    assert "--capacity-tokens" in capsys.readouterr().err
    assert cli.main(["simulate", "--capacity-tokens", "4100", "--block-sizes", "16", "--max-len", "64"]) == 2
    assert "--block-sizes" in capsys.readouterr().err
