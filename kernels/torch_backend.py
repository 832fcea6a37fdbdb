"""The torch implementation of ``KVBackend``: the CUDA kernels' algorithm, vectorised.

``paged_attention`` runs the same online softmax as the CUDA kernel, but over all
sequences, KV heads and splits at once: each step gathers a chunk of logical blocks of
every sequence through its block table, scores every query of the chunk in fp32, masks
what a query may not see, and folds the chunk into a running max, sum and accumulator
(fp32). With ``num_splits > 1`` each sequence's blocks are cut into that many parts,
each part keeps its own partials, and a final reduce combines them, as the split-K
kernel does.

Decode (one query per sequence, no split) takes a shorter path when its blocks fit one
tile: the blocks are gathered once in the cache's layout and scored block by block, and
the softmax runs over every block at once (``_decode``); it is what a serving step runs.

Unwritten slots are never read into the result: masked scores are *selected* to -inf
(``torch.where``, so a NaN in K cannot leak through an addition) and V rows past a
sequence's length are selected to zero before the multiply (NaN * 0 is NaN).
"""

from __future__ import annotations

import torch

from kernels import checks

#: Upper bound, in elements, on the per-step score and K/V tiles; sets the chunk size.
_TILE_ELEMENTS = 1 << 20
#: Upper bound, in elements, on the K (and V) blocks the decode path gathers at once.
_DECODE_TILE_ELEMENTS = 1 << 22


