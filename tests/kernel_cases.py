"""Paged-attention inputs shared by the kernel tests of every backend (CPU and GPU).

``make_case`` builds a batch the way a worker's pool leaves it after a while: blocks
handed out in a shuffled order (scattered block tables), a few spare blocks, every slot
that holds no token (tails of last blocks, unreferenced blocks) poisoned with NaN, and
block-table padding (entries past a sequence's last block) full of garbage ids. A
backend that reads one slot too many, or multiplies a masked V row by zero, returns NaN.

Only torch is imported here, so a test module of any backend can use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: (atol, rtol) against the float64 reference, per dtype. K/V and queries are ~N(0, 1),
#: so every output element is a convex combination of V values, |out| < ~5. The
#: reference reads the same rounded K/V/query values, so only the backend's arithmetic
#: and its final rounding count:
#: - float32: fp32 dot products and fp32 online-softmax rescaling over up to ~4k keys
#:   give errors of order 1e-6; 2e-5 leaves room for another summation order (split-K,
#:   GPU reductions) but catches any masking or indexing error (O(0.1)).
#: - float16: rounding the result costs up to half an ulp, 2**-11 relative (4.9e-4);
#:   a kernel that rounds probabilities to fp16 before P@V adds a random error of the
#:   same order. rtol 2e-3 is four half-ulps; atol 1e-3 covers results near zero.
#: - bfloat16: half an ulp is 2**-8 relative (3.9e-3); rtol 1.6e-2 is four of them,
#:   atol 8e-3 covers results near zero and probabilities rounded to bf16.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2),
}

#: Values written into block-table padding, besides the ids of the (poisoned) spare
#: blocks: negative, and far out of range.
_PAD_GARBAGE = (-1, 2**31 - 1)


@dataclass
class Case:
    """One batch of paged-attention inputs and what it was made from.

    Attributes:
        query: ``[num_query_tokens, num_heads, head_dim]``, ``dtype``.
        k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, ``dtype``;
            NaN in every slot that holds no token.
        block_tables: int32 ``[num_seqs, max_num_blocks]``; garbage past each sequence's
            last block.
        context_lens: int32 ``[num_seqs]``.
        query_start_loc: int32 ``[num_seqs + 1]``.
        scale: ``head_dim ** -0.5``.
        written: bool ``[num_blocks, block_size]``, True where a slot holds a token.
        dtype, head_dim, block_size, num_kv_heads, group: the parameters.
        context_lens_list, query_lens_list: the lengths as Python lists.
    """

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    written: torch.Tensor
    dtype: torch.dtype
    head_dim: int
    block_size: int
    num_kv_heads: int
    group: int
    context_lens_list: list[int]
    query_lens_list: list[int]

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def num_blocks(self) -> int:
        return self.k_cache.shape[0]

    def args(self) -> tuple:
        """The positional arguments of ``paged_attention``, in order."""
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                self.query_start_loc, self.scale)

    def repoison(self, value: float) -> None:
        """Overwrites every unwritten slot of K and V with ``value`` (in place).

        Args:
            value: e.g. ``float("nan")``, ``float("inf")`` or a huge finite number.
        """
        empty = (~self.written).to(self.k_cache.device)[:, None, :, None]
        for cache in (self.k_cache, self.v_cache):
            cache.masked_fill_(empty, value)


def make_case(*, dtype: torch.dtype, head_dim: int, block_size: int, num_kv_heads: int,
              group: int, context_lens: list[int], query_lens: list[int],
              device: torch.device | str = "cpu", seed: int = 0, spare_blocks: int = 3,
              extra_table_columns: int = 1) -> Case:
    """Builds a batch of packed queries over a scattered, NaN-poisoned paged cache.

    Values are drawn on the CPU from a seeded generator, so a case is identical on
    every device.

    Args:
        dtype: cache and query dtype.
        head_dim, block_size, num_kv_heads: the cache geometry.
        group: query heads per KV head (``num_heads = num_kv_heads * group``).
        context_lens: tokens in the cache per sequence (the queries' own included).
        query_lens: queries per sequence, each ``<= `` its context length.
        device: where the tensors end up.
        seed: seeds the block permutation and every value.
        spare_blocks: blocks referenced by no sequence (all poisoned).
        extra_table_columns: padding columns past the longest sequence's last block.

    Returns:
        The ``Case``.
    """
    if len(context_lens) != len(query_lens):
        raise ValueError("context_lens and query_lens differ in length")
    for c, q in zip(context_lens, query_lens):
        if not 0 <= q <= c:
            raise ValueError(f"query length {q} outside 0..{c}")
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    used = sum(blocks_per_seq)
    num_blocks = used + spare_blocks
    max_num_blocks = max(blocks_per_seq, default=0) + extra_table_columns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare_ids = perm[used:]

    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    written = torch.zeros((num_blocks, block_size), dtype=torch.bool)
    block_tables = torch.empty((len(context_lens), max_num_blocks), dtype=torch.int32)
    next_block = 0
    for i, (ctx, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        ids = perm[next_block:next_block + nb]
        next_block += nb
        garbage = list(_PAD_GARBAGE) + spare_ids
        pad = [garbage[(i + j) % len(garbage)] for j in range(max_num_blocks - nb)]
        block_tables[i] = torch.tensor(ids + pad, dtype=torch.int32)
        for b, block_id in enumerate(ids):
            n = min(block_size, ctx - b * block_size)
            vals_k = torch.randn((num_kv_heads, n, head_dim), generator=gen)
            vals_v = torch.randn((num_kv_heads, n, head_dim), generator=gen)
            k_cache[block_id, :, :n] = vals_k.to(dtype)
            v_cache[block_id, :, :n] = vals_v.to(dtype)
            written[block_id, :n] = True

    num_tokens = sum(query_lens)
    query = torch.randn((num_tokens, num_heads, head_dim), generator=gen).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return Case(
        query=query.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=head_dim ** -0.5,
        written=written.to(device),
        dtype=dtype,
        head_dim=head_dim,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        context_lens_list=list(context_lens),
        query_lens_list=list(query_lens),
    )


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Asserts a backend's output matches the float64 reference within ``TOLERANCES``.

    Args:
        out: ``[num_query_tokens, num_heads, head_dim]`` from the backend; must be
            ``dtype``, of ``ref``'s shape and free of NaN/inf.
        ref: float64 ``[num_query_tokens, num_heads, head_dim]`` from
            ``kernels.reference.reference_attention``.
        dtype: the dtype the case was built in (selects the tolerance).
    """
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected {dtype}"
    assert tuple(out.shape) == tuple(ref.shape), f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    bad = ~torch.isfinite(out64)
    assert not bad.any(), f"{int(bad.sum())} non-finite output elements (first at {bad.nonzero()[0].tolist()})"
    atol, rtol = TOLERANCES[dtype]
    err = (out64 - ref64).abs()
    over = err > atol + rtol * ref64.abs()
    if over.any():
        first = over.nonzero()[0].tolist()
        raise AssertionError(
            f"{int(over.sum())}/{over.numel()} elements beyond atol={atol}, rtol={rtol} ({dtype}); "
            f"max abs error {err.max().item():.3g}; first at [token, head, dim]={first}: "
            f"got {out64[tuple(first)].item():.6g}, expected {ref64[tuple(first)].item():.6g}")


def expected_cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``reshape_and_cache`` must leave in the caches, written one token at a time
    (slots < 0 skipped): the reference for the bit-exact tests."""
    block_size = k_cache.shape[2]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // block_size, :, slot % block_size] = key[t]
            want_v[slot // block_size, :, slot % block_size] = value[t]
    return want_k, want_v
