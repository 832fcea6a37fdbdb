"""Local mode (``Client(local=True)``, DESIGN §5): a step's ownership changes are made in
the engine's process at once and reach the allocator through each pool's journal.

``LocalSteps`` is the half of ``kvservice.client.Client`` that does it: the decode fast
path, growth / copy-on-write / commits / forks / frees applied locally and journaled, the
reserves that cover them, the creates (the one synchronous call: the global prefix
lookup), the flusher's ``Sync`` and its reply (grants, acknowledgements, a rollback's
resync). It works on the client's state (its lock, journals, live sequences, lease and
stub) and has no state of its own.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from kvservice import errors
from kvservice.common import hashing
from kvservice.journal import COPY, FORK, FREE, GROW, PoolJournal
from kvservice.resyncs import RESYNC_ATTEMPTS, claim
from kvservice.rpc import fence_seconds, new_request_id, to_domain_error
from kvservice.sequence import CopyPair, Sequence, StepResult, freed_error
from kvservice.v1 import allocator_pb2 as pb

log = logging.getLogger(__name__)


class _PoolsForgotten(Exception):
    """A Sync named pools registered again since; they are forgotten: build it again."""


class LocalSteps:
    """Local-mode steps, the journal and its ``Sync`` (mixed into ``Client``)."""

    def _step_local(self, appends: dict, forks: dict, frees: list, creates: list) -> StepResult:
        """A step whose ownership changes are local: no RPC unless it creates sequences
        (the prefix lookup is global) or a pool's reserve cannot cover it. The creates are
        made first: refused, nothing of the step changed; if the local part is refused
        after them (a reserve that cannot be refilled), the created sequences are in the
        exception's ``result``."""
        self._check_alive()
        if self._resyncing:
            self._sync_once()        # (no change until the pools agree again)
        result = StepResult()
        created = None
        if creates:
            if appends or forks or frees:
                self._check_local(appends, forks, frees)     # bad input: refused before any create
            if self.commit_after_write:
                self._log_written()        # (so that the creates' lookup sees the blocks written since)
            created = self._create_local(creates)
        # The decode step's common case first: tokens that stay inside a private partial
        # block change the sequence alone (as in an in-process block manager); the rest
        # ("slow": a block fills or is needed, a shared block is written) go through the
        # journal. Children share their parent's state before its appends: with forks,
        # every append takes the journal's path.
        if forks:
            slow = appends
        else:
            with self._lock:
                slow = self._append_fast(appends) if appends else {}
        if slow or forks or frees:
            # (until the step is done, its fast appends may still be undone: a resync's
            # snapshot taken meanwhile claims the lengths before them, ``_claims``)
            self._pending_fast = (appends, slow) if slow is not appends else None
            try:
                self._step_journaled(slow, forks, frees, result)
            except BaseException as exc:
                if slow is not appends:
                    with self._lock:
                        self._undo_fast(appends, slow)
                if created is not None and isinstance(exc, errors.KvsError):
                    exc.result = StepResult(copies=list(created.copies), created=created.created, rpc=True)
                raise
            finally:
                self._pending_fast = None
        if created is not None:
            result.created = created.created
            result.copies.extend(created.copies)
            result.rpc = True
        return result

    def _create_local(self, creates: list) -> StepResult:
        """The step's creates, in one call (``_create_call``: with the pending commits
        first); the new sequences join the local state. A pending free only leaves a block
        referenced a little longer, but the pool's capacity may need it: refused, the lease
        gives its reserve back in the refusing pool (a create cannot take reserved blocks),
        the journal is flushed and the call made once more."""
        try:
            try:
                created = self._create_call(creates)
            except errors.ResourceExhausted as exc:
                with self._lock:
                    pj = self._journals.get(exc.pool_id)
                    if pj is None or (not pj.pending and exc.needed > exc.available + len(pj.reserve)
                                                   + len(pj.returning)):
                        raise     # (what the lease holds back would not be enough: nothing to retry)
                    if pj.reserve:
                        pj.returning.extend(pj.reserve)
                        pj.reserve = []
                        pj.starved_until = time.monotonic() + pj.STARVED_BACKOFF   # (no refill at once)
                    if exc.result is not None or not any(j.pending or j.returning for j in self._journals.values()):
                        raise
                self.flush()
                created = self._step_remote({}, {}, [], creates)
        except errors.KvsError as exc:
            if exc.result is not None:      # the pools that did create: their sequences are ours
                self._adopt(exc.result.created)
            raise
        self._adopt(created.created)
        return created

    def _create_call(self, creates: list) -> StepResult:
        """One Step with the creates that carries the pending journal first (a ``Sync``
        inside it) when the journal commits blocks, so that their prefix lookup sees them
        (the journal's other changes cannot add a hit: it travels on its own then). Until
        its answer comes, that Sync is the one to send again (``_unanswered``): if the call
        fails, it may have been applied."""
        try:
            with self._sync_lock:
                if self._unanswered is not None or self._resyncing or not any(
                        any(j.num_commits) for j in self._journals.values()):
                    sync = None        # (no commit to carry, or a Sync to settle first: the flusher's)
                else:
                    request, journals = self._build_sync()
                    self._unanswered = (request, journals)
                    sync = (request, journals, time.monotonic())
                    self._sent_at = sync[2]
                try:
                    return self._step_once({}, {}, [], creates, sync=sync)
                except errors.KvsError as exc:
                    # A pool of the journal carried along left the registry or registered
                    # again meanwhile (as for a Sync of its own: ``_exchange``): its
                    # journal is dropped, its sequences are lost, and the create goes on
                    # without it.
                    if sync is None or not self._drop_gone_pools(exc, sync[1]):
                        raise
                    return self._step_once({}, {}, [], creates)
        except errors.RolledBack as exc:
            return self._after_rollback(exc)      # (its resync takes the Sync lock)

    def _adopt(self, created: list["Sequence"]) -> None:
        """New sequences join the local state (their pools' journals)."""
        with self._lock:
            for seq in created:
                pj = self._journal(seq)
                pj.hold(seq._table)
                pj.hash_of.update(zip(seq._table, seq._prompt_hashes))
                seq._logged = seq._num_tokens
                seq._room = _room(seq)
                self._live.add(seq)

    def _append_fast(self, appends: dict) -> dict:
        """Applies the appends that stay below each sequence's ``_room`` (inside its
        private last block, filling it at most); returns the others, unapplied."""
        slow = {}
        for s, tokens in appends.items():
            if tokens.__class__ is not list:
                slow[s] = list(tokens)
                continue
            n = len(tokens)
            t1 = s._num_tokens + n
            if t1 < s._room and s.client is self:
                if n == 1:         # (decode: one token)
                    t = tokens[0]
                    if t.__class__ is int:
                        s._tail.append(t)
                        s._num_tokens = t1
                        continue
                else:
                    for t in tokens:
                        if t.__class__ is not int:
                            break
                    else:
                        s._tail += tokens
                        s._num_tokens = t1
                        continue
            slow[s] = tokens
        return slow

    @staticmethod
    def _undo_fast(appends: dict, slow: dict) -> None:
        """Takes back what ``_append_fast`` applied (the step was refused)."""
        for s, tokens in appends.items():
            if tokens and s not in slow:
                del s._tail[-len(tokens):]
                s._num_tokens -= len(tokens)

    def _check_local(self, appends: dict, forks: dict, frees: list) -> None:
        """Refuses a local step's bad input (another client's sequence, a freed one, a
        token that is not an int) before anything changes."""
        for s, tokens in appends.items():
            if s.__class__ is not Sequence and not isinstance(s, Sequence) or s.client is not self:
                raise ValueError(f"{s!r} is not a sequence of this client")
            if s.freed:
                raise freed_error(s)
            for t in tokens:
                if t.__class__ is not int and (not isinstance(t, int) or isinstance(t, bool)):
                    raise TypeError(f"token ids must be int, got {t!r} for sequence {s.id}")
        for s in (*forks, *frees):
            if s.freed:
                raise freed_error(s)

    def _step_journaled(self, appends: dict, forks: dict, frees: list, result: StepResult) -> None:
        """The step's frees, forks and appends that change ownership: checked, covered by
        the reserves (a synchronous Sync when they are not), then applied and journaled.
        NOTE: nothing is journaled for a pool while it resyncs (the resync's snapshot is the
        state; an entry logged after it could name a sequence the resync loses): a step
        that finds a resync begun since it started waits for it, then goes on."""
        self._check_local(appends, forks, frees)
        if frees:
            # First, and whatever becomes of the rest: the blocks they release serve the
            # step (partial ones back in the reserve; the others once the Sync that covers
            # the step has applied the frees).
            for _ in range(RESYNC_ATTEMPTS):
                with self._lock:
                    if not self._resyncing_in(frees):
                        for s in frees:
                            if not s.freed:       # (lost in a resync meanwhile: gone already)
                                self._free_local(s)
                        break
                self._sync_once()
        changing = (*appends, *forks)
        for _ in range(RESYNC_ATTEMPTS):
            self._ensure_reserves(appends, forks)
            try:
                with self._lock:
                    if not self._resyncing_in(changing):
                        for s in changing:
                            if s.freed:     # (lost in a resync since the step was checked)
                                raise freed_error(s)
                        self._apply_local(appends, forks, result)
                        break
            finally:
                for pj in self._journals.values():
                    pj.floor = 0
            self._sync_once()
            self._check_local(appends, forks, [])     # (SequenceLost: lost in that resync)
        else:
            raise errors.Unavailable("the pools of the step were resynchronising throughout")
        # Send now, unless a Sync went out less than flush_interval ago: the step is done,
        # and an engine is about to wait for its forward pass (a Sync sent then does not
        # compete with the next step for the interpreter).
        if time.monotonic() - self._sent_at >= self.flush_interval:
            self._wake.set()

    def _resyncing_in(self, sequences) -> bool:
        """Whether a pool of ``sequences`` is resynchronising (under the lock)."""
        journals = self._journals
        return any(journals[s.pool].resyncing for s in sequences if s.pool in journals)

    def _apply_local(self, appends: dict, forks: dict, result: StepResult) -> None:
        """The step's forks and appends, covered by the reserves (under the lock)."""
        for s, children in forks.items():
            kids = result.children.setdefault(s.id, [])
            for tokens in children:
                child = self._fork_local(s)
                kids.append(child)
                if tokens:
                    self._append_local(child, list(tokens), result)
        for s, tokens in appends.items():
            if tokens:
                self._append_local(s, tokens, result)

    def _journal(self, s: "Sequence") -> PoolJournal:
        pj = self._journals.get(s.pool)
        if pj is not None and pj.epoch < s.epoch:   # (the pool was registered again since)
            self._forget_pool(s.pool)
            pj = None
        if pj is None:
            pj = self._journals[s.pool] = PoolJournal(s.pool, s.epoch, s.block_size)
        return pj

    def _forget_pool(self, pool_id: str) -> None:
        """(under ``_lock``) A pool registered again (a new epoch: its worker restarted):
        every block, sequence and grant of the old epoch is gone there, so the journal of
        that epoch is dropped, unsent, and its live sequences are lost
        (``errors.SequenceLost``: the caller recomputes them)."""
        pj = self._journals.pop(pool_id, None)
        if pj is None:
            return
        self._mark_lost(pool_id, {s.number for s in self._live if s.pool == pool_id and s.epoch == pj.epoch})
        self._generations.pop(pool_id, None)
        log.warning("pool %s was registered again since epoch %d: its sequences of that epoch are lost",
                    pool_id, pj.epoch)

    def _forget_reregistered(self) -> bool:
        """Drops the journals of the pools whose epoch moved on, or that left the registry
        (drained: ``kvservice drain``), as ListPools says; whether any."""
        current = {p.pool_id: p.epoch for p in self.pools()}
        with self._lock:
            moved = [pid for pid, pj in self._journals.items() if current.get(pid) != pj.epoch]
            for pool_id in moved:
                self._forget_pool(pool_id)
        return bool(moved)

    def _ensure_reserves(self, appends: dict, forks: dict) -> None:
        """Makes sure each pool's reserve and sequence numbers cover the step (an
        overestimate), with a synchronous Sync when they do not; else ResourceExhausted."""
        def shortfall() -> dict[str, tuple[int, int]]:
            short: dict[str, tuple[int, int]] = {}
            with self._lock:
                need: dict[str, list[int]] = {}
                for s, children in forks.items():
                    n = need.setdefault(s.pool, [0, 0])
                    n[1] += len(children)
                    for tokens in children:
                        if tokens:
                            n[0] += self._blocks_for(s, len(tokens), True)
                for s, tokens in appends.items():
                    if tokens:
                        need.setdefault(s.pool, [0, 0])[0] += self._blocks_for(s, len(tokens), s in forks)
                for pool, (blocks, numbers) in need.items():
                    pj = self._journals[pool]
                    pj.floor = blocks       # (the flusher returns no block the step counts on)
                    if len(pj.reserve) < blocks or len(pj.numbers) < numbers:
                        short[pool] = (blocks, numbers)
            return short

        for attempt in range(2):
            short = shortfall()
            if not short:
                return
            if attempt:
                pool, (blocks, numbers) = next(iter(short.items()))
                pj = self._journals[pool]
                have = len(pj.reserve)
                quota, limit = pj.quota
                if quota == "sequences":
                    raise errors.ResourceExhausted(
                        f"pool {pool}: the step forks {numbers} sequences, the lease holds {len(pj.numbers)} "
                        f"sequence numbers: the tenant's quota of sequences per pool is {limit}",
                        pool_id=pool, needed=numbers, available=len(pj.numbers), quota=quota, limit=limit)
                why = f": the tenant's quota of blocks per pool is {limit}" if quota == "blocks" else ""
                raise errors.ResourceExhausted(f"pool {pool}: the step needs up to {blocks} blocks, the lease's "
                                               f"reserve holds {have}{why}", pool_id=pool, needed=blocks,
                                               available=have, quota=quota if why else "", limit=limit if why else 0)
            self._sync_once(short, recheck=shortfall)

    def _blocks_for(self, s: "Sequence", added: int, forked: bool) -> int:
        bs = s.block_size
        t = s._num_tokens
        copy = 1 if t % bs and (forked or self._journals[s.pool].shared(s._table[-1])) else 0
        return copy + max(0, -(-(t + added) // bs) - len(s._table))

    def _append_local(self, s: "Sequence", tokens: list[int], result: StepResult) -> None:
        pj = self._journals[s.pool]
        bs = s.block_size
        piece = pj.MAX_ENTRY_BLOCKS * bs
        if len(tokens) > piece:
            # (a long append: GROW entries of a bounded size, each one script call's work at most)
            for i in range(0, len(tokens), piece):
                self._append_local(s, tokens[i:i + piece], result)
            return
        t0 = s._num_tokens
        table = s._table
        if t0 % bs and pj.refs.get(table[-1], 0) > 1:     # copy-on-write of the shared partial block
            src = table[-1]
            dst = pj.take()
            pj.refs[src] -= 1
            table[-1] = dst
            pj.log(COPY, s.number, t0, [dst])
            result.copies.append(CopyPair(s.pool, src, dst))
        t1 = t0 + len(tokens)
        grow = -(-t1 // bs) - len(table)
        blocks = [pj.take()] if grow == 1 else [pj.take() for _ in range(grow)] if grow > 0 else []
        table.extend(blocks)
        s._tail.extend(tokens)
        s._num_tokens = t1
        if blocks or (t1 if t1 < s._written else s._written) // bs > s._committed:
            self._log_grow(pj, s, blocks)
        # (else: the allocator learns this length with the sequence's next entry, or at a flush)
        s._room = _room(s)

    @staticmethod
    def _log_grow(pj: PoolJournal, s: "Sequence", blocks: list[int] = ()) -> None:
        """One GROW entry at the sequence's length: the blocks it added and the full
        blocks not committed yet (with their hashes). A block that fills on the fast
        path is committed here, with the sequence's next entry (its next block, a fork,
        a free or a flush): one entry per block in decode, not two. (A client that tracks
        writes commits the written ones: ``Sequence.mark_written``.)"""
        t1, bs = s._num_tokens, s.block_size
        k = s._full_blocks() - s._committed
        if k > 0:
            parent = last = s._last_hash
            data = s._tail[:k * bs]
            hash_of, at, table = pj.hash_of, s._committed, s._table
            for i in range(0, k * bs, bs):
                last = hash_of[table[at]] = hashing.block_hash(last, data[i:i + bs])
                at += 1
            pj.log(GROW, s.number, t1, blocks, commit_tokens=data, num_commits=k, parent_hash=parent)
            s._apply_commits(s._committed + k, last)
        else:
            pj.log(GROW, s.number, t1, blocks)
        s._logged = t1

    def _fork_local(self, s: "Sequence") -> "Sequence":
        pj = self._journals[s.pool]
        if s._full_blocks() > s._committed:
            self._log_grow(pj, s)        # (its full blocks committed before they are shared)
        n = pj.numbers.popleft()
        state = pb.Sequence(sequence_id=hashing.sequence_id(s.pool, s.epoch, n, self.lease_id), pool_id=s.pool,
                            epoch=s.epoch, block_table=s._table, num_tokens=s._num_tokens, num_cached_tokens=s.num_cached_tokens,
                            num_committed_blocks=s._committed, last_hash=s._last_hash, block_size=s.block_size)
        child = Sequence(self, state, list(s._tail), private=False)
        child._written = s._written
        pj.hold(s._table)
        pj.log(FORK, s.number, s._num_tokens, child=n)
        s._logged = child._logged = s._num_tokens
        s._room = 0      # the partial last block is shared now: the next write copies it
        self._live.add(child)
        return child

    def _free_local(self, s: "Sequence") -> None:
        pj = self._journals[s.pool]
        if s._full_blocks() > s._committed:
            self._log_grow(pj, s)        # (its full blocks committed: they stay cached)
        pj.log(FREE, s.number, s._num_tokens)
        pj.release(s._table, s._num_tokens)
        s.freed = True
        s._room = 0
        self._live.discard(s)

    def _log_written(self) -> None:
        """Journals the commits of the blocks declared written since their sequence's last
        entry (``Sequence.mark_written``); a create that follows carries them."""
        with self._lock:
            for s in self._live:
                if s._full_blocks() > s._committed:
                    self._log_grow(self._journals[s.pool], s)

    def flush(self) -> None:
        """A barrier: returns once the allocator has applied every local change made so
        far (and the lease was kept alive), and the steps whose answer was lost are
        settled (``kvservice.doubts``) if the allocator can be reached."""
        if self._doubts:
            self._settle_doubts()
        if not self.local:
            # (written blocks not committed yet are committed now: ``mark_written``)
            pending = [s for s in self._live if s._full_blocks() > s._committed] if self.commit_after_write else []
            if pending:
                self.step({s: [] for s in pending})
            return
        with self._lock:
            for s in self._live:
                # lengths and full (written) blocks no entry has said yet
                if s._num_tokens != s._logged or s._full_blocks() > s._committed:
                    self._log_grow(self._journals[s.pool], s)
        for _ in range(100):
            self._sync_once()
            with self._lock:
                if not any(j.pending or j.resyncing for j in self._journals.values()):
                    return
        raise errors.Unavailable("the journal could not be flushed")

    def _sync_once(self, short: dict[str, tuple[int, int]] | None = None, *, background: bool = False,
                   recheck: Callable[[], dict] | None = None) -> None:
        """One Sync: every pool's pending entries, refills and returns; a keep-alive. A Sync
        that got no answer is sent again first, as it was.
        ``recheck``: a shortfall that the Sync in flight (the flusher's) may have covered
        already: it is asked again once that one is done, and no Sync is sent if it is."""
        with self._sync_lock:
            for attempt in range(2):
                try:
                    if self._unanswered is not None and not self._exchange(*self._unanswered, background=background):
                        return
                    if recheck is not None:
                        short = recheck()
                        if not short:
                            return
                    self._exchange(*self._build_sync(short), background=background)
                    return
                except _PoolsForgotten:
                    # (a pool registered again since: its journal is dropped, the Sync built again)
                    if attempt:
                        raise errors.Unavailable("pools were registered again twice during one Sync") from None

    def _build_sync(self, short: dict[str, tuple[int, int]] | None = None) -> tuple[pb.SyncRequest, list[PoolJournal]]:
        """The next Sync (under ``_sync_lock``): every pool's pending entries, refill and
        returns, or its resync; ``short``: blocks and sequence numbers a step needs now."""
        with self._lock:
            journals = list(self._journals.values())
            parts = []
            for pj in journals:
                if pj.resyncing:
                    parts.append(pj.resync_request(self._claims(pj)))
                    continue
                part = pj.sync_request()
                part["generation"] = self._generations.get(pj.pool_id, 0)
                if short and pj.pool_id in short:
                    blocks, numbers = short[pj.pool_id]
                    part["need_blocks"] = blocks
                    if numbers > len(pj.numbers):
                        part["want_sequence_numbers"] = max(part["want_sequence_numbers"], numbers + pj.NUMBERS)
                parts.append(part)
        # (built outside the lock: copying the entries into the message takes a while)
        for part in parts:
            if "journal" in part:
                part["journal"] = pb.JournalEntries(**part["journal"])
        request = pb.SyncRequest(lease_id=self.lease_id, request_id=new_request_id(),
                                 pools=[pb.PoolSync(**part) for part in parts])
        return request, journals

    def _exchange(self, request: pb.SyncRequest, journals: list[PoolJournal], *, background: bool) -> bool:
        """Sends one Sync and applies its reply; returns whether it went through (the
        flusher's), or raises (the caller's). A Sync that fails without an answer (no
        replica within the retry budget, a reply lost after the call was applied) stays
        the one to send, unchanged, under its request id: the allocator answers a resend of
        an applied Sync with its first outcome, so blocks it granted are not lost and
        blocks being returned are never used again meanwhile."""
        self._unanswered = (request, journals)
        sent_at = self._sent_at = time.monotonic()
        try:
            if background:
                self.sync_count += 1
                reply = self.stub.Sync(request, timeout=self.timeout)
            else:
                reply = self._call(self.stub.Sync, request)
        except (grpc.RpcError, errors.KvsError) as exc:
            err = to_domain_error(exc) if isinstance(exc, grpc.RpcError) else exc
            definitive = True
            if self._drop_gone_pools(err, journals):
                if background:
                    return False
                raise _PoolsForgotten() from None
            if isinstance(err, (errors.NotFound, errors.LeaseExpired)):
                self.lease_error = err
            elif isinstance(err, (errors.InvalidArgument, errors.FailedPrecondition, errors.PermissionDenied)):
                self.journal_error = err      # the allocator refused the journal: nothing more can apply
            else:
                definitive = False            # UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED...: sent again
            if definitive:
                self._unanswered = None
                with self._lock:
                    for pj in journals:
                        pj.sync_failed()
            if background:
                return False
            raise err from None
        self._synced(reply, journals, sent_at)
        return True

    def _drop_gone_pools(self, err: errors.KvsError, journals: list[PoolJournal]) -> bool:
        """A Sync refused because a pool of it left the registry or registered again
        (``err``): drops the journals of such pools (``_forget_reregistered``) and the
        unanswered Sync (not the journal's fault: built again without them); whether it
        was that."""
        gone = getattr(err, "reason", "") == "EPOCH_CHANGED" or (
            isinstance(err, errors.NotFound) and "is not registered" in str(err))
        if not gone or not self._forget_reregistered():
            return False
        self._unanswered = None
        with self._lock:
            for pj in journals:
                pj.sync_failed()
        return True

    def _synced(self, reply: pb.SyncResponse, journals: list[PoolJournal], sent_at: float) -> None:
        """A Sync's answer (its own, or a create's that carried it): acknowledgements,
        grants, resyncs; the fence moves to when it was sent."""
        self._unanswered = None
        with self._lock:
            for pj, ack in zip(journals, reply.pools):
                if ack.HasField("grant"):
                    self._add_grants([ack.grant])
                if ack.tier_orders:    # (before the refill's blocks can be handed out)
                    self._add_tier_orders(ack.tier_orders)
                if ack.resynced:
                    self._resynced(pj, ack)
                else:
                    pj.synced(ack)
                    if not ack.rolled_back and not pj.resyncing:
                        self._heard([(pj.pool_id, ack.generation)])
                if pj.leaving and not (pj.pending or pj.reserve or pj.returning) and \
                        not any(s.pool == pj.pool_id for s in self._live):
                    self._journals.pop(pj.pool_id, None)     # (left: nothing of this client is there)
            self._resyncing = any(j.resyncing for j in self._journals.values())
            self._alive_until = sent_at + fence_seconds(self.lease.ttl_seconds)

    def _claims(self, pj: PoolJournal) -> list[pb.SequenceClaim]:
        """Every live sequence of the pool as this client holds it (for a resync; every
        committed block's hash is kept: a wrong one would lose the sequence). A step in
        progress may still undo its fast appends: their sequences are claimed at their
        lengths before them (the allocator learns the rest with the next entry)."""
        pending = self._pending_fast
        out = []
        for s in self._live:
            if s.pool != pj.pool_id:
                continue
            c = claim(s, pj.hash_of)
            if pending is not None and s in pending[0] and s not in pending[1]:
                c.num_tokens -= len(pending[0][s])
            out.append(c)
        pj.resync_lengths = {c.sequence: c.num_tokens for c in out}
        return out

    def _resynced(self, pj: PoolJournal, ack: pb.PoolReserve) -> None:
        """A resync's reply: the lost sequences are dropped (see ``lost_sequences``); the
        pool's generation is the reply's."""
        self._mark_lost(pj.pool_id, set(ack.lost_sequences))
        kept = []
        claimed = pj.resync_lengths
        for s in self._live:
            if s.pool == pj.pool_id:
                kept.append(s._table)
                s._logged = claimed.get(s.number, s._num_tokens)    # (the claim carried that length)
        pj.resynced(ack, kept)
        self._generations[pj.pool_id] = ack.generation
        self.resync_count += 1

    def lost_sequences(self) -> list[Sequence]:
        """The sequences lost in resyncs since the last call (each once): the allocator
        lost writes and could not prove their blocks were still this client's. Their
        handles refuse every change (``kvservice.errors.SequenceLost``); recompute them."""
        with self._lock:
            out, self._lost = self._lost, []
        return out

    def _flusher(self) -> None:
        """Sends the journal after each step that logged entries, and every
        ``flush_interval`` while there is something to send (a refill, a return), and a
        Sync at least every TTL / 3 (the keep-alive)."""
        keepalive_every = max(self.lease.ttl_seconds / 3, 0.05)
        last = time.monotonic()
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            if self._stop.is_set() or self.lease_error is not None:
                return
            now = time.monotonic()
            with self._lock:
                busy = self._unanswered is not None or any(
                    j.pending or j.returning or j.resyncing or (j.low() and now >= j.starved_until)
                    or (j.cap and len(j.reserve) > j.cap) for j in self._journals.values())
            if busy or now - last >= keepalive_every:
                self._sync_once(background=True)
                last = now
            if self._doubts:
                self._settle_doubts(background=True)

    def reserved_blocks(self) -> int:
        """Blocks this client holds in reserve, over all pools (its own view)."""
        with self._lock:
            return sum(len(j.reserve) + len(j.returning) for j in self._journals.values())

    def journal_lags(self) -> list[float]:
        """Seconds from a local change to the allocator's acknowledgement of it, for the
        recent changes of every pool."""
        with self._lock:
            return [lag for j in self._journals.values() for lag in j.lags]


def _room(s: Sequence) -> int:
    """The length below which appends stay inside the sequence's private last block,
    filling it at most (0 when the next token needs a block: a full last block, or a
    shared one)."""
    return (s._committed + 1) * s.block_size + 1 if len(s._table) > s._committed else 0