class TorchBackend:
    """``KVBackend`` on any torch device, in plain tensor operations."""

    name = "torch"

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Writes new K/V into their slots; slots < 0 are skipped.

        Args:
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype.
            k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``,
                contiguous; written in place.
            slot_mapping: int64 ``[num_tokens]``, ``block_id * block_size + offset``.

        Raises:
            ValueError: on a dtype, shape, device or contiguity mismatch.
        """
        checks.check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        block_size = k_cache.shape[2]
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        if slots.numel() == 0:
            return
        blocks, offsets = slots // block_size, slots % block_size
        # cache[blocks[n], :, offsets[n], :] = key[n]: advanced indices on dims 0 and 2.
        k_cache[blocks, :, offsets] = key[valid]
        v_cache[blocks, :, offsets] = value[valid]

    def copy_blocks(self, k_caches: torch.Tensor, v_caches: torch.Tensor,
                    block_mapping: torch.Tensor) -> None:
        """Copies block ``src`` onto block ``dst`` in every layer.

        Args:
            k_caches, v_caches: ``[num_layers, num_blocks, num_kv_heads, block_size,
                head_dim]``; written in place.
            block_mapping: int64 ``[num_pairs, 2]`` of ``(src, dst)``; destinations
                distinct and never a source of the same call.

        Raises:
            ValueError: on a dtype, shape, device or contiguity mismatch.
        """
        checks.check_copy_blocks(k_caches, v_caches, block_mapping)
        if block_mapping.shape[0] == 0:
            return
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        k_caches[:, dst] = k_caches[:, src]
        v_caches[:, dst] = v_caches[:, src]

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, *,
                        num_splits: int | None = None) -> torch.Tensor:
        """Causal attention of packed queries over paged K/V (online softmax, fp32).

        Args:
            query: ``[num_query_tokens, num_heads, head_dim]``, the cache's dtype.
            k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
            block_tables: int32 ``[num_seqs, max_num_blocks]``; entries past a sequence's
                last block are ignored.
            context_lens: int32 ``[num_seqs]``.
            query_start_loc: int32 ``[num_seqs + 1]``.
            scale: the softmax scale.
            num_splits: parts per sequence context, each with fp32 partials, then a
                reduce; None chooses (1 here), 1 disables splitting.

        Returns:
            ``[num_query_tokens, num_heads, head_dim]`` in the query's dtype.

        Raises:
            ValueError: on a dtype, shape, device or contiguity mismatch.
        """
        checks.check_paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                                     query_start_loc, num_splits)
        splits = 1 if num_splits is None else num_splits
        num_tokens = query.shape[0]
        num_seqs, max_num_blocks = block_tables.shape
        if num_tokens == 0 or num_seqs == 0 or max_num_blocks == 0 or k_cache.shape[0] == 0:
            return query.new_zeros(query.shape)
        starts = query_start_loc.to(torch.long)
        q_lens = starts[1:] - starts[:-1]                                   # [S]
        ctx = context_lens.to(torch.long)                                   # [S]

        # Queries are padded to the longest of a batch; bucketing sequences by
        # ceil(log2(q_len)) keeps one long prefill from padding every decode to its length.
        buckets: dict[int, list[int]] = {}
        for i, n in enumerate(q_lens.tolist()):
            if n > 0:
                buckets.setdefault((n - 1).bit_length(), []).append(i)
        out = None
        for bucket, seqs in buckets.items():
            if len(seqs) == num_seqs:
                tables, seq_ctx, seq_starts, seq_lens = block_tables, ctx, starts[:-1], q_lens
            else:
                idx = torch.tensor(seqs, dtype=torch.long, device=query.device)
                tables, seq_ctx, seq_starts, seq_lens = block_tables[idx], ctx[idx], starts[idx], q_lens[idx]
            if bucket == 0 and splits == 1 and self._decode_fits(k_cache, len(seqs), seq_ctx):
                rows, tokens = self._decode(query[seq_starts], k_cache, v_cache, tables, seq_ctx, scale), seq_starts
            else:
                rows, tokens = self._attend(query, k_cache, v_cache, tables, seq_ctx, seq_starts, seq_lens,
                                            scale, splits)
            if len(seqs) == num_seqs and tokens.shape[0] == num_tokens:
                return rows.to(query.dtype)          # every token, in order
            if out is None:
                out = query.new_zeros(query.shape)
            out[tokens] = rows.to(query.dtype)
        return out if out is not None else query.new_zeros(query.shape)

    @staticmethod
    def _decode_fits(k_cache: torch.Tensor, num_seqs: int, ctx: torch.Tensor) -> bool:
        """Whether one query per sequence over whole contexts fits the decode path's tiles."""
        block_elements = k_cache[0].numel()
        max_blocks = (int(ctx.max()) + k_cache.shape[2] - 1) // k_cache.shape[2]
        return num_seqs * max_blocks * block_elements <= _DECODE_TILE_ELEMENTS

    @staticmethod
    def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                ctx: torch.Tensor, scale: float) -> torch.Tensor:
        """One query per sequence (decode) over its whole context, in one pass.

        The blocks are gathered once in the cache's own layout and scored block by block
        (a batched product per sequence, block and KV head), so nothing is transposed or
        copied twice; the softmax runs over all blocks at once. Slots past a sequence's
        length are selected out of the scores, and their V rows are zeroed before the
        product (few rows: the last block's tail and table padding).

        Args:
            query: ``[S, num_heads, head_dim]``, the last token of each sequence.
            k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
            block_tables: int32 ``[S, max_num_blocks]``.
            ctx: int64 ``[S]``, each sequence's context length (>= 1).
            scale: the softmax scale.

        Returns:
            fp32 ``[S, num_heads, head_dim]``.
        """
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads, block_size = k_cache.shape[1:3]
        group = num_heads // num_kv_heads
        device = query.device
        width = int((ctx.max() + block_size - 1) // block_size)
        logical = torch.arange(width, device=device)
        seq_blocks = (ctx + block_size - 1) // block_size
        # Padding entries (any value) become block 0; their slots are masked below.
        ids = torch.where(logical[None, :] < seq_blocks[:, None], block_tables[:, :width].to(torch.long), 0)
        batch = num_seqs * width * num_kv_heads
        k = k_cache.index_select(0, ids.view(-1)).to(torch.float32)             # [S * W, H_kv, B, D]
        v = v_cache.index_select(0, ids.view(-1)).to(torch.float32)
        valid = (logical[:, None] * block_size + torch.arange(block_size, device=device)) < ctx[:, None, None]
        unwritten = (~valid).nonzero(as_tuple=True)                            # (seq, block, slot)
        v.view(num_seqs, width, num_kv_heads, block_size, head_dim)[unwritten[0], unwritten[1], :, unwritten[2]] = 0.0
        q = (query.to(torch.float32) * scale).view(num_seqs, 1, num_kv_heads, group, head_dim)
        q = q.expand(num_seqs, width, num_kv_heads, group, head_dim).reshape(batch, group, head_dim)
        scores = torch.bmm(q, k.view(batch, block_size, head_dim).transpose(1, 2))
        scores = scores.view(num_seqs, width, num_kv_heads, group, block_size)
        scores = torch.where(valid[:, :, None, None, :], scores, float("-inf"))
        p = torch.exp(scores - scores.amax(dim=(1, 4), keepdim=True))          # every row sees key 0
        total = p.sum(dim=(1, 4))                                               # [S, H_kv, G]
        out = torch.bmm(p.view(batch, group, block_size), v.view(batch, block_size, head_dim))
        out = out.view(num_seqs, width, num_kv_heads, group, head_dim).sum(dim=1) / total[..., None]
        return out.view(num_seqs, num_heads, head_dim)

    def _attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, ctx: torch.Tensor, starts: torch.Tensor,
                q_lens: torch.Tensor, scale: float, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Online-softmax attention of some sequences, their queries padded to the longest.

        Args:
            query: ``[num_query_tokens, num_heads, head_dim]``, all packed queries.
            k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
            block_tables: int32 ``[S, max_num_blocks]`` of these ``S`` sequences.
            ctx, starts, q_lens: int64 ``[S]``: context length, first query token and
                number of queries of each sequence (``q_lens >= 1``).
            scale: the softmax scale.
            splits: parts per sequence context.

        Returns:
            ``(rows, tokens)``: fp32 ``[n, num_heads, head_dim]`` outputs of the ``n``
            query tokens of these sequences, and int64 ``[n]`` their token indices.
        """
        num_heads, head_dim = query.shape[1:]
        num_kv_heads, block_size = k_cache.shape[1:3]
        num_seqs, max_num_blocks = block_tables.shape
        group = num_heads // num_kv_heads
        device = query.device
        max_q = int(q_lens.max())

        # Packed queries -> [S, 1, H_kv, max_q * G, D] in fp32, row m = j * G + g.
        j = torch.arange(max_q, device=device)
        q_valid = j[None, :] < q_lens[:, None]                              # [S, max_q]
        q_index = torch.where(q_valid, starts[:, None] + j, 0)
        q = query[q_index].to(torch.float32)                                # [S, max_q, H, D]
        rows = max_q * group
        q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        q = (q * scale).reshape(num_seqs, 1, num_kv_heads, rows, head_dim)
        # Last key position each query sees: its own position, never past the context.
        q_last = torch.minimum(ctx[:, None] - q_lens[:, None] + j, ctx[:, None] - 1)  # [S, max_q]

        # Each sequence's blocks split into `splits` parts of `part` blocks each.
        seq_blocks = torch.clamp((ctx + block_size - 1) // block_size, max=max_num_blocks)
        part = (seq_blocks + splits - 1) // splits                          # [S]
        part_start = part[:, None] * torch.arange(splits, device=device)    # [S, P]
        part_end = torch.minimum(part_start + part[:, None], seq_blocks[:, None])
        max_part = int(part.max())
        per_block = splits * num_kv_heads * block_size * max(rows, head_dim)
        chunk = max(1, min(max_part, _TILE_ELEMENTS // max(1, num_seqs * per_block)))

        # Running partials per (sequence, split, KV head, row).
        state = (num_seqs, splits, num_kv_heads, rows)
        m_run = torch.full(state, float("-inf"), device=device)
        l_run = torch.zeros(state, device=device)
        acc = torch.zeros(state + (head_dim,), device=device)
        offsets = torch.arange(chunk, device=device)
        in_block = torch.arange(block_size, device=device)
        keys = chunk * block_size
        tile = (num_seqs, splits, num_kv_heads, keys, head_dim)

        for step in range(0, max_part, chunk):
            logical = part_start[:, :, None] + step + offsets                # [S, P, C]
            blk_valid = logical < part_end[:, :, None]
            logical = torch.where(blk_valid, logical, 0)
            ids = block_tables.gather(1, logical.view(num_seqs, -1)).to(torch.long)
            # Padding entries (any value) become block 0; their keys are masked below.
            ids = torch.where(blk_valid.view(num_seqs, -1), ids, 0)
            # Key positions and which of them hold a token: [S, P, C * B].
            pos = (logical[..., None] * block_size + in_block).view(num_seqs, splits, keys)
            k_valid = blk_valid[..., None].expand(-1, -1, -1, block_size).reshape(num_seqs, splits, keys)
            k_valid = k_valid & (pos < ctx[:, None, None])
            k = self._gather(k_cache, ids, tile)                             # [S, P, H_kv, T, D]
            v = self._gather(v_cache, ids, tile)
            v.masked_fill_(~k_valid[:, :, None, :, None], 0.0)

            scores = torch.matmul(q, k.transpose(-1, -2))                    # [S, P, H_kv, rows, T]
            # visible[s, p, j, t]: key t is written and not after query j.
            visible = k_valid[:, :, None, :] & (pos[:, :, None, :] <= q_last[:, None, :, None])
            scores = scores.view(num_seqs, splits, num_kv_heads, max_q, group, keys)
            scores = torch.where(visible[:, :, None, :, None, :], scores, float("-inf"))
            scores = scores.view(num_seqs, splits, num_kv_heads, rows, keys)

            m_new = torch.maximum(m_run, scores.amax(dim=-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp(m_run - m_safe)                                # 0 where m_run = -inf
            p = torch.exp(scores - m_safe[..., None])                        # 0 where masked
            l_run = l_run * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.matmul(p, v)
            m_run = m_new

        out = self._reduce(m_run, l_run, acc)                                # [S, H_kv, rows, D]
        out = out.view(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
        out = out.reshape(num_seqs, max_q, num_heads, head_dim)[q_valid]   # [n, H, D]
        return out, q_index[q_valid]

    @staticmethod
    def _gather(cache: torch.Tensor, ids: torch.Tensor, tile: tuple[int, ...]) -> torch.Tensor:
        """Reads blocks through their ids as fp32 key/value rows.

        Args:
            cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
            ids: int64 ``[num_seqs, splits * chunk]``, valid block ids.
            tile: ``(num_seqs, splits, num_kv_heads, chunk * block_size, head_dim)``.

        Returns:
            fp32 ``tile``, a fresh tensor (the caller may write it).
        """
        num_seqs, splits, num_kv_heads, keys, head_dim = tile
        chunk = ids.shape[1] // splits
        tiles = cache.index_select(0, ids.view(-1))                          # [n, H_kv, B, D]
        # [S * P, C, H_kv, B * D] -> [S * P, H_kv, C, B * D]: rows of one head contiguous.
        tiles = tiles.view(num_seqs * splits, chunk, num_kv_heads, -1).transpose(1, 2)
        out = torch.empty((num_seqs * splits, num_kv_heads, chunk, tiles.shape[-1]),
                          dtype=torch.float32, device=cache.device)
        out.copy_(tiles)
        return out.view(tile)

    @staticmethod
    def _reduce(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """Combines the partials of the splits into normalised outputs.

        Args:
            m, l: fp32 ``[num_seqs, splits, num_kv_heads, rows]``: each split's max score
                and sum of ``exp(score - m)`` (``-inf`` / 0 for a split that saw no key).
            acc: fp32 ``[num_seqs, splits, num_kv_heads, rows, head_dim]``: each split's
                sum of ``exp(score - m) * v``.

        Returns:
            fp32 ``[num_seqs, num_kv_heads, rows, head_dim]``; zero for a row that saw
            no key at all (padding rows only).
        """
        m_all = m.amax(dim=1, keepdim=True)
        m_all = torch.where(m_all == float("-inf"), 0.0, m_all)
        weight = torch.exp(m - m_all)                                        # [S, P, H_kv, rows]
        total = (weight * l).sum(dim=1)
        summed = (weight[..., None] * acc).sum(dim=1)
        safe = torch.where(total > 0, total, 1.0)
        return torch.where((total > 0)[..., None], summed / safe[..., None], 0.0)
