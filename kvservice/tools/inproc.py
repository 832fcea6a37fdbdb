"""An in-process block manager: what the bench compares the allocator with.

The block manager of the seed texts in plain Python, on one machine and one thread: a
free list, reference counts, block tables that grow one block at a time, fork by
reference count, and a prefix cache fed with the hash of every block that fills (the
project's own chained hash, as an in-process prefix cache must compute it). It owns
everything, shares nothing and survives nothing: the cost floor of the allocator's job.
"""

from __future__ import annotations

from collections import deque

from kvservice.common import hashing


class LocalSequence:
    """One sequence: its block table, its length, the tokens of its partial last block."""

    __slots__ = ("block_table", "num_tokens", "tail", "last_hash")

    def __init__(self, block_table: list[int], num_tokens: int, tail: list[int], last_hash: bytes) -> None:
        self.block_table = block_table
        self.num_tokens = num_tokens
        self.tail = tail
        self.last_hash = last_hash


class LocalBlockManager:
    """Blocks of one pool, managed in the caller's process."""

    def __init__(self, num_blocks: int, block_size: int, salt: str = "") -> None:
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_cnt = [0] * num_blocks
        self.cached: dict[bytes, int] = {}       # block hash -> block id
        self.root = hashing.root_hash(salt)

    def _allocate(self) -> int:
        if not self.free_block_ids:
            raise MemoryError("no free block")
        b = self.free_block_ids.popleft()
        self.ref_cnt[b] = 1
        return b

    def create(self, token_ids: list[int]) -> LocalSequence:
        """A sequence for a prompt; its full blocks are hashed into the prefix cache."""
        bs = self.block_size
        n = len(token_ids)
        table = [self._allocate() for _ in range(-(-n // bs))]
        parent = self.root
        full = n // bs
        for i, h in enumerate(hashing.chain_hashes(parent, token_ids, bs, full)):
            self.cached.setdefault(h, table[i])
            parent = h
        return LocalSequence(table, n, list(token_ids[full * bs:]), parent)

    def append(self, seq: LocalSequence, token_id: int) -> None:
        """One token: a new block when the last one is full (copy-on-write when it is
        partial and shared); a hash when a block fills."""
        bs = self.block_size
        if seq.num_tokens == len(seq.block_table) * bs:
            seq.block_table.append(self._allocate())
        elif seq.num_tokens % bs and self.ref_cnt[seq.block_table[-1]] > 1:
            self.ref_cnt[seq.block_table[-1]] -= 1
            seq.block_table[-1] = self._allocate()
        seq.tail.append(token_id)
        seq.num_tokens += 1
        if seq.num_tokens % bs == 0:
            seq.last_hash = hashing.block_hash(seq.last_hash, seq.tail)
            self.cached.setdefault(seq.last_hash, seq.block_table[-1])
            seq.tail = []

    def step(self, appends: dict[LocalSequence, list[int]]) -> None:
        """One engine step: the tokens of every sequence."""
        append = self.append
        for seq, tokens in appends.items():
            for t in tokens:
                append(seq, t)

    def fork(self, seq: LocalSequence) -> LocalSequence:
        for b in seq.block_table:
            self.ref_cnt[b] += 1
        return LocalSequence(list(seq.block_table), seq.num_tokens, list(seq.tail), seq.last_hash)

    def free(self, seq: LocalSequence) -> None:
        for b in reversed(seq.block_table):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_block_ids.append(b)
        seq.block_table = []
