"""TorchBackend against the float64 reference, and its copy kernels bit for bit.

The attention grid is a covering design, not the cartesian product: every dtype, head
dim (64/128/256), block size (8..128), GQA group (1/4/8) and query kind (decode, full
prefill, chunked prefill, a sequence without queries) appears, with context lengths on
and off block boundaries from 1 to past 4096, and the hard corners (head dim 256 with
block 128 and group 8, 4097 tokens with block 8). Every case has scattered block
tables, NaN in every unwritten slot and garbage block-table padding (see
``kernel_cases``). Tolerances per dtype: ``kernel_cases.TOLERANCES``
(float32 2e-5/2e-5, float16 1e-3/2e-3, bfloat16 8e-3/1.6e-2, atol/rtol).
"""

from __future__ import annotations


import pytest
import torch

from kernel_cases import TOLERANCES, Case, assert_close_to_reference, expected_cache_write, make_case
from kernels.reference import gather_kv, reference_attention
from kernels.torch_backend import TorchBackend

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (id, dtype, head_dim, block_size, num_kv_heads, group, context_lens, query_lens)
CASES = [
    # Decode: one query per sequence.
    ("decode-f32-d64-b8-g1", F32, 64, 8, 2, 1, [1, 7, 8, 9, 100], [1] * 5),
    ("decode-f16-d128-b16-g4", F16, 128, 16, 2, 4, [16, 17, 1000, 3], [1] * 4),
    ("decode-bf16-d256-b32-g8", BF16, 256, 32, 1, 8, [31, 32, 33, 700], [1] * 4),
    ("decode-f32-d256-b128-g8", F32, 256, 128, 2, 8, [4097, 128, 129, 1], [1] * 4),
    ("decode-f16-d64-b64-g1", F16, 64, 64, 4, 1, [4096, 63, 64, 65], [1] * 4),
    ("decode-bf16-d128-b128-g4", BF16, 128, 128, 2, 4, [4097, 255, 5], [1] * 3),
    ("decode-f16-d256-b8-g4", F16, 256, 8, 1, 4, [4097, 2], [1, 1]),
    # Full prefill: the queries are the whole context.
    ("prefill-f32-d128-b8-g4", F32, 128, 8, 2, 4, [37, 16, 1], [37, 16, 1]),
    ("prefill-f16-d64-b32-g8", F16, 64, 32, 2, 8, [100, 64], [100, 64]),
    ("prefill-bf16-d256-b64-g1", BF16, 256, 64, 1, 1, [129, 65], [129, 65]),
    ("prefill-f32-d64-b128-g8", F32, 64, 128, 1, 8, [300, 128], [300, 128]),
    ("prefill-bf16-d128-b16-g1", BF16, 128, 16, 2, 1, [513], [513]),
    # Chunked prefill (q_len < context_len), mixed with decode and empty sequences.
    ("chunked-f16-d256-b128-g8", F16, 256, 128, 2, 8, [4097, 300], [33, 300]),
    ("chunked-bf16-d64-b8-g4", BF16, 64, 8, 2, 4, [1000, 50, 1, 9], [17, 50, 1, 0]),
    ("chunked-f32-d256-b32-g4", F32, 256, 32, 1, 4, [4100, 200], [100, 1]),
    ("chunked-f16-d256-b64-g1", F16, 256, 64, 2, 1, [257, 1024], [64, 1]),
    ("chunked-f32-d128-b16-g8", F32, 128, 16, 1, 8, [4097], [129]),
]

#: Cases re-run with split-K (decode, long context, chunked prefill, short sequences
#: with fewer blocks than splits).
SPLIT_CASES = ["decode-f32-d64-b8-g1", "decode-bf16-d128-b128-g4", "decode-f16-d256-b8-g4",
               "chunked-bf16-d64-b8-g4", "chunked-f32-d128-b16-g8"]

_BY_ID = {c[0]: c for c in CASES}


def _case(case_id: str, seed: int = 0) -> Case:
    _, dtype, head_dim, block_size, num_kv_heads, group, ctx, q = _BY_ID[case_id]
    return make_case(dtype=dtype, head_dim=head_dim, block_size=block_size,
                     num_kv_heads=num_kv_heads, group=group, context_lens=ctx,
                     query_lens=q, seed=seed)


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    return TorchBackend()


