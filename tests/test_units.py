"""Pure functions: block hashes, sequence ids, settings, script headers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvservice import errors
from kvservice.common import hashing
from kvservice.allocator.config import Settings
from kvservice.allocator.domain import format_sequence_id, parse_sequence_id
from kvservice.common.geometry import Geometry

pytestmark = pytest.mark.e2e


def test_chained_hashes_match_block_by_block():
    root = hashing.root_hash("acme")
    tokens = list(range(40))
    chain = hashing.chain_hashes(root, tokens, 16, 2)
    assert chain[0] == hashing.block_hash(root, tokens[:16])
    assert chain[1] == hashing.block_hash(chain[0], tokens[16:32])
    assert len(chain[0]) == hashing.HASH_BYTES == 16


def test_hashes_depend_on_salt_extra_key_parent_and_every_token():
    a = hashing.root_hash("acme")
    assert a != hashing.root_hash("other") and a != hashing.root_hash("acme", b"lora-1")
    assert hashing.root_hash("ab", b"c") != hashing.root_hash("a", b"bc")
    block = list(range(16))
    h = hashing.block_hash(a, block)
    assert h != hashing.block_hash(hashing.root_hash("other"), block)
    for i in range(16):
        changed = block.copy()
        changed[i] += 1
        assert hashing.block_hash(a, changed) != h
    # Stable across processes (not Python's salted hash()).
    code = "from kvservice.common import hashing; print(hashing.block_hash(hashing.root_hash('acme'), range(16)).hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert other == h.hex()
    assert len({hashing.block_hash(a, [t] * 16) for t in range(1000)}) == 1000


def test_sequence_ids_round_trip_and_reject_garbage():
    sid = format_sequence_id("w-0.a", 3, 17, "0123456789abcdef")
    tag = hashing.sequence_tag("0123456789abcdef", "w-0.a", 3, 17)
    assert sid == f"w-0.a/3/17-{tag}" and len(tag) == 12
    assert parse_sequence_id(sid) == ("w-0.a", 3, 17, tag)
    assert parse_sequence_id("w-0.a/3/17") == ("w-0.a", 3, 17, "")
    # the tag follows the lease and the sequence: another lease, or a neighbour, differs
    assert tag != hashing.sequence_tag("0123456789abcdee", "w-0.a", 3, 17)
    assert tag != hashing.sequence_tag("0123456789abcdef", "w-0.a", 3, 18)
    for bad in ("", "w0", "w0/1", "w0/x/1", "w0/1/2/3", "w 0/1/2", "w0/-1/2", "w0/1/2-", "w0/1/2-abc",
                f"w0/1/2-{tag.upper()}", f"w0/1/2-{tag}0"):
        with pytest.raises(errors.InvalidArgument, match="malformed sequence_id"):
            parse_sequence_id(bad)


@pytest.mark.parametrize("bs", [0, 3, 6, 512, -16])
def test_geometry_rejects_block_sizes_that_are_not_powers_of_two_up_to_256(bs):
    with pytest.raises(errors.InvalidArgument, match="block_size must be a power of two"):
        Geometry(8, bs, 1, 1, 64, "float16").check()


def test_geometry_bytes_per_block():
    g = Geometry(8, 16, 32, 8, 128, "bfloat16")
    g.check()
    assert g.bytes_per_block == 2 * 32 * 16 * 8 * 128 * 2


def test_settings_read_env_and_flags_win():
    s = Settings.from_env({"KVSERVICE_PORT": "7000", "KVSERVICE_REAP_INTERVAL": "0.25"}, port=7001)
    assert (s.port, s.reap_interval) == (7001, 0.25)
    with pytest.raises(ValueError, match="KVSERVICE_PORT"):
        Settings.from_env({"KVSERVICE_PORT": "x"})
    with pytest.raises(ValueError, match="prefix_cache_scope"):
        Settings(prefix_cache_scope="everyone")
    with pytest.raises(ValueError, match="max_items_per_call"):
        Settings(max_items_per_call=0)
