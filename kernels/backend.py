"""The interface every KV backend implements, and the choice between them.

Layout (DESIGN §6): per layer, K and V are each
``[num_blocks, num_kv_heads, block_size, head_dim]``: one contiguous
``block_size × head_dim`` tile per block and KV head. A worker keeps all layers in one
tensor each, ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``, so that
``copy_blocks`` covers every layer in one launch; ``k_caches[layer]`` is a layer's view.

Sequences of a batch are packed ("varlen"): ``query_start_loc[i]..query_start_loc[i+1]``
are the query tokens of sequence ``i``. With ``q_len_i`` queries and ``context_lens[i]``
tokens in the cache (the queries' own K/V included, written before attention), query
``j`` of sequence ``i`` sits at position ``context_lens[i] - q_len_i + j`` and attends to
positions ``0..`` that position (causal). Decode is ``q_len = 1`` for every sequence.
"""

from __future__ import annotations

from typing import Protocol

import torch

#: Cache dtypes the kernels are built for.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)


def check_cuda_geometry(head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """Raises ``ValueError`` naming the first value of a pool's geometry that the CUDA
    kernels are not built for (a GPU worker checks at start-up, before it registers a pool
    whose every attention call would fail)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not one the CUDA kernels are built for: "
                         f"{', '.join(map(str, HEAD_DIMS))}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} is not one the CUDA kernels are built for: "
                         f"{', '.join(map(str, BLOCK_SIZES))}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} is not one the CUDA kernels are built for: "
                         f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)}")


class KVBackend(Protocol):
    """What a worker needs from its kernels. Every method raises ``ValueError`` naming
    the offending argument on a dtype, shape, device or contiguity mismatch."""

    name: str

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Writes new K/V into their slots.

        Args:
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype.
            k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]`` (one
                layer), contiguous.
            slot_mapping: int64 ``[num_tokens]``, ``slot = block_id * block_size + offset``;
                a slot < 0 is padding and is skipped.
        """
        ...

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, *,
                        num_splits: int | None = None) -> torch.Tensor:
        """Causal attention of packed queries over paged K/V (online softmax).

        Args:
            query: ``[num_query_tokens, num_heads, head_dim]``, the cache's dtype;
                ``num_heads`` is a multiple of ``num_kv_heads`` (GQA group =
                ``num_heads // num_kv_heads``).
            k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]`` (one layer).
            block_tables: int32 ``[num_seqs, max_num_blocks]``; entries past a sequence's
                last block are ignored (any value).
            context_lens: int32 ``[num_seqs]``, each in ``q_len_i..max_num_blocks * block_size``.
            query_start_loc: int32 ``[num_seqs + 1]``, non-decreasing, from 0 to
                ``num_query_tokens``.
            scale: the softmax scale (usually ``head_dim ** -0.5``).
            num_splits: split the context of each sequence into this many parts with fp32
                partials and a reduce step; None lets the backend choose, 1 disables it.

        Returns:
            ``[num_query_tokens, num_heads, head_dim]`` in the query's dtype. Slots past
            a sequence's length are never read into the result (masked scores, and V rows
            never multiplied), whatever they hold, NaN included.
        """
        ...

    def copy_blocks(self, k_caches: torch.Tensor, v_caches: torch.Tensor,
                    block_mapping: torch.Tensor) -> None:
        """Copy-on-write: block ``src`` onto block ``dst`` in every layer, one launch.

        Args:
            k_caches, v_caches: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``.
            block_mapping: int64 ``[num_pairs, 2]`` of ``(src, dst)``; destinations distinct
                and never a source of the same call.
        """
        ...


def cuda_available() -> bool:
    """Whether the CuPy kernels can run here (a CUDA device and an importable CuPy)."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def get_backend(device: torch.device | str = "cpu") -> KVBackend:
    """The CuPy kernels for a CUDA device, the torch implementation otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        if not cuda_available():
            raise RuntimeError("a CUDA device was asked for but CuPy or CUDA is not available")
        from kernels.cuda_backend import CudaBackend
        return CudaBackend()
    from kernels.torch_backend import TorchBackend
    return TorchBackend()
