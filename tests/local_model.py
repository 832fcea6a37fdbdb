"""The local-mode state machine's model of the SDK (``test_state_machine_local``): abstract
blocks, who holds them, their contents' chain hashes, and what a local step, a fork and
a create do to them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from kvservice.common import hashing

BS = 4                   # the model's block size


_roots: dict[str, bytes] = {}


def chain(tenant: str, tokens: list[int]) -> list[bytes]:
    """The chain hashes of every full block of ``tokens`` (tenant salt, no extra key)."""
    if tenant not in _roots:
        _roots[tenant] = hashing.root_hash(tenant)
    return hashing.chain_hashes(_roots[tenant], tokens, BS, len(tokens) // BS)


def last_hash(tenant: str, tokens: list[int]) -> bytes:
    hs = chain(tenant, tokens)
    return hs[-1] if hs else hashing.root_hash(tenant)


def num_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BS)


@dataclass
class MSeq:
    owner: str
    tenant: str
    family: int
    tokens: list[int]
    table: list[int]               # abstract block ids
    cached: int                    # num_cached_tokens


@dataclass
class Model:
    seqs: dict[str, MSeq] = field(default_factory=dict)
    content: dict[int, bytes] = field(default_factory=dict)   # abstract full block -> its chain hash
    known: set[bytes] = field(default_factory=set)            # hashes some client committed
    next_block: int = 0

    def new_block(self) -> int:
        self.next_block += 1
        return self.next_block

    def holders(self, block: int) -> int:
        return sum(s.table.count(block) for s in self.seqs.values())

    def fill(self, s: MSeq, start: int) -> None:
        """Records the content of the blocks of ``s`` that are full, from block ``start``."""
        for i, h in enumerate(chain(s.tenant, s.tokens)[start:], start):
            assert self.content.setdefault(s.table[i], h) == h, "two contents in one block"
            self.known.add(h)

    def append(self, sid: str, tokens: list[int]) -> list[tuple[int, int]]:
        """The SDK's local append: copy-on-write of a shared partial last block (the
        last holder writes in place), growth one block at a time, commits of full blocks."""
        s = self.seqs[sid]
        copies = []
        t0 = len(s.tokens)
        if t0 % BS and self.holders(s.table[-1]) > 1:
            dst = self.new_block()
            copies.append((s.table[-1], dst))
            s.table[-1] = dst
        s.tokens += tokens
        s.table += [self.new_block() for _ in range(num_blocks(len(s.tokens)) - len(s.table))]
        self.fill(s, t0 // BS)
        return copies

    def fork(self, sid: str, child: str, tokens: list[int]) -> list[tuple[int, int]]:
        s = self.seqs[sid]
        self.seqs[child] = MSeq(s.owner, s.tenant, s.family, list(s.tokens), list(s.table), s.cached)
        return self.append(child, tokens) if tokens else []

    def step(self, appends: dict[str, list[int]], forks: dict[str, list[list[int]]], frees: list[str],
             children: dict[str, list[str]]) -> list[tuple[int, int]]:
        """A local step in the SDK's order: frees, then each fork (each child's tokens
        right after it), then the appends; returns the copy pairs (abstract blocks)."""
        copies = []
        for sid in frees:
            del self.seqs[sid]
        for sid, kids in forks.items():
            for child, tokens in zip(children[sid], kids):
                copies += self.fork(sid, child, tokens)
        for sid, tokens in appends.items():
            copies += self.append(sid, tokens)
        return copies

    def new_blocks(self, appends, forks, frees) -> int:
        """Blocks the step takes from the reserve (a dry run)."""
        m = copy.deepcopy(self)
        m.step(appends, forks, frees, {sid: [f"{sid}+{i}" for i in range(len(k))] for sid, k in forks.items()})
        return m.next_block - self.next_block

    def create(self, sid: str, owner: str, tenant: str, family: int, tokens: list[int], handle,
               bound: dict[int, int]) -> str:
        """Adds a created sequence; checks its prefix hits against what is known; returns
        a coverage note."""
        hits, rest = divmod(handle.num_cached_tokens, BS)
        assert rest == 0 and hits <= (len(tokens) - 1) // BS, handle.num_cached_tokens
        hs = chain(tenant, tokens)
        run = 0
        while run < len(hs) and hs[run] in self.known:
            run += 1
        assert hits <= run, f"{hits} blocks hit where only {run} leading blocks were ever committed"
        note = ""
        table = []
        for i in range(len(handle.block_table)):
            block = bound.get(handle.block_table[i]) if i < hits else None
            if block is None:
                block = self.new_block()
                if i < hits:
                    note = note or "prefix hit on a block no live sequence holds"
            else:
                assert self.content.get(block) == hs[i], f"hit block {handle.block_table[i]} holds other content"
                holder = next(x for x in self.seqs.values() if block in x.table)
                note = "prefix hit on another lease's block" if holder.owner != owner else (
                    note or "prefix hit on a live block")
            table.append(block)
        self.seqs[sid] = MSeq(owner, tenant, family, list(tokens), table, handle.num_cached_tokens)
        self.fill(self.seqs[sid], 0)
        return note
