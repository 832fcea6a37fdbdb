"""A plain float64 reference for paged attention, for tests of every backend.

It reads the paged cache the simplest way there is: each sequence's K/V are gathered
into contiguous ``[length, num_kv_heads, head_dim]`` tensors through its block table
(positions ``< context_len`` only, so padding entries and unwritten slots are never
touched), then attention is an ordinary softmax in float64 with the causal rule of
``kernels.backend``. Nothing here is fast; it is meant to be obviously right.
"""

from __future__ import annotations

import torch


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table_row: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers the first ``length`` tokens of one sequence from the paged cache.

    Args:
        k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]`` (one layer).
        block_table_row: ``[max_num_blocks]`` integer block ids of the sequence; only the
            first ``ceil(length / block_size)`` entries are read.
        length: number of tokens to gather (``0 <= length <= max_num_blocks * block_size``).

    Returns:
        ``(k, v)``, each ``[length, num_kv_heads, head_dim]`` in the cache's dtype,
        contiguous.
    """
    block_size = k_cache.shape[2]
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    if length == 0:
        empty = k_cache.new_empty((0, num_kv_heads, head_dim))
        return empty, empty.clone()
    num_blocks = (length + block_size - 1) // block_size
    if num_blocks > block_table_row.shape[0]:
        raise ValueError(f"length {length} needs {num_blocks} blocks, the row has "
                         f"{block_table_row.shape[0]}")
    ids = block_table_row[:num_blocks].to(device=k_cache.device, dtype=torch.long)
    # [n, H_kv, B, D] -> [n, B, H_kv, D] -> [n * B, H_kv, D], then cut the tail.
    k = k_cache.index_select(0, ids).transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    v = v_cache.index_select(0, ids).transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    return k[:length].contiguous(), v[:length].contiguous()


def reference_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of packed queries over paged K/V, in float64.

    Query ``j`` of sequence ``i`` (``q_len_i`` queries) sits at position
    ``context_lens[i] - q_len_i + j`` and attends to positions ``0..`` that position.
    Query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``.

    Args:
        query: ``[num_query_tokens, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_tables: ``[num_seqs, max_num_blocks]`` integer block ids.
        context_lens: ``[num_seqs]`` tokens in the cache per sequence.
        query_start_loc: ``[num_seqs + 1]`` offsets of each sequence's queries.
        scale: softmax scale.

    Returns:
        float64 ``[num_query_tokens, num_heads, head_dim]`` on the query's device.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=torch.float64, device=query.device)
    lens = [int(x) for x in context_lens.tolist()]
    starts = [int(x) for x in query_start_loc.tolist()]
    for i, ctx in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if q_len > ctx:
            raise ValueError(f"sequence {i}: {q_len} queries but only {ctx} cached tokens")
        k, v = gather_kv(k_cache, v_cache, block_tables[i], ctx)
        # Repeat each KV head for its group: [ctx, H_kv, D] -> [H, ctx, D].
        k = k.to(torch.float64).repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.to(torch.float64).repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q0:q1].to(torch.float64).transpose(0, 1)            # [H, q_len, D]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale            # [H, q_len, ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)    # [q_len]
        k_pos = torch.arange(ctx, device=query.device)                 # [ctx]
        visible = k_pos[None, :] <= q_pos[:, None]                     # [q_len, ctx]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.matmul(probs, v).transpose(0, 1)            # [q_len, H, D]
    return out