def test_grid_covers_every_axis():
    """The covering design really contains every value of every axis."""
    assert {c[1] for c in CASES} == {F32, F16, BF16}
    assert {c[2] for c in CASES} == {64, 128, 256}
    assert {c[3] for c in CASES} == {8, 16, 32, 64, 128}
    assert {c[5] for c in CASES} == {1, 4, 8}
    lens = [(n, c[3]) for c in CASES for n in c[6]]
    assert any(n % b == 0 for n, b in lens) and any(n % b != 0 for n, b in lens)
    assert max(n for n, _ in lens) > 4096 and min(n for n, _ in lens) == 1


def test_reference_agrees_with_sdpa():
    """The reference itself, against torch's attention on gathered K/V (own mask)."""
    case = make_case(dtype=F32, head_dim=64, block_size=8, num_kv_heads=2, group=4,
                     context_lens=[30, 9, 17], query_lens=[7, 1, 17], seed=5)
    ref = reference_attention(*case.args())
    starts = case.query_start_loc.tolist()
    for i, (n, q_len) in enumerate(zip(case.context_lens_list, case.query_lens_list)):
        k, v = gather_kv(case.k_cache, case.v_cache, case.block_tables[i], n)
        assert not torch.isnan(k).any() and not torch.isnan(v).any()
        q = case.query[starts[i]:starts[i + 1]].double().transpose(0, 1)       # [H, q, D]
        k = k.double().repeat_interleave(case.group, dim=1).transpose(0, 1)    # [H, n, D]
        v = v.double().repeat_interleave(case.group, dim=1).transpose(0, 1)
        mask = torch.ones(q_len, n, dtype=torch.bool).tril(diagonal=n - q_len)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                scale=case.scale)
        torch.testing.assert_close(ref[starts[i]:starts[i + 1]], want.transpose(0, 1))


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_paged_attention_matches_reference(backend, case_id):
    case = _case(case_id)
    ref = reference_attention(*case.args())
    out = backend.paged_attention(*case.args())
    assert_close_to_reference(out, ref, case.dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("case_id", SPLIT_CASES)
def test_split_k_matches_no_split(backend, case_id, num_splits):
    case = _case(case_id, seed=1)
    whole = backend.paged_attention(*case.args(), num_splits=1)
    split = backend.paged_attention(*case.args(), num_splits=num_splits)
    assert_close_to_reference(split, reference_attention(*case.args()), case.dtype)
    atol, rtol = TOLERANCES[case.dtype]
    torch.testing.assert_close(split, whole, atol=atol, rtol=rtol)


@pytest.mark.parametrize("case_id", ["decode-f16-d128-b16-g4", "chunked-bf16-d64-b8-g4",
                                     "prefill-f32-d128-b8-g4"])
def test_unwritten_slots_and_table_padding_are_never_read(backend, case_id):
    """Whatever the poison and the padding ids, the output is bit for bit the same."""
    case = _case(case_id)
    first = backend.paged_attention(*case.args())
    for poison in (float("inf"), float("-inf"), torch.finfo(case.dtype).max, 0.0):
        case.repoison(poison)
        assert torch.equal(backend.paged_attention(*case.args()), first), poison
    used = torch.tensor([-(-n // case.block_size) for n in case.context_lens_list])
    padding = torch.arange(case.block_tables.shape[1])[None, :] >= used[:, None]
    assert padding.any()
    for garbage in (0, case.num_blocks - 1, -(2**31)):
        case.block_tables[padding] = garbage
        assert torch.equal(backend.paged_attention(*case.args()), first), garbage


def test_gqa_heads_read_their_own_kv_head(backend):
    """Zeroing one KV head changes exactly the outputs of its group of query heads."""
    case = make_case(dtype=F32, head_dim=64, block_size=16, num_kv_heads=4, group=2,
                     context_lens=[40, 7], query_lens=[3, 1])
    before = backend.paged_attention(*case.args())
    case.v_cache[:, 2] = torch.where(case.written[:, :, None], 0.0, case.v_cache[:, 2])
    after = backend.paged_attention(*case.args())
    changed = (after != before).any(dim=2).any(dim=0)
    assert changed.tolist() == [False, False, False, False, True, True, False, False]
    assert_close_to_reference(after, reference_attention(*case.args()), F32)


def test_empty_batch(backend):
    case = make_case(dtype=F16, head_dim=64, block_size=8, num_kv_heads=1, group=1,
                     context_lens=[5], query_lens=[0])
    out = backend.paged_attention(*case.args())
    assert out.shape == (0, 1, 64) and out.dtype == F16


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_reshape_and_cache_writes_exactly_its_slots(backend, dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, num_kv_heads, block_size, head_dim = 6, 2, 8, 64
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:20]
    slots[[0, 5, 19]] = torch.tensor([-1, -7, -1])
    key = torch.randn((20, num_kv_heads, head_dim), generator=gen).to(dtype)
    value = torch.randn((20, num_kv_heads, head_dim), generator=gen).to(dtype)
    want_k, want_v = expected_cache_write(k_cache, v_cache, key, value, slots)
    backend.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # All padding, and no tokens at all: nothing changes.
    backend.reshape_and_cache(key[:2], value[:2], k_cache, v_cache, torch.tensor([-1, -1]))
    backend.reshape_and_cache(key[:0], value[:0], k_cache, v_cache, slots[:0])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_cache_written_by_reshape_and_cache_is_attended(backend):
    """The worker's order: write the new tokens' K/V, then attend over them."""
    case = make_case(dtype=BF16, head_dim=128, block_size=16, num_kv_heads=2, group=4,
                     context_lens=[40, 20], query_lens=[8, 20])
    fresh = Case(**{**case.__dict__, "k_cache": torch.full_like(case.k_cache, float("nan")),
                    "v_cache": torch.full_like(case.v_cache, float("nan"))})
    for i, n in enumerate(case.context_lens_list):
        pos = torch.arange(n)
        slots = case.block_tables[i].long()[pos // 16] * 16 + pos % 16
        blocks, offs = slots // 16, slots % 16
        key = case.k_cache[blocks, :, offs].contiguous()
        value = case.v_cache[blocks, :, offs].contiguous()
        backend.reshape_and_cache(key, value, fresh.k_cache, fresh.v_cache, slots)
    out = backend.paged_attention(*fresh.args())
    assert torch.equal(out, backend.paged_attention(*case.args()))
    assert_close_to_reference(out, reference_attention(*case.args()), BF16)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_copy_blocks_copies_every_layer(backend, dtype):
    gen = torch.Generator().manual_seed(4)
    shape = (3, 10, 2, 16, 64)
    k_caches = torch.randn(shape, generator=gen).to(dtype)
    v_caches = torch.randn(shape, generator=gen).to(dtype)
    mapping = torch.tensor([[1, 5], [2, 7], [1, 8], [9, 0]], dtype=torch.int64)
    want_k, want_v = k_caches.clone(), v_caches.clone()
    for src, dst in mapping.tolist():
        want_k[:, dst] = k_caches[:, src]
        want_v[:, dst] = v_caches[:, src]
    backend.copy_blocks(k_caches, v_caches, mapping)
    assert torch.equal(k_caches, want_k) and torch.equal(v_caches, want_v)
    backend.copy_blocks(k_caches, v_caches, mapping[:0])
    assert torch.equal(k_caches, want_k) and torch.equal(v_caches, want_v)


# --- Rejected arguments: each raises ValueError naming the argument. -----------------

def _small() -> Case:
    return make_case(dtype=F16, head_dim=64, block_size=8, num_kv_heads=2, group=2,
                     context_lens=[10, 3], query_lens=[2, 1])


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values and shape, last two dimensions stored transposed."""
    out = torch.empty(t.shape[:-2] + (t.shape[-1], t.shape[-2]), dtype=t.dtype).transpose(-1, -2)
    out.copy_(t)
    assert not out.is_contiguous()
    return out


_ATTENTION_BAD = {
    "query dtype": ("query", lambda a: {**a, "query": a["query"].float()}),
    "query head_dim": ("query", lambda a: {**a, "query": a["query"][:, :, :32].contiguous()}),
    "query heads": ("query", lambda a: {**a, "query": a["query"][:, :3].contiguous()}),
    "query non-contiguous": ("query", lambda a: {**a, "query": _non_contiguous(a["query"])}),
    "k_cache float64": ("k_cache", lambda a: {**a, "k_cache": a["k_cache"].double()}),
    "k_cache 3-d": ("k_cache", lambda a: {**a, "k_cache": a["k_cache"][0]}),
    "k_cache non-contiguous": ("k_cache", lambda a: {**a, "k_cache": _non_contiguous(a["k_cache"])}),
    "v_cache dtype": ("v_cache", lambda a: {**a, "v_cache": a["v_cache"].bfloat16()}),
    "v_cache shape": ("v_cache", lambda a: {**a, "v_cache": a["v_cache"][1:].contiguous()}),
    "block_tables int64": ("block_tables", lambda a: {**a, "block_tables": a["block_tables"].long()}),
    "block_tables 1-d": ("block_tables", lambda a: {**a, "block_tables": a["block_tables"][0]}),
    "block_tables list": ("block_tables", lambda a: {**a, "block_tables": a["block_tables"].tolist()}),
    "block_tables non-contiguous": ("block_tables",
                                    lambda a: {**a, "block_tables": _non_contiguous(a["block_tables"])}),
    "context_lens int64": ("context_lens", lambda a: {**a, "context_lens": a["context_lens"].long()}),
    "context_lens length": ("context_lens", lambda a: {**a, "context_lens": a["context_lens"][:1]}),
    "query_start_loc int64": ("query_start_loc",
                              lambda a: {**a, "query_start_loc": a["query_start_loc"].long()}),
    "query_start_loc length": ("query_start_loc",
                               lambda a: {**a, "query_start_loc": a["query_start_loc"][:2]}),
    "num_splits zero": ("num_splits", lambda a: {**a, "num_splits": 0}),
}


@pytest.mark.parametrize("what", list(_ATTENTION_BAD))
def test_paged_attention_rejects(backend, what):
    name, mutate = _ATTENTION_BAD[what]
    c = _small()
    args = dict(query=c.query, k_cache=c.k_cache, v_cache=c.v_cache, block_tables=c.block_tables,
                context_lens=c.context_lens, query_start_loc=c.query_start_loc, scale=c.scale)
    with pytest.raises(ValueError, match=name):
        backend.paged_attention(**mutate(args))


def _cache_args() -> dict:
    c = _small()
    key = torch.zeros((4, 2, 64), dtype=F16)
    return dict(key=key, value=key.clone(), k_cache=c.k_cache, v_cache=c.v_cache,
                slot_mapping=torch.tensor([0, 1, -1, 9]))


_CACHE_BAD = {
    "key dtype": ("key", lambda a: {**a, "key": a["key"].float()}),
    "key heads": ("key", lambda a: {**a, "key": torch.zeros((4, 1, 64), dtype=F16)}),
    "key non-contiguous": ("key", lambda a: {**a, "key": _non_contiguous(a["key"])}),
    "value head_dim": ("value", lambda a: {**a, "value": torch.zeros((4, 2, 32), dtype=F16)}),
    "k_cache non-contiguous": ("k_cache", lambda a: {**a, "k_cache": _non_contiguous(a["k_cache"])}),
    "slot_mapping int32": ("slot_mapping", lambda a: {**a, "slot_mapping": a["slot_mapping"].int()}),
    "slot_mapping length": ("slot_mapping", lambda a: {**a, "slot_mapping": a["slot_mapping"][:3]}),
}


@pytest.mark.parametrize("what", list(_CACHE_BAD))
def test_reshape_and_cache_rejects(backend, what):
    name, mutate = _CACHE_BAD[what]
    with pytest.raises(ValueError, match=name):
        backend.reshape_and_cache(**mutate(_cache_args()))


def _copy_args() -> dict:
    caches = torch.zeros((2, 4, 2, 8, 64), dtype=BF16)
    return dict(k_caches=caches, v_caches=caches.clone(),
                block_mapping=torch.tensor([[0, 1]], dtype=torch.int64))


_COPY_BAD = {
    "k_caches 4-d": ("k_cache", lambda a: {**a, "k_caches": a["k_caches"][0]}),
    "k_caches int8": ("k_cache", lambda a: {**a, "k_caches": a["k_caches"].to(torch.int8)}),
    "v_caches non-contiguous": ("v_cache", lambda a: {**a, "v_caches": _non_contiguous(a["v_caches"])}),
    "block_mapping int32": ("block_mapping", lambda a: {**a, "block_mapping": a["block_mapping"].int()}),
    "block_mapping shape": ("block_mapping",
                            lambda a: {**a, "block_mapping": torch.zeros((1, 3), dtype=torch.int64)}),
}


@pytest.mark.parametrize("what", list(_COPY_BAD))
def test_copy_blocks_rejects(backend, what):
    name, mutate = _COPY_BAD[what]
    with pytest.raises(ValueError, match=name):
        backend.copy_blocks(**mutate(_copy_args()))
