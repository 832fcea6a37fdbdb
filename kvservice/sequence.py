"""Sequence handles: a sequence's block table, length and uncommitted tokens, kept in the
engine's process and exact between steps (``Client.step`` changes them), and what a step
returns (``StepResult``, its copy-on-write pairs).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from kvservice import errors
from kvservice.common import hashing
from kvservice.v1 import allocator_pb2 as pb

if TYPE_CHECKING:
    from kvservice.client import Client


#: ``Sequence._written`` of a client that does not track writes: every token counts as written.
UNTRACKED = sys.maxsize


@dataclass(frozen=True, slots=True)
class CopyPair:
    """Copy block ``src`` onto ``dst`` in ``pool`` (all layers) before writing into ``dst``."""

    pool: str
    src: int
    dst: int


@dataclass(slots=True)
class StepResult:
    """What a step changed that the engine must act on.

    Attributes:
        copies: copy-on-write pairs, to apply on the workers before this step's writes.
        created: new sequences, in the order of ``creates``.
        children: forked children per parent sequence id, in request order.
        rpc: whether the step called the allocator.
    """

    copies: list[CopyPair] = field(default_factory=list)
    created: list["Sequence"] = field(default_factory=list)
    children: dict[str, list["Sequence"]] = field(default_factory=dict)
    rpc: bool = False


class Sequence:
    """A handle on one sequence; its state is local and exact between steps.

    Attributes:
        id: ``<pool>/<epoch>/<n>``.
        pool: the pool (worker) that holds its blocks.
        epoch: the pool's epoch when it was created.
        num_cached_tokens: prompt tokens that the prefix cache served at create.
    """

    __slots__ = ("client", "id", "number", "pool", "epoch", "block_size", "num_cached_tokens", "_table",
                 "_num_tokens", "_committed", "_last_hash", "_tail", "_private", "_room", "_logged",
                 "_prompt_hashes", "_hashes", "_written", "lost", "freed", "__weakref__")

    def __init__(self, client: "Client", state: pb.Sequence, tail: list[int], private: bool) -> None:
        self.client = client
        self.id = state.sequence_id
        self.number = int(self.id.rsplit("/", 1)[1].partition("-")[0])   # n of <pool>/<epoch>/<n>-<tag>
        self.pool = state.pool_id
        self.epoch = state.epoch
        self.block_size = state.block_size
        self.num_cached_tokens = state.num_cached_tokens
        self._table = list(state.block_table)
        self._num_tokens = state.num_tokens
        self._committed = state.num_committed_blocks
        self._last_hash = state.last_hash
        self._tail = tail          # token ids from block `_committed` on
        self._private = private    # the last block is known to be ours alone
        #: (local mode) appends that keep num_tokens below _room change only this object;
        #: _logged: the length the journal has told the allocator.
        self._room = 0
        self._logged = self._num_tokens
        self._prompt_hashes = state.block_hashes   # (a create's reply: its committed blocks' hashes)
        #: (remote mode) the hash of each committed block, to resynchronise (local mode keeps
        #: them per pool: ``PoolJournal.hash_of``); None in local mode.
        self._hashes: list[bytes] | None = None
        #: Tokens whose KV is written (``mark_written``): a block is committed (its hash
        #: announced) once it is full and written. A client made without
        #: ``commit_after_write`` commits every full block: ``UNTRACKED``.
        self._written = state.num_cached_tokens if client.commit_after_write else UNTRACKED
        #: Lost in a resync (the allocator lost writes and could not keep it): see
        #: ``Client.lost_sequences``.
        self.lost = False
        self.freed = False

    @property
    def block_table(self) -> list[int]:
        """Logical block index -> physical block id (a copy)."""
        return list(self._table)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def capacity(self) -> int:
        """Tokens the current block table can hold."""
        return len(self._table) * self.block_size

    def slot_mapping(self, start: int = 0, end: int | None = None) -> list[int]:
        """Physical slots (``block_id * block_size + offset``) of positions ``start..end-1``."""
        end = self._num_tokens if end is None else end
        if not 0 <= start <= end <= self.capacity:
            raise ValueError(f"positions {start}..{end} outside 0..{self.capacity} of sequence {self.id}")
        bs, table = self.block_size, self._table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def mark_written(self, num_tokens: int) -> None:
        """(a client made with ``commit_after_write``) The KV of the sequence's first
        ``num_tokens`` tokens is written on its worker: the full blocks among them are
        committed (their hashes announced to other creates, fetches, tier copies and KV
        events) with the next change that reaches the allocator. Until then they are the
        sequence's alone, and a sequence freed first leaves them unhashed."""
        if num_tokens > self._written:
            self._written = num_tokens

    @property
    def num_written_tokens(self) -> int:
        """Tokens whose KV is written (``mark_written``); every token when the client
        does not track writes."""
        return min(self._written, self._num_tokens)

    def append(self, token_ids: Iterable[int]) -> StepResult:
        """Appends tokens; calls the allocator only when ownership changes."""
        return self.client.step({self: list(token_ids)})

    def fork(self, token_ids: Iterable[int] = ()) -> "Sequence":
        """A child that shares every block; ``token_ids`` are appended to the child only."""
        return self.client.step(forks={self: [list(token_ids)]}).children[self.id][0]

    def migrate(self, pool: str = "") -> "Sequence":
        """Moves the sequence to another pool: returns its copy there (this one is freed).
        See ``Client.migrate``."""
        return self.client.migrate(self, pool)

    def free(self) -> None:
        """Releases the blocks (full blocks stay cached by hash until evicted)."""
        if not self.freed:
            self.client.step(frees=[self])

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.freed and not self.client.closed:
            self.free()

    def __repr__(self) -> str:
        return f"Sequence({self.id}, tokens={self._num_tokens}, blocks={self._table})"

    # -- step planning (used by Client.step)

    def _full_blocks(self) -> int:
        """The blocks that may be committed: full (and, tracked, written)."""
        n = self._num_tokens
        return (n if n < self._written else self._written) // self.block_size

    def _pending_commits(self) -> list[pb.BlockCommit]:
        bs = self.block_size
        full = self._full_blocks() - self._committed
        return [pb.BlockCommit(index=self._committed + i, token_ids=self._tail[i * bs:(i + 1) * bs])
                for i in range(full)]

    def _commit_full_blocks(self) -> None:
        """(remote mode, before a resync) Every full block (written, when the client tracks
        writes: no other block was ever sent as a commit) counts as committed, under the
        hash the allocator gives it (chained from the last committed one): the pool may
        have committed them in a step whose answer never came, and a resync keeps a hashed
        block only for a claim that names its hash. A chain this client does not know is
        left as it is."""
        bs = self.block_size
        full = self._full_blocks()
        if self._hashes is None or full <= self._committed:
            return
        h = self._last_hash
        for i in range(0, (full - self._committed) * bs, bs):
            h = hashing.block_hash(h, self._tail[i:i + bs])
        self._apply_commits(full, h)

    def _apply_commits(self, committed: int, last_hash: bytes) -> None:
        bs = self.block_size
        drop = (committed - self._committed) * bs
        if drop:
            hashes = self._hashes
            if hashes is not None:
                # (remote mode: the hashes of the blocks committed now, chained as the
                # allocator chains them; a chain that ends elsewhere is not kept)
                h, tail = self._last_hash, self._tail
                for i in range(0, drop, bs):
                    h = hashing.block_hash(h, tail[i:i + bs])
                    hashes.append(h)
                if h != last_hash:
                    self._hashes = None
            del self._tail[:drop]
        self._committed = committed
        self._last_hash = last_hash


def freed_error(s: Sequence) -> errors.KvsError | ValueError:
    """What a change to a freed (or lost) sequence raises."""
    if s.lost:
        return errors.SequenceLost(f"sequence {s.id} was lost when the allocator resynchronised after losing "
                                   "writes: recompute it")
    return ValueError(f"sequence {s.id} was freed")
