"""The SDK's side of a lease in one pool (DESIGN §5): the reserve of blocks it owns, the
sequence numbers it was granted, the reference counts of the blocks its tables hold, and
the journal of local changes not yet acknowledged by the allocator.

Everything here is local and fast; ``kvservice.client.Client`` changes it under its lock
on the caller's thread and sends it with ``Sync`` from its flusher thread.
"""

from __future__ import annotations

import time
from collections import deque

from kvservice.v1 import allocator_pb2 as pb


GROW, COPY, COMMIT, FORK, FREE = (pb.JOURNAL_KIND_GROW, pb.JOURNAL_KIND_COPY, pb.JOURNAL_KIND_COMMIT,
                                  pb.JOURNAL_KIND_FORK, pb.JOURNAL_KIND_FREE)


class PoolJournal:
    """One pool's state of a lease, as the SDK keeps it.

    Attributes:
        pool_id, epoch: the pool (epoch of the sequences the lease holds there).
        reserve: blocks of the lease's reserve not in any table.
        numbers: granted sequence numbers for local forks, unused.
        refs: this lease's references to each block its tables hold.
        kinds, sequences, num_tokens, children, num_blocks, blocks, num_commits,
        commit_tokens, parent_hashes: the journal entries not yet acknowledged, in
            columns as ``JournalEntries`` sends them; the first has number
            ``first_pending``, the next one logged gets ``first_pending + len(kinds)``.
        applied: the last entry the allocator acknowledged.
        cap: the lease's reserve cap, as the last Sync said.
        returning: surplus blocks on their way back (not usable, not yet acknowledged).
    """

    #: Sequence numbers asked for at a time.
    NUMBERS = 64
    #: Entries sent in one Sync at most (the allocator's max_journal_entries, by default);
    #: the rest go with the next one.
    MAX_ENTRIES = 1024
    #: Blocks sent in one Sync at most (the allocator's max_journal_blocks, by default).
    MAX_BLOCKS = 65536
    #: Blocks given back in one Sync at most (the allocator's max_returned_blocks).
    MAX_RETURNS = 4096
    #: Fork entries in one Sync at most, and the block references they add (each child:
    #: its parent's blocks): the allocator's max_forks_per_call and max_fork_refs_per_call.
    MAX_FORKS = 128
    MAX_FORK_REFS = 4096
    #: Blocks one GROW entry adds (and commits) at most: a longer append is logged as
    #: several entries, each within one sync script call's work.
    MAX_ENTRY_BLOCKS = 512
    LAGS = 100_000
    #: After a refill that got nothing (the pool is full), or a reserve given back for a
    #: create, no refill for this long (a step that needs blocks still asks at once).
    STARVED_BACKOFF = 0.1

    def __init__(self, pool_id: str, epoch: int, block_size: int) -> None:
        self.pool_id = pool_id
        self.epoch = epoch
        self.block_size = block_size
        self.reserve: list[int] = []
        self.numbers: deque[int] = deque()
        self.refs: dict[int, int] = {}
        #: The hash of each committed block the tables hold (sent in a resync).
        self.hash_of: dict[int, bytes] = {}
        #: A reply showed the pool lost acknowledged entries: the next Sync resyncs.
        self.resyncing = False
        self.resync_from = 0        # the first entry number after the resync in flight
        self.resync_drops = 0       # pending entries its snapshot includes
        self.resync_lengths: dict[int, int] = {}   # the length its snapshot claimed, per sequence
        self.kinds: list[int] = []
        self.sequences: list[int] = []
        self.num_tokens: list[int] = []
        self.children: list[int] = []
        self.num_blocks: list[int] = []
        self.blocks: list[int] = []
        self.num_commits: list[int] = []
        self.commit_tokens: list[int] = []
        self.parent_hashes: list[bytes] = []
        self.first_pending = 1
        self.applied = 0
        self.cap = 0
        self.sent_returns: set[int] = set()    # the returns of the Sync in flight
        #: Blocks a step in progress counts on (beyond the cap: not surplus until it is done).
        self.floor = 0
        self.starved_until = 0.0
        #: The quota that kept the last grant below the need, and its limit ("", 0: none).
        self.quota: tuple[str, int] = ("", 0)
        self.returning: list[int] = []
        #: The pool is being drained (``Client.leave_pool``): its whole reserve goes back
        #: and no refill is asked for.
        self.leaving = False
        #: When each pending entry was logged (monotonic), and the lags of acknowledged
        #: entries (logged -> applied, seconds; the most recent LAGS of them).
        self.logged_at: list[float] = []
        self.lags: deque[float] = deque(maxlen=self.LAGS)

    # ------------------------------------------------------------ blocks

    def take(self) -> int:
        """A reserve block for a table (the caller checked that there is one)."""
        b = self.reserve.pop()
        self.refs[b] = 1
        return b

    def hold(self, blocks: list[int]) -> None:
        """A new table's references (a created or forked sequence)."""
        refs = self.refs
        for b in blocks:
            refs[b] = refs.get(b, 0) + 1

    def release(self, blocks: list[int], num_tokens: int) -> None:
        """A freed table's references, last block first: a partial block that reaches 0
        comes back to the reserve (only this lease could hold it), a full one leaves."""
        refs, bs = self.refs, self.block_size
        for i in range(len(blocks) - 1, -1, -1):
            b = blocks[i]
            r = refs[b] - 1
            if r:
                refs[b] = r
                continue
            del refs[b]
            if (i + 1) * bs > num_tokens:
                self.reserve.append(b)
            else:
                self.hash_of.pop(b, None)

    def shared(self, b: int) -> bool:
        return self.refs.get(b, 0) > 1

    # ------------------------------------------------------------ the journal

    @property
    def pending(self) -> int:
        """Entries logged and not yet acknowledged."""
        return len(self.kinds)

    def log(self, kind: int, sequence: int, num_tokens: int, blocks: list[int] = (), child: int = 0,
            commit_tokens: list[int] = (), num_commits: int = 0, parent_hash: bytes = b"") -> None:
        """Appends one entry (``commit_tokens``: ``block_size`` ids per commit)."""
        self.kinds.append(kind)
        self.sequences.append(sequence)
        self.num_tokens.append(num_tokens)
        self.children.append(child)
        self.num_blocks.append(len(blocks))
        if blocks:
            self.blocks.extend(blocks)
        self.num_commits.append(num_commits)
        if num_commits:
            self.commit_tokens.extend(commit_tokens)
            self.parent_hashes.append(parent_hash)
        self.logged_at.append(time.monotonic())

    def acknowledge(self, applied: int) -> None:
        """Drops the entries up to ``applied`` (the allocator has them)."""
        self._drop(min(applied - self.first_pending + 1, len(self.kinds)), measure=True)
        self.applied = max(self.applied, applied)

    def _drop(self, done: int, *, measure: bool) -> None:
        """Drops the first ``done`` pending entries (recording their lags if ``measure``)."""
        if done <= 0:
            return
        if measure:
            now = time.monotonic()
            self.lags.extend(now - t for t in self.logged_at[:done])
        del self.logged_at[:done]
        nb, nc = self.num_blocks[:done], self.num_commits[:done]
        del self.blocks[:sum(nb)]
        del self.commit_tokens[:sum(nc) * self.block_size]
        del self.parent_hashes[:done - nc.count(0)]
        for column in (self.kinds, self.sequences, self.num_tokens, self.children, self.num_blocks,
                       self.num_commits):
            del column[:done]
        self.first_pending += done

    def _batch(self) -> int:
        """How many pending entries the next Sync carries."""
        k = min(self.MAX_ENTRIES, len(self.kinds))
        if sum(self.num_blocks[:k]) > self.MAX_BLOCKS:
            total = 0
            for i, b in enumerate(self.num_blocks[:k]):
                total += b
                if total > self.MAX_BLOCKS:
                    k = max(i, 1)
                    break
        if FORK in self.kinds[:k]:
            forks = refs = 0
            bs = self.block_size
            for i in range(k):
                if self.kinds[i] == FORK:
                    forks += 1
                    refs += -(-self.num_tokens[i] // bs)      # the parent's blocks, at the fork
                    if forks > self.MAX_FORKS or refs > self.MAX_FORK_REFS:
                        return max(i, 1)
        return k

    def entries(self, k: int) -> dict:
        """The first ``k`` pending entries, as the fields of a ``pb.JournalEntries``."""
        nb, nc = self.num_blocks[:k], self.num_commits[:k]
        return {"kinds": self.kinds[:k], "sequences": self.sequences[:k], "num_tokens": self.num_tokens[:k],
                "children": self.children[:k], "num_blocks": nb, "blocks": self.blocks[:sum(nb)],
                "num_commits": nc, "commit_tokens": self.commit_tokens[:sum(nc) * self.block_size],
                "parent_hashes": b"".join(self.parent_hashes[:k - nc.count(0)])}

    # ------------------------------------------------------------ the reserve's size

    def target(self) -> int:
        """How many blocks to keep in reserve: the cap (the allocator sizes it: about 1%
        of the pool, less under pressure), or a few blocks before the first Sync."""
        return self.cap or 4

    def low(self) -> bool:
        """Below half the target: time for a background refill."""
        return len(self.reserve) < self.target() // 2

    def sync_request(self) -> dict:
        """This pool's part of the next Sync (the pending entries, a refill, a return), as
        the fields of a ``pb.PoolSync``, its journal as the fields of a
        ``pb.JournalEntries``: cheap to take under the client's lock (list slices), built
        into the message outside it."""
        keep = max(self.cap, self.floor)
        surplus = len(self.reserve) - keep if self.cap and len(self.reserve) > keep else 0
        if self.leaving:
            surplus = len(self.reserve)
        if surplus > 0:
            self.returning.extend(self.reserve[:surplus])
            del self.reserve[:surplus]
        want = self.target() if time.monotonic() >= self.starved_until and not self.leaving else 0
        sent = self.returning[:self.MAX_RETURNS]
        self.sent_returns = set(sent)
        return {"pool_id": self.pool_id, "epoch": self.epoch, "want_blocks": want,
                "returned_blocks": sent, "first_entry": self.first_pending,
                "journal": self.entries(self._batch()),
                "want_sequence_numbers": self.NUMBERS if len(self.numbers) < self.NUMBERS // 2 else 0}

    def synced(self, reply: pb.PoolReserve) -> None:
        """Applies a Sync's reply for this pool (a resync's: ``resynced``)."""
        if reply.rolled_back:
            # The pool's generation is not ours (its Redis restarted or failed over): nothing
            # was applied, and its state may have rolled back: the next Sync resyncs.
            self.roll_back()
            return
        if reply.applied_entries < self.applied and not reply.resynced:
            # The pool lost entries it had acknowledged (Redis lost writes): what it
            # granted or took back since is unknown; the next Sync sends the whole state.
            self.roll_back()
            self.reserve.extend(reply.granted_blocks)
            self.cap = reply.reserve_cap
            return
        self.acknowledge(reply.applied_entries)
        # (blocks set aside to return after the request was built go with the next one)
        self.returning = [b for b in self.returning if b not in self.sent_returns]
        self.sent_returns = set()
        self.reserve.extend(reply.granted_blocks)
        self.cap = reply.reserve_cap
        if not reply.granted_blocks and self.low() and reply.num_reserved_blocks < reply.reserve_cap:
            # (below the cap in the pool's own count too, and nothing granted: no free block)
            self.starved_until = time.monotonic() + self.STARVED_BACKOFF
        first = reply.first_sequence_number
        self.numbers.extend(range(first, first + reply.num_sequence_numbers))
        self.quota = (reply.quota, reply.quota_limit)

    def roll_back(self) -> None:
        """The pool may have lost what it acknowledged: no change here until a resync (the
        blocks on their way back are counted as ours again: the resync claims the tables,
        and the reserve goes back whole)."""
        if self.resyncing:
            return
        self.resyncing = True
        self.reserve.extend(self.returning)
        self.returning = []

    def sync_failed(self) -> None:
        """A Sync that did not go through: the returned blocks are still ours."""
        self.reserve.extend(self.returning)
        self.returning = []

    def resync_request(self, claims: list[pb.SequenceClaim]) -> dict:
        """This pool's part of a Sync that resyncs: ``claims`` (every live sequence, as
        held now) cover the pending entries; the journal continues after them."""
        self.resync_drops = len(self.kinds)
        self.resync_from = self.first_pending + len(self.kinds)
        self.numbers.clear()      # (the pool may grant them again: it lost the grant)
        return {"pool_id": self.pool_id, "epoch": self.epoch, "first_entry": self.resync_from,
                "resync": pb.PoolResync(sequences=claims)}

    def resynced(self, reply: pb.PoolReserve, tables: list[list[int]]) -> None:
        """Applies a resync's reply: the entries the snapshot covered are dropped, the
        pool's reserve replaces ours, and ``tables`` (the sequences kept) hold the blocks."""
        self._drop(self.resync_drops, measure=False)
        self.first_pending = self.resync_from
        self.applied = self.resync_from - 1
        self.reserve = list(reply.reserve_blocks)
        self.returning = []
        self.cap = reply.reserve_cap
        refs: dict[int, int] = {}
        for table in tables:
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        self.refs = refs
        self.hash_of = {b: h for b, h in self.hash_of.items() if b in refs}
        self.resyncing = False
