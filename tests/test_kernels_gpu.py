"""The CUDA kernels on a GPU, against the float64 reference and the torch backend.

Skipped as a whole where torch sees no CUDA device or CuPy cannot run on it.
Every case scatters blocks, poisons unwritten slots (NaN, then inf) and block-table
padding, and poisons the allocator before each launch so that an output element the
kernel leaves unwritten shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch (the CUDA kernel tests need a GPU)"
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        cupy.arange(4).sum().item()
    except Exception as exc:
        return f"CuPy cannot run on this machine ({type(exc).__name__}: {exc})"
    return None


_REASON = _cuda_skip_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

from kernel_cases import assert_close_to_reference, expected_cache_write, make_case  # noqa: E402

from kernels.cuda_backend import CudaBackend  # noqa: E402
from kernels.reference import reference_attention  # noqa: E402
from kernels.torch_backend import TorchBackend  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
CUDA = CudaBackend()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)
GROUPS = (1, 4, 8)


def _poison_allocator(nbytes: int) -> None:
    """Fills memory the caching allocator will hand out next with NaN (fp32 and 16-bit)."""
    for _ in range(2):
        junk = torch.empty(max(nbytes, 1 << 20) // 2 + 64, dtype=torch.int16, device=DEV)
        junk.fill_(-1)  # 0xffff: NaN in fp16 and bf16, 0xffffffff: NaN in fp32
        del junk


def _run(case, **kw):
    _poison_allocator(case.query.numel() * 4 * 70)
    out = CUDA.paged_attention(*case.args(), **kw)
    torch.cuda.synchronize()
    return out


def _check(case, **kw):
    ref = reference_attention(*case.args())
    out = _run(case, **kw)
    assert_close_to_reference(out, ref, case.dtype)
    return out, ref


def _decode_lens(bs: int) -> list[int]:
    return [1, bs - 1, bs, bs + 1, 3 * bs + 5, 700]


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_and_prefill_match_reference(dtype, head_dim, block_size, group):
    seed = DTYPES.index(dtype) + 3 * head_dim + 7 * block_size + 131 * group
    lens = _decode_lens(block_size)
    decode = make_case(dtype=dtype, head_dim=head_dim, block_size=block_size, num_kv_heads=2,
                       group=group, context_lens=lens, query_lens=[1] * len(lens), device=DEV,
                       seed=seed)
    _check(decode)
    # Prefill and chunked prefill: whole prompts, chunks ending mid-block, a decode row
    # and an empty query run in one batch.
    ctx = [block_size * 2 + 3, 37, 300, 5, 64]
    q = [block_size * 2 + 3, 11, 64, 1, 0]
    prefill = make_case(dtype=dtype, head_dim=head_dim, block_size=block_size, num_kv_heads=2,
                        group=group, context_lens=ctx, query_lens=q, device=DEV, seed=seed + 1)
    _check(prefill)


@pytest.mark.parametrize("dtype,head_dim,block_size,group", [
    (torch.bfloat16, 128, 16, 8), (torch.float16, 64, 128, 1), (torch.float32, 256, 8, 4),
    (torch.bfloat16, 256, 32, 4), (torch.float16, 128, 64, 8)], ids=str)
def test_long_contexts(dtype, head_dim, block_size, group):
    lens = [4096, 4097, 5000, 4096 + block_size - 1]
    case = make_case(dtype=dtype, head_dim=head_dim, block_size=block_size, num_kv_heads=2,
                     group=group, context_lens=lens, query_lens=[1, 1, 1, 1], device=DEV)
    _check(case)                 # the heuristic's choice
    _check(case, num_splits=1)   # one CTA over the whole context
    chunk = make_case(dtype=dtype, head_dim=head_dim, block_size=block_size, num_kv_heads=2,
                      group=group, context_lens=[4100, 4096], query_lens=[33, 17], device=DEV,
                      seed=3)
    _check(chunk)
    _check(chunk, num_splits=5)


@pytest.mark.parametrize("group", [2, 3, 6, 16])
def test_other_groups(group):
    case = make_case(dtype=torch.bfloat16, head_dim=128, block_size=16, num_kv_heads=2,
                     group=group, context_lens=[1, 17, 300, 2000], query_lens=[1, 1, 1, 1],
                     device=DEV, seed=group)
    _check(case)
    prefill = make_case(dtype=torch.bfloat16, head_dim=128, block_size=16, num_kv_heads=2,
                        group=group, context_lens=[40, 300], query_lens=[40, 9], device=DEV,
                        seed=group + 1)
    _check(prefill)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf"), 6e4])
def test_unwritten_slots_never_reach_the_result(poison):
    case = make_case(dtype=torch.float16, head_dim=64, block_size=32, num_kv_heads=2, group=4,
                     context_lens=[1, 33, 95, 1000], query_lens=[1, 5, 1, 30], device=DEV)
    case.repoison(poison)
    _check(case)
    _check(case, num_splits=8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_matches_no_split(dtype):
    case = make_case(dtype=dtype, head_dim=128, block_size=16, num_kv_heads=4, group=4,
                     context_lens=[3000, 17, 1, 2048], query_lens=[1, 1, 1, 3], device=DEV)
    whole, ref = _check(case, num_splits=1)
    for splits in (2, 7, 64, 300):  # more splits than blocks leaves some empty
        part, _ = _check(case, num_splits=splits)
        atol, rtol = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
                      torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]
        torch.testing.assert_close(part.float(), whole.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_agrees_with_torch_backend(dtype):
    case = make_case(dtype=dtype, head_dim=128, block_size=32, num_kv_heads=2, group=8,
                     context_lens=[5, 900, 64, 2500], query_lens=[5, 1, 20, 1], device=DEV)
    ref = reference_attention(*case.args())
    ours = _run(case)
    theirs = TorchBackend().paged_attention(*case.args())
    assert_close_to_reference(ours, ref, dtype)
    assert_close_to_reference(theirs, ref, dtype)
    atol, rtol = {torch.float32: (4e-5, 4e-5), torch.float16: (2e-3, 4e-3),
                  torch.bfloat16: (1.6e-2, 3.2e-2)}[dtype]
    torch.testing.assert_close(ours.float(), theirs.float(), atol=atol, rtol=rtol)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.view(view), b.view(view))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("misaligned", [False, True])
def test_reshape_and_cache_is_exact(dtype, misaligned):
    gen = torch.Generator().manual_seed(1)
    num_blocks, heads, bs, d = 9, 3, 16, 64
    k_cache = torch.randn((num_blocks, heads, bs, d), generator=gen).to(dtype).to(DEV)
    v_cache = torch.randn((num_blocks, heads, bs, d), generator=gen).to(dtype).to(DEV)
    n = 40
    slots = torch.randperm(num_blocks * bs, generator=gen)[:n]
    slots[::7] = -1  # padding
    slot_mapping = slots.to(DEV)
    shift = 1 if misaligned else 0  # 2- or 4-byte aligned rows: the narrow copy units
    kbuf = torch.randn((n * heads * d + shift,), generator=gen).to(dtype).to(DEV)
    vbuf = torch.randn((n * heads * d + shift,), generator=gen).to(dtype).to(DEV)
    key = kbuf[shift:].view(n, heads, d)
    value = vbuf[shift:].view(n, heads, d)
    want_k, want_v = expected_cache_write(k_cache, v_cache, key, value, slots)
    CUDA.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    torch.cuda.synchronize()
    assert _same_bits(k_cache, want_k) and _same_bits(v_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_is_exact(dtype):
    gen = torch.Generator().manual_seed(2)
    shape = (3, 12, 2, 32, 128)  # layers, blocks, heads, block size, head dim
    k = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    v = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    pairs = torch.tensor([[0, 5], [3, 11], [0, 7], [9, 1]], dtype=torch.int64)
    want_k, want_v = k.clone(), v.clone()
    for src, dst in pairs.tolist():
        want_k[:, dst] = k[:, src]
        want_v[:, dst] = v[:, src]
    CUDA.copy_blocks(k, v, pairs.to(DEV))
    torch.cuda.synchronize()
    assert _same_bits(k, want_k) and _same_bits(v, want_v)


def test_bad_arguments_raise_value_error():
    case = make_case(dtype=torch.float16, head_dim=64, block_size=16, num_kv_heads=2, group=1,
                     context_lens=[5], query_lens=[1], device=DEV)
    with pytest.raises(ValueError, match="block_tables"):
        CUDA.paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables.long(),
                             case.context_lens, case.query_start_loc, case.scale)
    cpu = make_case(dtype=torch.float16, head_dim=64, block_size=16, num_kv_heads=2, group=1,
                    context_lens=[5], query_lens=[1])
    with pytest.raises(ValueError):
        CUDA.paged_attention(*cpu.args())


def test_kernels_run_on_the_callers_stream():
    """On a non-default stream that is still busy (a GPU sleep, then the query's copy), the
    kernels wait for it: launched on any other stream they would read the NaN query."""
    case = make_case(dtype=torch.bfloat16, head_dim=128, block_size=16, num_kv_heads=2, group=4,
                     context_lens=[1, 40, 700], query_lens=[1, 1, 1], device=DEV, seed=11)
    ref = reference_attention(*case.args())
    query = torch.full_like(case.query, float("nan"))
    slots = torch.tensor([0, 1], device=DEV)          # (made here: a host copy would wait for the stream)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)               # ~50 ms: the query is not there yet
        query.copy_(case.query)
        out = CUDA.paged_attention(query, *case.args()[1:])
        # reshape_and_cache and copy_blocks on the same busy stream
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        key = torch.full((2, 2, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
        value = torch.full_like(key, float("nan"))
        torch.cuda._sleep(100_000_000)
        key.fill_(1.5)
        value.fill_(-2.0)
        CUDA.reshape_and_cache(key, value, k_cache, v_cache, slots)
    stream.synchronize()
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert torch.all(k_cache[0, :, :2] == 1.5) and torch.all(v_cache[0, :, :2] == -2.0)


def test_a_cache_past_two_to_the_31_elements_is_addressed_in_64_bits():
    """K and V of 2^31 + elements each (bf16, ~4.3 GiB): sequences whose blocks lie past
    element 2^31, attended and written there, equal the same case in a small cache."""
    small = make_case(dtype=torch.bfloat16, head_dim=128, block_size=16, num_kv_heads=8, group=4,
                      context_lens=[33, 700, 1], query_lens=[1, 1, 1], device=DEV, seed=12)
    ref = reference_attention(*small.args())
    per_block = 8 * 16 * 128
    offset = (1 << 31) // per_block + 7                  # every block used lies past element 2^31
    num_small = small.k_cache.shape[0]
    shape = (offset + num_small, 8, 16, 128)
    k_big = torch.empty(shape, dtype=torch.bfloat16, device=DEV)
    v_big = torch.empty(shape, dtype=torch.bfloat16, device=DEV)
    assert k_big.numel() > (1 << 31)
    k_big[offset:] = small.k_cache
    v_big[offset:] = small.v_cache
    tables = small.block_tables + offset
    out = CUDA.paged_attention(small.query, k_big, v_big, tables, small.context_lens, small.query_start_loc,
                               small.scale)
    torch.cuda.synchronize()
    assert_close_to_reference(out, ref, torch.bfloat16)
    key = torch.randn((3, 8, 128), dtype=torch.bfloat16, device=DEV)
    value = torch.randn_like(key)
    slots = torch.tensor([(offset + num_small - 1) * 16 + 15, offset * 16, -1], device=DEV)
    CUDA.reshape_and_cache(key, value, k_big, v_big, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_big[-1, :, 15], key[0]) and torch.equal(v_big[offset, :, 0], value[1])
    del k_big, v_big
    torch.cuda.empty_cache()


@pytest.mark.parametrize("group", [1, 8])
def test_small_grid_for_the_sanitizer(group):
    """A few small launches of every kernel (``scripts/gpu_check.sh`` runs this test under
    compute-sanitizer's memcheck and racecheck)."""
    case = make_case(dtype=torch.float16, head_dim=64, block_size=16, num_kv_heads=2, group=group,
                     context_lens=[1, 17, 64], query_lens=[1, 1, 3], device=DEV, seed=13)
    _check(case)
    _check(case, num_splits=3)
    k, v = case.k_cache.clone(), case.v_cache.clone()
    key = torch.randn((2, 2, 64), dtype=torch.float16, device=DEV)
    CUDA.reshape_and_cache(key, key, k, v, torch.tensor([5, -1], device=DEV))
    CUDA.copy_blocks(k.unsqueeze(0), v.unsqueeze(0), torch.tensor([[0, 1]], device=DEV))
    torch.cuda.synchronize()
    assert torch.equal(k[0, :, 5], key[0])


def test_the_benchmark_measures_one_configuration():
    """``kernels.bench``: events and the profiler agree on a kernel's time, every figure is
    positive, and the FlashInfer column says why it is empty where it is."""
    from kernels import bench

    flush = torch.ones(64 << 20, dtype=torch.uint8, device=DEV)
    r = bench.bench_one(CUDA, batch=8, context=2048, group=4, block_size=16, dtype=torch.bfloat16,
                        num_splits=None, flush=flush, copy_bps=bench.copy_bandwidth(flush))
    assert r["ms"] > 0 and r["GB/s"] > 0 and r["sdpa_ratio"] > 0 and r["maxdiff"] < 0.05
    assert 0.5 < r["prof_ms"] / r["ms"] < 1.5, r
    assert (r["flashinfer_ratio"] is None) == bool(r["flashinfer_note"])


def test_lower_tier_orders_on_a_cuda_pool_with_a_pinned_host_tier(tmp_path):
    """The CUDA path of worker/tiers.py: copies on a side stream after the queued work, a
    pinned host tier, a disk tier; blocks come back bit for bit, a wrong hash writes nothing."""
    from worker.pool import KVPool, PoolShape
    from worker.tiers import DEVICE, DISK, HOST, DiskTier, HostTier, Tiers

    shape = PoolShape(num_blocks=16, block_size=16, num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    pool = KVPool(shape, DEV, CudaBackend())
    pool.k_caches.copy_(torch.randn(pool.k_caches.shape, device=DEV).to(shape.dtype))
    pool.v_caches.copy_(torch.randn(pool.v_caches.shape, device=DEV).to(shape.dtype))
    host = HostTier(shape, 4, pin=True)
    assert host.data.is_pinned()
    tiers = Tiers(pool, host, DiskTier(shape, 4, tmp_path, "gpu-0"))
    h = b"g" * 16
    pool.k_caches[:, 5].mul_(2)           # (queued before the copy down: the copy sees it)
    assert tiers.run([(DEVICE, 5, HOST, 0, h), (HOST, 0, DISK, 1, h), (DISK, 1, DEVICE, 9, h)]) == ["", "", ""]
    assert torch.equal(pool.k_caches[:, 5], pool.k_caches[:, 9]) and torch.equal(pool.v_caches[:, 5],
                                                                                  pool.v_caches[:, 9])
    before = pool.k_caches[:, 10].clone()
    assert "holds another block" in tiers.run([(HOST, 0, DEVICE, 10, b"x" * 16)])[0]
    assert torch.equal(pool.k_caches[:, 10], before)
    tiers.close()
