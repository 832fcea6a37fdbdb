"""A pool's lower tiers on the worker (worker/tiers.py): a block stored into a host or
disk entry comes back bit for bit into another device block; a flipped byte, an entry
never stored or a checksum other than the one stored fails the load and leaves the block
untouched; disk entries outlive their process, unless the geometry changed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from worker.pool import KVPool, PoolShape
from worker.tiers import FILE_HEADER, DiskTier, HostTier, LoadFailed, entries_for_budget

pytestmark = pytest.mark.e2e

SHAPE = PoolShape(num_blocks=16, block_size=8, num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def _pool(shape: PoolShape = SHAPE, seed: int = 0) -> KVPool:
    pool = KVPool(shape, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    pool.k_caches.copy_(torch.randn(pool.k_caches.shape, generator=g).to(shape.dtype))
    pool.v_caches.copy_(torch.randn(pool.v_caches.shape, generator=g).to(shape.dtype))
    return pool


def _same(pool: KVPool, a: int, b: int) -> bool:
    return bool(torch.equal(pool.k_caches[:, a], pool.k_caches[:, b])
                and torch.equal(pool.v_caches[:, a], pool.v_caches[:, b]))


@pytest.fixture(params=["host", "disk"])
def tier(request, tmp_path):
    if request.param == "host":
        yield HostTier(SHAPE, 4)
    else:
        t = DiskTier(SHAPE, 4, tmp_path, "worker-0")
        yield t
        t.close()


def test_a_stored_block_loads_back_bit_for_bit_into_another_block(tier):
    pool = _pool()
    assert not _same(pool, 3, 7)
    crc = tier.store(2, pool, 3)
    tier.load(2, pool, 7, expected=crc)
    assert _same(pool, 3, 7)
    assert (tier.stored_blocks, tier.loaded_blocks, tier.load_failures) == (1, 1, 0)


def test_every_layer_and_both_k_and_v_travel(tier):
    pool = _pool()
    before = pool.k_caches.clone(), pool.v_caches.clone()
    tier.store(0, pool, 5)
    tier.load(0, pool, 9)
    for cache, old in zip((pool.k_caches, pool.v_caches), before):
        assert torch.equal(cache[:, 9], old[:, 5])
        others = [b for b in range(SHAPE.num_blocks) if b != 9]
        assert torch.equal(cache[:, others], old[:, others])      # nothing else written


def test_a_load_with_another_checksum_or_from_an_empty_entry_fails_and_writes_nothing(tier):
    pool = _pool()
    crc = tier.store(1, pool, 4)
    before = pool.k_caches[:, 6].clone()
    with pytest.raises(LoadFailed, match="checksum"):
        tier.load(1, pool, 6, expected=crc ^ 1)
    with pytest.raises(LoadFailed, match="never stored"):
        tier.load(3, pool, 6)
    assert torch.equal(pool.k_caches[:, 6], before) and tier.load_failures == 2


def test_a_flipped_byte_in_a_host_entry_fails_its_load():
    pool = _pool()
    tier = HostTier(SHAPE, 2)
    tier.store(0, pool, 2)
    tier.data[0, 1000] ^= 0x40
    before = pool.v_caches[:, 8].clone()
    with pytest.raises(LoadFailed, match="checksum"):
        tier.load(0, pool, 8)
    assert torch.equal(pool.v_caches[:, 8], before) and tier.load_failures == 1


def test_a_flipped_byte_on_disk_fails_its_load(tmp_path):
    pool = _pool()
    tier = DiskTier(SHAPE, 2, tmp_path, "p")
    tier.store(1, pool, 2)
    offset = FILE_HEADER + tier.stride + 16 + 123      # entry 1, past its header
    with open(tier.path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(LoadFailed, match="checksum"):
        tier.load(1, pool, 8)
    tier.close()


def test_disk_entries_outlive_their_process_unless_the_geometry_changed(tmp_path):
    pool = _pool()
    first = DiskTier(SHAPE, 4, tmp_path, "worker-1")
    assert first.created
    crc = first.store(3, pool, 11)
    first.close()
    again = DiskTier(SHAPE, 4, tmp_path, "worker-1")           # (a restarted worker)
    assert not again.created
    fresh = _pool(seed=1)
    again.load(3, fresh, 0, expected=crc)
    assert torch.equal(fresh.k_caches[:, 0], pool.k_caches[:, 11])
    again.close()
    other = PoolShape(16, 8, 3, 2, 32, torch.float32)
    moved = DiskTier(other, 4, tmp_path, "worker-1")
    assert moved.created and os.path.getsize(moved.path) == FILE_HEADER + 4 * moved.stride
    with pytest.raises(LoadFailed, match="never stored"):
        moved.load(3, KVPool(other, torch.device("cpu")), 0)
    moved.close()


def test_a_disk_tier_its_file_system_cannot_hold_says_so(tmp_path):
    # (a worker process whose files may not grow past 1 MiB: posix_fallocate fails as on a
    # full disk, EFBIG instead of ENOSPC)
    script = (
        "import resource, signal, sys, torch\n"
        "from worker.pool import PoolShape\n"
        "from worker.tiers import DiskTier\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "shape = PoolShape(num_blocks=16, block_size=8, num_layers=3, num_kv_heads=2, head_dim=16,"
        " dtype=torch.float32)\n"
        "try:\n"
        "    DiskTier(shape, 100_000, sys.argv[1], 'worker-0')\n"
        "except OSError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr
    # (100,000 entries of 32 + 6,144 bytes after a 4,096-byte header)
    assert f"the disk tier's file {tmp_path / 'worker-0.kvtier'} needs 0.62 GB" in run.stdout
    assert "GB free" in run.stdout and "give it less (disk_tier_gb)" in run.stdout
    assert os.path.getsize(tmp_path / "worker-0.kvtier") == 0      # (nothing half made is kept)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_blocks_travel_bit_for_bit(dtype, tmp_path):
    shape = PoolShape(8, 4, 2, 1, 8, dtype)
    pool = _pool(shape)
    for tier in (HostTier(shape, 1), DiskTier(shape, 1, tmp_path, "h")):
        tier.store(0, pool, 1)
        tier.load(0, pool, 6)
        assert _same(pool, 1, 6)


def test_bad_entries_blocks_and_geometries_are_refused():
    tier = HostTier(SHAPE, 2)
    pool = _pool()
    with pytest.raises(ValueError, match="entry 2 is out of range 0..1"):
        tier.store(2, pool, 0)
    with pytest.raises(ValueError, match="block 16 is out of range"):
        tier.load(0, pool, 16)
    with pytest.raises(ValueError, match="geometry"):
        tier.store(0, _pool(PoolShape(16, 8, 3, 2, 32, torch.float32)), 0)
    with pytest.raises(ValueError, match="at least one entry"):
        HostTier(SHAPE, 0)
    assert entries_for_budget(10 * SHAPE.bytes_per_block + 1, SHAPE) == 10


def test_the_orders_move_a_block_down_two_tiers_and_back_and_a_wrong_hash_fails(tmp_path):
    from worker.tiers import DEVICE, DISK, HOST, Tiers
    pool = _pool()
    disk = DiskTier(SHAPE, 4, tmp_path, "worker-0")
    tiers = Tiers(pool, HostTier(SHAPE, 2), disk)
    h, other = b"a" * 16, b"b" * 16
    assert tiers.run([(DEVICE, 3, HOST, 1, h), (HOST, 1, DISK, 2, h), (DISK, 2, DEVICE, 9, h)]) == ["", "", ""]
    assert _same(pool, 3, 9)
    before = pool.k_caches[:, 10].clone()
    errors = tiers.run([(DISK, 2, DEVICE, 10, other), (HOST, 0, DEVICE, 10, h), (DEVICE, 1, DEVICE, 2, h),
                        (HOST, 7, DEVICE, 10, h)])
    assert "holds another block" in errors[0] and "never stored" in errors[1] and "copy" in errors[2]
    assert h.hex() not in errors[0] and other.hex() not in errors[0]       # (an entry's hash is never told)
    assert "out of range" in errors[3]
    assert torch.equal(pool.k_caches[:, 10], before)           # (no failed order wrote anything)
    assert tiers.moved == {(DEVICE, HOST): 1, (HOST, DISK): 1, (DISK, DEVICE): 1}
    assert tiers.failed == {(DISK, DEVICE): 1, (HOST, DEVICE): 2, (DEVICE, DEVICE): 1}
    no_disk = Tiers(pool, HostTier(SHAPE, 2))
    assert "no disk tier" in no_disk.run([(DEVICE, 0, DISK, 0, h)])[0]
    tiers.close()
