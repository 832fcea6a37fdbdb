"""Pool generations and resyncs, both SDK modes (docs/allocator.md, "Generations").

Redis can lose acknowledged writes (a restart from an AOF written every second, a
failover to a replica that lagged). Every pool has a generation, new whenever the Redis
process serving it is not the one that served it before; the client keeps the one it last
heard per pool (``generation(pool)``: what the engine sends to the workers too) and sends
it with every call. A pool of another generation refuses the call (``RolledBack``; in a
Sync, ``PoolReserve.rolled_back``), and so does its worker: the client then stops changing
that pool and sends its whole state there (``PoolSync.resync``), which the pool keeps
where it can prove the blocks are the lease's, and reports the rest lost
(``Sequence.lost``, ``lost_sequences()``). Only a resync's answer gives the client the new
generation: until it has resynchronised, every writer of the lease stays fenced.

``Resyncs`` is the half of ``kvservice.client.Client`` that does it; it has no state of
its own (the client's ``_generations``, ``_epochs``, ``_live``, ``_lost``, journals).
"""

from __future__ import annotations

from typing import Iterable

from kvservice import errors
from kvservice.common import hashing
from kvservice.rpc import new_request_id
from kvservice.sequence import Sequence
from kvservice.v1 import allocator_pb2 as pb

#: Resyncs of one pool tried in a row before the client gives up (each one fails only if
#: the pool began yet another generation meanwhile).
RESYNC_ATTEMPTS = 5


class Resyncs:
    """Generations, and resyncs of whole pools (mixed into ``Client``)."""

    def generation(self, pool_id: str) -> int:
        """The pool's generation as this client last heard it (0: it holds nothing there):
        what every write to the pool's worker carries (``WriteKV``, ``CopyBlocks``,
        ``Forward``), so that the worker refuses it once the pool's state may have rolled
        back, until this client has resynchronised."""
        return self._generations.get(pool_id, 0)

    def resync(self, pool_id: str) -> list[Sequence]:
        """Sends this client's whole state in the pool (its live sequences there, as it holds
        them) and waits for the answer: what a caller does when a worker refused a write
        for its generation (``errors.RolledBack``). Returns the sequences lost (also in
        ``lost_sequences()``; each refuses every change, ``errors.SequenceLost``)."""
        self._check_alive()
        before = set(self._lost)
        self._resync_pools([pool_id])
        return [s for s in self._lost if s not in before]

    def _heard(self, generations: Iterable[tuple[str, int]]) -> None:
        """Generations from an answer of the allocator that applied something (never from a
        refusal: a rolled-back pool's new generation is learnt by its resync alone)."""
        for pool_id, gen in generations:
            pj = self._journals.get(pool_id)
            if gen and (pj is None or not pj.resyncing):
                self._generations[pool_id] = gen

    def _resync_pools(self, pools: Iterable[str]) -> None:
        """Resyncs each pool now (a Sync whose part for it is the whole state)."""
        pools = list(dict.fromkeys(pools))
        if self.local:
            with self._lock:
                for pool_id in pools:
                    pj = self._journals.get(pool_id)
                    if pj is not None:
                        pj.roll_back()
                self._resyncing = any(j.resyncing for j in self._journals.values())
            for _ in range(RESYNC_ATTEMPTS):
                self._sync_once()
                with self._lock:
                    if not any(self._journals[p].resyncing for p in pools if p in self._journals):
                        return
            raise errors.Unavailable(f"pools {pools}: the resync did not complete")
        with self._sync_lock:        # (a worker's refusal may ask from several threads)
            for pool_id in pools:
                self._resync_remote(pool_id)

    def _resync_remote(self, pool_id: str) -> None:
        """(remote mode) One pool's resync: the live sequences there as claims."""
        for _ in range(RESYNC_ATTEMPTS):
            mine = [s for s in self._live if s.pool == pool_id]
            for s in mine:
                s._commit_full_blocks()
            epoch = mine[0].epoch if mine else self._epochs.get(pool_id, 0)
            if not epoch:
                self._generations.pop(pool_id, None)    # (nothing known there to claim)
                return
            request = pb.SyncRequest(lease_id=self.lease_id, request_id=new_request_id(), pools=[pb.PoolSync(
                pool_id=pool_id, epoch=epoch, first_entry=1,
                resync=pb.PoolResync(sequences=[_claim(s, s._hashes) for s in mine]))])
            try:
                ack = self._call(self.stub.Sync, request).pools[0]
            except errors.FailedPrecondition as exc:
                if exc.reason != "EPOCH_CHANGED":
                    raise
                # (registered again since: its sequences of the old epoch are gone, and
                # say so themselves; nothing of this client's is left there to resync)
                self._generations.pop(pool_id, None)
                self._epochs.pop(pool_id, None)
                return
            if ack.rolled_back:
                continue        # (another generation began during the resync: again)
            self._mark_lost(pool_id, set(ack.lost_sequences))
            self._generations[pool_id] = ack.generation
            if ack.HasField("grant"):
                self._add_grants([ack.grant])    # (what the lease kept, in the new generation)
            self.resync_count += 1
            return
        raise errors.Unavailable(f"pool {pool_id}: the resync did not complete")

    def _mark_lost(self, pool_id: str, lost: set[int]) -> list[Sequence]:
        """The pool's live sequences whose numbers are in ``lost`` leave the client's state:
        their handles refuse every change (``errors.SequenceLost``)."""
        gone = [s for s in self._live if s.pool == pool_id and s.number in lost]
        for s in gone:
            s.lost = s.freed = True
            s._room = 0
            self._live.discard(s)
            self._lost.append(s)
        return gone


def _claim(s: Sequence, hashes: list[bytes] | None) -> pb.SequenceClaim:
    """A sequence as this client holds it; ``hashes``: its committed blocks' (a block whose
    hash is not known is claimed with zeros: the pool then keeps it only if it is the
    lease's alone and unhashed, else the sequence is lost)."""
    missing = bytes(hashing.HASH_BYTES)
    known = hashes or []
    return pb.SequenceClaim(sequence=s.number, num_tokens=s._num_tokens, block_table=s._table,
                            num_committed_blocks=s._committed, last_hash=s._last_hash,
                            block_hashes=b"".join(known[i] if i < len(known) else missing
                                                  for i in range(s._committed)),
                            num_cached_tokens=s.num_cached_tokens)


def claim(s: Sequence, hash_of: dict[int, bytes]) -> pb.SequenceClaim:
    """A local-mode sequence's claim: its committed blocks' hashes from the pool's
    ``PoolJournal.hash_of``."""
    return _claim(s, [hash_of.get(b, bytes(hashing.HASH_BYTES)) for b in s._table[:s._committed]])
