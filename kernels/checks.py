"""Argument checks shared by the backends: dtype, shape, device, contiguity.

They look at metadata only (no device synchronisation); values such as block ids and
slots are the caller's to check (the worker does, against its pool). Each raises
``ValueError`` naming the argument and what was expected.
"""

from __future__ import annotations

import torch

from kernels.backend import DTYPES


def _fail(msg: str) -> None:
    raise ValueError(msg)


def check_cache(name: str, cache: torch.Tensor, ndim: int = 4) -> None:
    if not isinstance(cache, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in DTYPES:
        _fail(f"{name}: dtype {cache.dtype} is not one of {', '.join(map(str, DTYPES))}")
    if cache.dim() != ndim:
        _fail(f"{name}: expected {ndim} dimensions, got shape {tuple(cache.shape)}")
    if not cache.is_contiguous():
        _fail(f"{name} must be contiguous")


def check_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, ndim: int = 4) -> None:
    check_cache("k_cache", k_cache, ndim)
    check_cache("v_cache", v_cache, ndim)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        _fail(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} "
              f"{v_cache.dtype} differ")


def check_index(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
                device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        _fail(f"{name}: dtype must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        _fail(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, the cache on {device}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous")


def check_tokens(name: str, t: torch.Tensor, num_heads: int | None, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
    """``[num_tokens, num_heads, head_dim]`` in the cache's dtype and device."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3 or t.shape[2] != head_dim or (num_heads is not None and t.shape[1] != num_heads):
        want = f"[num_tokens, {num_heads if num_heads is not None else 'num_heads'}, {head_dim}]"
        _fail(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        _fail(f"{name}: dtype must be the cache's {dtype}, got {t.dtype}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, the cache on {device}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous")


def check_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    check_pair(k_cache, v_cache)
    _, num_kv_heads, _, head_dim = k_cache.shape
    check_tokens("key", key, num_kv_heads, head_dim, k_cache.dtype, k_cache.device)
    check_tokens("value", value, num_kv_heads, head_dim, k_cache.dtype, k_cache.device)
    if key.shape != value.shape:
        _fail(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    check_index("slot_mapping", slot_mapping, torch.int64, (key.shape[0],), k_cache.device)


def check_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, num_splits: int | None) -> None:
    check_pair(k_cache, v_cache)
    _, num_kv_heads, _, head_dim = k_cache.shape
    check_tokens("query", query, None, head_dim, k_cache.dtype, k_cache.device)
    if query.shape[1] % num_kv_heads != 0 or query.shape[1] == 0:
        _fail(f"query: {query.shape[1]} heads is not a multiple of the cache's {num_kv_heads} KV heads")
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        shape = tuple(block_tables.shape) if isinstance(block_tables, torch.Tensor) else type(block_tables).__name__
        _fail(f"block_tables: expected [num_seqs, max_num_blocks], got {shape}")
    num_seqs = block_tables.shape[0]
    check_index("block_tables", block_tables, torch.int32, tuple(block_tables.shape), k_cache.device)
    check_index("context_lens", context_lens, torch.int32, (num_seqs,), k_cache.device)
    check_index("query_start_loc", query_start_loc, torch.int32, (num_seqs + 1,), k_cache.device)
    if num_splits is not None and not (isinstance(num_splits, int) and num_splits >= 1):
        _fail(f"num_splits must be None or an int >= 1, got {num_splits!r}")


def check_copy_blocks(k_caches: torch.Tensor, v_caches: torch.Tensor, block_mapping: torch.Tensor) -> None:
    check_pair(k_caches, v_caches, ndim=5)
    if not isinstance(block_mapping, torch.Tensor) or block_mapping.dim() != 2 or block_mapping.shape[1:] != (2,):
        shape = tuple(block_mapping.shape) if isinstance(block_mapping, torch.Tensor) else type(block_mapping).__name__
        _fail(f"block_mapping: expected int64 [num_pairs, 2], got {shape}")
    check_index("block_mapping", block_mapping, torch.int64, tuple(block_mapping.shape), k_caches.device)
