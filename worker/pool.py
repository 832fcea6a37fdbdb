"""The physical KV pool of one worker, and every check on the values of a request.

K and V are each ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``
(``kernels.backend``: one contiguous ``block_size × head_dim`` tile per block, KV head
and layer). ``num_blocks = floor(budget / bytes_per_block)`` with
``bytes_per_block = 2 · layers · block_size · kv_heads · head_dim · dtype size``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from kernels.backend import KVBackend, get_backend
from kvservice import errors
from kvservice.common.geometry import MAX_NUM_BLOCKS, Geometry
from worker import tensors

log = logging.getLogger(__name__)
MAX_BLOCKS = MAX_NUM_BLOCKS   # the allocator's limit per pool
MAX_SPLITS = 1024


@dataclass(frozen=True, slots=True)
class PoolShape:
    """A pool's geometry, as registered with the allocator."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * size

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def geometry(self) -> Geometry:
        """The geometry as the allocator knows it (``to_pb()`` for the wire)."""
        return Geometry(self.num_blocks, self.block_size, self.num_layers, self.num_kv_heads, self.head_dim,
                        tensors.NAMES[self.dtype])


def check_block_table(shape: PoolShape, table: list[int], ctx: int, context: str, name: str) -> None:
    """InvalidArgument unless ``table`` covers ``ctx`` tokens with block ids of the pool
    (entries past the blocks the context uses are not read, whatever they hold).
    ``context`` and ``name`` say in the message which value was wrong."""
    if ctx > len(table) * shape.block_size:
        raise errors.InvalidArgument(f"{context} is beyond its block table of {len(table)} blocks "
                                     f"({len(table) * shape.block_size} slots)")
    for j in range(math.ceil(ctx / shape.block_size)):
        if not 0 <= table[j] < shape.num_blocks:
            raise errors.InvalidArgument(f"{name}[{j}] = {table[j]} is out of range 0..{shape.num_blocks - 1}")


def blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """How many whole blocks a memory budget holds (at most the allocator's 2^24)."""
    return min(budget_bytes // bytes_per_block, MAX_BLOCKS)


class KVPool:
    """The KV tensors and the operations of the data plane, with their checks.

    Args:
        shape: the geometry (``num_blocks`` included).
        device: where the tensors live.
        backend: the kernels (default: the one for ``device``).
    """

    def __init__(self, shape: PoolShape, device: torch.device, backend: KVBackend | None = None) -> None:
        if not 1 <= shape.num_blocks <= MAX_BLOCKS:
            raise ValueError(f"num_blocks must be in 1..{MAX_BLOCKS}, got {shape.num_blocks}")
        self.shape = shape
        self.device = device
        self.backend = backend or get_backend(device)
        dims = (shape.num_layers, shape.num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim)
        self.k_caches = torch.zeros(dims, dtype=shape.dtype, device=device)
        self.v_caches = torch.zeros(dims, dtype=shape.dtype, device=device)
        self.epoch = 0          # set once registered (standalone: 1)

    @property
    def pool_bytes(self) -> int:
        return self.shape.num_blocks * self.shape.bytes_per_block

    # ------------------------------------------------------------ operations

    def write(self, layer: int, slots: list[int], key: torch.Tensor, value: torch.Tensor) -> int:
        """Writes ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``slots``
        of ``layer`` (slot < 0: skipped); returns how many tokens were written."""
        self._check_layer(layer)
        s = self.shape
        want = (len(slots), s.num_kv_heads, s.head_dim)
        for name, t in (("key", key), ("value", value)):
            if tuple(t.shape) != want:
                raise errors.InvalidArgument(f"{name}: shape {list(t.shape)}, expected {list(want)} "
                                             f"([len(slot_mapping), num_kv_heads, head_dim])")
        seen: set[int] = set()
        for i, slot in enumerate(slots):
            if slot >= s.num_slots:
                raise errors.InvalidArgument(f"slot_mapping[{i}] = {slot} is out of range 0..{s.num_slots - 1}")
            if slot >= 0:
                if slot in seen:
                    raise errors.InvalidArgument(f"slot_mapping[{i}] = {slot} appears twice")
                seen.add(slot)
        if not seen:
            return 0
        mapping = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.backend.reshape_and_cache(key.contiguous(), value.contiguous(), self.k_caches[layer],
                                       self.v_caches[layer], mapping)
        return len(seen)

    def read(self, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_slots, num_kv_heads, head_dim]`` of ``slots`` in ``layer``."""
        self._check_layer(layer)
        s = self.shape
        for i, slot in enumerate(slots):
            if not 0 <= slot < s.num_slots:
                raise errors.InvalidArgument(f"slots[{i}] = {slot} is out of range 0..{s.num_slots - 1}")
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        blocks, offsets = idx // s.block_size, idx % s.block_size
        return (self.k_caches[layer][blocks, :, offsets].clone(), self.v_caches[layer][blocks, :, offsets].clone())

    def attention(self, layer: int, query: torch.Tensor, block_tables: list[list[int]], context_lens: list[int],
                  query_lens: list[int], scale: float, num_splits: int) -> torch.Tensor:
        """Causal attention of packed ``query`` ``[sum(query_lens), num_heads, head_dim]``
        over each sequence's block table; returns the same shape."""
        self._check_layer(layer)
        s = self.shape
        n = len(block_tables)
        if n == 0:
            raise errors.InvalidArgument("attention needs at least one sequence (block_tables is empty)")
        if len(context_lens) != n or len(query_lens) != n:
            raise errors.InvalidArgument(f"{n} block tables, {len(context_lens)} context_lens and "
                                         f"{len(query_lens)} query_lens: one of each per sequence")
        for i, (table, ctx, q) in enumerate(zip(block_tables, context_lens, query_lens)):
            if q < 1:
                raise errors.InvalidArgument(f"query_lens[{i}] = {q}: each sequence needs at least one query")
            if ctx < q:
                raise errors.InvalidArgument(f"context_lens[{i}] = {ctx} is below its query_lens {q} "
                                             f"(the queries' own K/V are part of the context)")
            check_block_table(s, table, ctx, f"context_lens[{i}] = {ctx}", f"block_tables[{i}]")
        total = sum(query_lens)
        if query.dim() != 3 or query.shape[0] != total or query.shape[2] != s.head_dim:
            raise errors.InvalidArgument(f"query: shape {list(query.shape)}, expected [{total}, num_heads, "
                                         f"{s.head_dim}] ([sum(query_lens), num_heads, head_dim])")
        if query.shape[1] == 0 or query.shape[1] % s.num_kv_heads:
            raise errors.InvalidArgument(f"query: {query.shape[1]} heads is not a multiple of the pool's "
                                         f"{s.num_kv_heads} KV heads")
        if not (math.isfinite(scale) and scale >= 0):
            raise errors.InvalidArgument(f"scale must be finite and >= 0 (0: head_dim ** -0.5), got {scale}")
        if not 0 <= num_splits <= MAX_SPLITS:
            raise errors.InvalidArgument(f"num_splits must be in 0..{MAX_SPLITS} (0: the backend's choice), "
                                         f"got {num_splits}")
        width = max(math.ceil(c / s.block_size) for c in context_lens)
        tables = torch.zeros((n, max(width, 1)), dtype=torch.int32)
        for i, (table, ctx) in enumerate(zip(block_tables, context_lens)):
            used = math.ceil(ctx / s.block_size)
            tables[i, :used] = torch.tensor(table[:used], dtype=torch.int32)
        starts = torch.zeros(n + 1, dtype=torch.int32)
        starts[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int64), 0).to(torch.int32)
        return self.backend.paged_attention(
            query.contiguous(), self.k_caches[layer], self.v_caches[layer], tables.to(self.device),
            torch.tensor(context_lens, dtype=torch.int32, device=self.device), starts.to(self.device),
            scale or s.head_dim ** -0.5, num_splits=num_splits or None)

    def copy(self, pairs: list[tuple[int, int]]) -> int:
        """Copies block ``src`` onto ``dst`` in every layer, for each pair; returns the count."""
        self.check_copies(pairs)
        if pairs:
            mapping = torch.tensor(pairs, dtype=torch.int64, device=self.device)
            self.backend.copy_blocks(self.k_caches, self.v_caches, mapping)
        return len(pairs)

    def zero(self, blocks: list[int]) -> None:
        """Zeroes blocks (every layer's K and V): a block given to another tenant than its
        last writer's holds nothing of that tenant's (``worker/rights.py``)."""
        if blocks:
            index = torch.tensor(blocks, dtype=torch.long, device=self.k_caches.device)
            self.k_caches.index_fill_(1, index, 0)
            self.v_caches.index_fill_(1, index, 0)

    def check_copies(self, pairs: list[tuple[int, int]], field: str = "pairs") -> None:
        """Raises InvalidArgument (naming ``field[i]``), changing nothing, unless every
        ``(src, dst)`` pair is in range, no destination is used twice and no destination
        is also a source."""
        s = self.shape
        sources = {src for src, _ in pairs}
        targets: set[int] = set()
        for i, (src, dst) in enumerate(pairs):
            for name, b in (("src", src), ("dst", dst)):
                if not 0 <= b < s.num_blocks:
                    raise errors.InvalidArgument(f"{field}[{i}].{name} = {b} is out of range 0..{s.num_blocks - 1}")
            if dst in targets:
                raise errors.InvalidArgument(f"{field}[{i}].dst = {dst} is the destination of two copies")
            if dst in sources:
                raise errors.InvalidArgument(f"{field}[{i}].dst = {dst} is also a source in this call")
            targets.add(dst)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.shape.num_layers:
            raise errors.InvalidArgument(f"layer {layer} is out of range 0..{self.shape.num_layers - 1}")
