"""The Python SDK: a client that holds a lease, and sequence handles.

The hot path stays off the network (DESIGN §5): each ``Sequence`` keeps its block table,
length and the tokens of its uncommitted blocks locally. In local mode (``local=True``,
what the engine uses; ``kvservice.local``) every ownership change is made in this process
at once and journaled to the allocator in the background; only creates (the global
prefix lookup) call it synchronously. Otherwise appends that fit in a private last block
change only local state, and the other changes of one engine step go in one ``Step``
RPC. Full blocks are committed to the prefix cache with the sequence's next entry or RPC
(or its free).

Example::

    from kvservice.client import Client

    with Client("127.0.0.1:50051", tenant="acme", local=True) as client:
        seq = client.create(prompt_ids)              # prefix-cached blocks are shared
        print(seq.block_table, seq.num_cached_tokens)
        seq.append([42])                             # no RPC
        child = seq.fork()                           # shares every block
        res = client.step({seq: [7], child: [9]})    # res.copies = copy-on-write pairs
        child.free(); seq.free()
        client.flush()                               # the allocator has it all
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from typing import Iterable, Mapping

import grpc

from kvservice import errors
from kvservice.channel import open_channel
from kvservice.common.geometry import Geometry
from kvservice.common.security import ClientCredentials
from kvservice.doubts import Doubt, Doubts, step_key
from kvservice.journal import PoolJournal
from kvservice.local import LocalSteps
from kvservice.batches import StepBatches
from kvservice.resyncs import RESYNC_ATTEMPTS, Resyncs
from kvservice.rpc import RESENT, fence_seconds, new_request_id, to_domain_error
from kvservice.sequence import CopyPair, Sequence, StepResult, freed_error
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc

#: Grants kept per pool for ``take_grants`` at most (a client that sends none to a worker
#: keeps only the latest).
MAX_PENDING_GRANTS = 65_536

_log = logging.getLogger("kvservice.client")

__all__ = ["Client", "CopyPair", "Sequence", "StepResult", "to_domain_error"]



class Client(StepBatches, LocalSteps, Doubts, Resyncs):
    """A connection to the allocator with one lease, kept alive in the background.

    Args:
        target: the allocator's replicas: ``host:port``, ``"host1:port1,host2:port2"`` or a
            list of ``host:port`` (or one gRPC target, e.g. ``dns:///name:port``). Calls go
            to any replica that is up (gRPC's ``round_robin``) and are resent unchanged,
            same request id, when their replica fails (``kvservice.channel``).
        tenant: the tenant to grant the lease to. Empty: the caller's authenticated
            identity (a server that authenticates nobody uses "default"); naming another
            tenant than one's own is refused (PERMISSION_DENIED).
        token: the bearer token that authenticates this client (default:
            ``KVSERVICE_TOKEN``, or the file ``KVSERVICE_TOKEN_FILE``).
        credentials: token and TLS files together (default: from the ``KVSERVICE_*``
            variables, see ``kvservice.common.security.ClientCredentials``); ``token``
            overrides its token.
        lease_ttl: seconds the allocator waits after the last keep-alive before freeing
            every sequence of this client.
        timeout: per-RPC deadline in seconds.
        keepalive: run the keep-alive thread (every ``lease_ttl / 3`` seconds).
        commit_after_write: announce a block's hash only once its KV is written: the
            creates' new blocks and every block that fills later are committed once the
            caller declares them written (``Sequence.mark_written``), so that no other
            create, fetch, tier copy or KV event sees a hash whose block holds no KV yet.
            For engines that write KV through workers; off, every full block is committed
            with the step that fills it (an allocator-only user).
        retry_budget: seconds a call keeps being resent while no replica answers it (the
            retry policy's backoffs add up to this) or its deadline runs out (a replica or a
            Redis that hangs): more than a replica's restart or a Redis stall.
    """

    def __init__(self, target: str | list[str], *, tenant: str = "", lease_ttl: float = 10.0,
                 timeout: float = 10.0, keepalive: bool = True, local: bool = False,
                 flush_interval: float = 0.005, retry_budget: float = 5.0, token: str | None = None,
                 credentials: ClientCredentials | None = None, commit_after_write: bool = False) -> None:
        self.target = target
        self.commit_after_write = commit_after_write
        self.timeout = timeout
        self.retry_budget = retry_budget
        creds = credentials or ClientCredentials.from_env()
        if token is not None:
            creds = dataclasses.replace(creds, token=token)
        self.channel = open_channel(target, retry_budget, creds)
        self.stub = pb_grpc.AllocatorStub(self.channel)
        self.rpc_count = 0          # RPCs made on the caller's thread, keep-alives excepted
        self.closed = False
        self.lease_error: errors.KvsError | None = None
        #: The last keep-alive's failure other than the allocator being unreachable (an
        #: unexpected status, logged as a warning too); None once one succeeds.
        self.keep_alive_error: errors.KvsError | None = None
        #: With ``local``: growth, copy-on-write, commits, forks and frees change local state
        #: at once and reach the allocator through the journal (``Sync``, in the background).
        self.local = local
        self.flush_interval = flush_interval
        self.sync_count = 0         # Syncs sent by the flusher thread
        self.journal_error: errors.KvsError | None = None
        self._journals: dict[str, PoolJournal] = {}
        self._live: set[Sequence] = set()      # the sequences not freed
        self._lost: list[Sequence] = []         # lost in resyncs, not yet taken
        #: Per pool: its generation as last heard (``kvservice.resyncs``), and its epoch.
        self._generations: dict[str, int] = {}
        self._epochs: dict[str, int] = {}
        self._resyncing = False                 # (local) a pool must resync first
        self._pending_fast: tuple[dict, dict] | None = None   # (local) a step's fast appends, undoable
        self._sent_at = 0.0                     # (local) when the last Sync went out
        self._unanswered: tuple[pb.SyncRequest, list[PoolJournal]] | None = None   # (local) to send again
        #: Steps whose answer never came, by what they ask (``kvservice.doubts``).
        self._doubts: dict[bytes, Doubt] = {}
        self._doubt_lock = threading.Lock()
        self.resync_count = 0
        #: Collect the lower tiers' orders of this client's steps and Syncs (DESIGN §12)
        #: for ``take_tier_orders``; off (an SDK user with no worker to run them): dropped,
        #: and the entries they named are taken back unconfirmed.
        self.collect_tier_orders = False
        #: With ``collect_tier_orders``: the creates of this client's steps may fetch a
        #: prefix that another pool caches from that pool's worker (DESIGN §13): fetch
        #: orders (TierOrder.source_pool_id) come with the tier orders, for ``FetchBlocks``.
        self.collect_fetches = False
        self._tier_orders: list[pb.TierOrder] = []
        #: The allocator's grants of the blocks this client's steps and Syncs got, per pool,
        #: not yet taken for a worker call (``take_grants``).
        self._grants: dict[str, list[pb.Grant]] = {}
        self._lock = threading.RLock()
        self._sync_lock = threading.Lock()
        self._wake = threading.Event()
        granted_at = time.monotonic()
        self.lease = self._call(self.stub.GrantLease, pb.GrantLeaseRequest(
            tenant=tenant, ttl_seconds=lease_ttl, request_id=new_request_id()))
        self._alive_until = granted_at + fence_seconds(self.lease.ttl_seconds)
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        if local:
            self._keeper = threading.Thread(target=self._flusher, name="kvservice-flusher", daemon=True)
            self._keeper.start()
        elif keepalive:
            self._keeper = threading.Thread(target=self._keep_alive, name="kvservice-keepalive", daemon=True)
            self._keeper.start()

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id

    # ------------------------------------------------------------ sequences

    def create(self, token_ids: Iterable[int], *, pool: str = "", extra_key: bytes = b"") -> Sequence:
        """A new sequence for a prompt; cached prompt blocks are shared, not allocated."""
        return self.step(creates=[(list(token_ids), pool, extra_key)]).created[0]

    def step(self, appends: Mapping[Sequence, Iterable[int]] | None = None, *,
             forks: Mapping[Sequence, list[list[int]]] | None = None,
             frees: Iterable[Sequence] = (),
             creates: Iterable[tuple[list[int], str, bytes] | list[int]] = ()) -> StepResult:
        """One engine step over many sequences: at most one RPC (one per 128 items for a
        step with more: ``kvservice.batches``; an operation of any size the pool holds,
        which the allocator carries out in bounded calls).

        Args:
            appends: tokens to append to each sequence.
            forks: per parent, one list of tokens per child (the child's first tokens).
                Children share the parent's state before the parent's own appends.
            frees: sequences to free.
            creates: prompts (token lists, or ``(tokens, pool, extra_key)`` tuples).

        Returns:
            The step's copy-on-write pairs, created sequences and children.

        Raises:
            kvservice.errors.ResourceExhausted: a pool ran short of blocks; nothing in that
                pool changed (other pools of the step did: their copy-on-write pairs,
                children and created sequences are in the exception's ``result``, a
                ``StepResult``; ``partial`` is the raw response). In local mode the
                creates are made first and the frees applied next, whatever becomes of
                the rest (the blocks they release serve the step): a refused create
                changes nothing else; appends and forks refused after them leave the
                created sequences in ``result``. In remote mode a step larger than one
                script call applies its commits and frees first too (they stay applied
                when the rest is refused); a step of more items than one request sends
                its requests in order, and a refused one leaves those before it applied
                (in ``result``).
            kvservice.errors.KvsError: any other refusal, with the same guarantee.
        """
        forks = dict(forks) if forks else {}
        frees = list(frees) if frees else []
        creates = [c if isinstance(c, tuple) else (list(c), "", b"") for c in creates] if creates else []
        if appends is None:
            appends = {}
        elif appends.__class__ is not dict or (forks or creates or not self.local) and not all(
                t.__class__ is list for t in appends.values()):
            appends = {s: list(t) for s, t in appends.items()}   # (a dict of lists is only read)
        # (else: a local step's fast path takes each list as it is and copies the others)
        if frees or forks:
            _check_step(self, appends, forks, frees)
        groups = self._step_groups(appends, forks, frees, creates)
        if len(groups) > 1:
            return self._split_step(groups)
        if self.local:
            return self._step_local(appends, forks, frees, creates)
        return self._step_remote(appends, forks, frees, creates)

    def _step_remote(self, appends: dict, forks: dict, frees: list, creates: list,
                     sync: tuple[pb.SyncRequest, list[PoolJournal], float] | None = None) -> StepResult:
        """A step whose ownership changes go to the allocator in one Step RPC; ``sync``:
        (local mode) a Sync it carries, applied first, and its journals and send time. A
        pool that refuses its part for its generation (its state may have rolled back) is
        resynchronised and that part sent again (``_after_rollback``)."""
        try:
            return self._step_once(appends, forks, frees, creates, sync)
        except errors.RolledBack as exc:
            return self._after_rollback(exc)

    def _after_rollback(self, exc: errors.RolledBack) -> StepResult:
        """A step refused by a pool for its generation: the pool is resynchronised, then what
        the step asked of the refused pools is sent again (what the others applied is kept:
        ``exc.result``). A sequence of the step that the resync lost makes the step raise
        SequenceLost when nothing else of it was applied (the caller plans it again), and is
        left out of it otherwise (``lost_sequences()`` lists it)."""
        done = exc.result if isinstance(exc.result, StepResult) else StepResult()
        for _ in range(RESYNC_ATTEMPTS):
            self._resync_pools([exc.pool_id] if exc.pool_id else list(self._generations))
            appends, forks, frees, creates = exc.retry
            lost = [s for s in (*appends, *forks, *frees) if s.lost]
            if lost:
                if not (done.copies or done.created or done.children):
                    raise freed_error(lost[0])
                appends = {s: t for s, t in appends.items() if not s.lost}
                forks = {s: k for s, k in forks.items() if not s.lost}
                frees = [s for s in frees if not s.lost]
            try:
                return _merged(done, self._step_once(appends, forks, frees, creates))
            except errors.RolledBack as again:
                exc, done = again, _merged(done, again.result)
            except errors.KvsError as other:
                other.result = _merged(done, other.result)
                raise
        raise exc

    def _step_once(self, appends: dict, forks: dict, frees: list, creates: list,
                   sync: tuple[pb.SyncRequest, list[PoolJournal], float] | None = None) -> StepResult:
        """``_step_remote``'s one attempt. Refused (RolledBack) by some pool, the error's
        ``retry`` holds what the step asked of the refused pools, and ``result`` what the
        others applied."""
        self._check_alive()
        if self._doubts and not self.local and self._keeper is None:
            self._settle_doubts(background=True)     # (no keep-alive thread to do it)
        # Plan without building anything for the (many) sequences that stay local: this
        # loop runs over every sequence of every decode step (see docs/benchmark.md). It
        # also checks the appends; nothing is changed until the whole step is planned.
        order: list[Sequence] = []
        riders: list[Sequence] = []   # no RPC of their own, but blocks to commit
        local: list[tuple[Sequence, list[int]]] = []   # appends that stay in the process
        free_set = set(frees)
        planned = ([(s, appends.get(s)) for s in dict.fromkeys([*frees, *forks, *appends])]
                   if frees or forks else appends.items())
        for s, tokens in planned:
            if s.__class__ is not Sequence and not isinstance(s, Sequence) or s.client is not self:
                raise ValueError(f"{s!r} is not a sequence of this client")
            if s.freed:
                raise freed_error(s)
            if tokens:
                for t in tokens:
                    if t.__class__ is not int and (not isinstance(t, int) or isinstance(t, bool)):
                        raise TypeError(f"token ids must be int, got {t!r} for sequence {s.id}")
            added = len(tokens) if tokens else 0
            n = s._num_tokens
            # An RPC when it frees or forks, outgrows its block table, or writes into a
            # partial last block that may be shared.
            if not ((forks and s in forks) or (free_set and s in free_set)
                    or (added and (n + added > len(s._table) * s.block_size
                                   or (not s._private and n % s.block_size != 0)))):
                if (n if n < s._written else s._written) // s.block_size > s._committed:
                    riders.append(s)
                else:
                    local.append((s, tokens))
                continue
            order.append(s)
        result = StepResult()
        if not order and not creates and not (riders and self.commit_after_write):
            # (written blocks to commit make the call: their hashes are announced now)
            if self._doubts:
                self._settle_doubts()
                for s in appends:
                    if s.lost:
                        raise freed_error(s)
            for s, tokens in appends.items():
                s._tail.extend(tokens)
                s._num_tokens += len(tokens)
            return result
        request = pb.StepRequest(lease_id=self.lease_id)
        for s in order:
            added = len(appends.get(s, ()))
            request.updates.add(
                sequence_id=s.id, num_tokens=s._num_tokens, parent_hash=s._last_hash,
                commits=s._pending_commits(), free=s in free_set,
                fork_grow_to=[s._num_tokens + len(t) for t in forks.get(s, ())],
                grow_to=s._num_tokens + added if added else 0)
        for tokens, pool, extra in creates:
            request.creates.add(token_ids=tokens, pool_id=pool, extra_key=extra,
                                defer_commits=self.commit_after_write)
        request.tier_loads = bool(creates) and self.collect_tier_orders
        request.fetches = request.tier_loads and self.collect_fetches
        # Sequences with blocks to commit ride along for free.
        for s in riders:
            order.append(s)
            request.updates.add(sequence_id=s.id, num_tokens=s._num_tokens,
                                parent_hash=s._last_hash, commits=s._pending_commits())
        # The generation of every pool the step may touch (a create without a pool may land
        # in any pool this client holds something in).
        gens = self._generations
        named = {s.pool for s in order} | {pool for _, pool, _ in creates if pool}
        for pool in (gens if any(not pool for _, pool, _ in creates) else named):
            if gens.get(pool):
                request.generations[pool] = gens[pool]
        key = step_key(request)
        request.request_id = self._request_id_for(key) if self._doubts else new_request_id()
        for s in order:
            if s.lost:
                raise freed_error(s)      # (lost in the resync that settled a step in doubt)
        if sync is not None:
            request.sync.CopyFrom(sync[0])
        result.rpc = True
        try:
            response = self._call(self.stub.Step, request)
            failed: set[str] = set()
        except errors.KvsError as exc:
            if isinstance(exc, (errors.Unavailable, errors.DeadlineExceeded)):
                self._doubt(key, request)      # (made or not: retried or settled later)
            if exc.partial is None:
                exc.retry = (appends, forks, frees, creates)
                raise
            response = exc.partial
            # A pool failed if any of its items has no result: another pool's refusal (its
            # items all empty), or its own after a step in parts had applied its commits and
            # frees (docs/allocator.md, "Big operations in bounded calls"): those are kept.
            failed = {u.sequence_id.split("/")[0] for u, d in zip(request.updates, response.updates)
                      if not d.sequence_id}
            failed |= {u.sequence_id.split("/")[0] for u in request.updates[len(response.updates):]}
            failed |= {c.pool_id for c, made in zip(request.creates, response.created) if not made.sequence_id}
            failed |= set(response.failed_pools)
            self._apply(response, order, appends, forks, frees, creates, failed, result, local)
            exc.result = result  # the applied pools' copies, children and creates
            made = list(response.created) + [pb.Sequence()] * (len(creates) - len(response.created))
            exc.retry = ({s: t for s, t in appends.items() if s.pool in failed and not s.freed},
                         {s: k for s, k in forks.items() if s.pool in failed},
                         [s for s in frees if s.pool in failed and not s.freed],
                         [c for c, state in zip(creates, made) if not state.sequence_id])
            raise
        if sync is not None:
            self._synced(response.sync, sync[1], sync[2])
        self._apply(response, order, appends, forks, frees, creates, failed, result, local)
        return result

    def _apply(self, response: pb.StepResponse, order: list[Sequence], appends: dict, forks: dict,
               frees: list, creates: list, failed: set[str], result: StepResult,
               local: list[tuple[Sequence, list[int]]] | None = None) -> None:
        """Applies a step's response; ``local``: the appends that took no part in the RPC
        (default: every append whose sequence is not in ``order``). In remote mode the
        client's own record of its live sequences (for a resync) follows."""
        remote = not self.local
        self._heard(response.generations.items())
        if response.grants:
            self._add_grants(response.grants)
        if response.tier_orders:
            self._add_tier_orders(response.tier_orders)
        for s, d in zip(order, response.updates):
            if not d.sequence_id:
                continue
            if d.freed:
                s.freed = True
                if remote:
                    self._live.discard(s)
                continue
            s._apply_commits(d.num_committed_blocks, d.last_hash)
            if s.pool in failed:
                continue          # (its commits were applied, the rest refused)
            kids = []
            for child_state, tokens in zip(d.children, forks.get(s, ())):
                bs = s.block_size
                tail = s._tail[: s._num_tokens - s._committed * bs] + list(tokens)
                child = Sequence(self, child_state, tail, private=bool(tokens))
                child.num_cached_tokens, child._written = s.num_cached_tokens, s._written
                if remote:
                    child._hashes = None if s._hashes is None else s._hashes[:child._committed]
                    self._live.add(child)
                kids.append(child)
            if kids:
                result.children[s.id] = kids
            tokens = appends.get(s, [])
            if d.HasField("cow"):
                s._table[-1] = d.cow.dst
            s._table.extend(d.new_blocks)
            if tokens:
                s._tail.extend(tokens)
                s._num_tokens += len(tokens)
                s._private = True
            elif s in forks:
                s._private = False
        if local is None:
            ordered = set(order)
            local = [(s, tokens) for s, tokens in appends.items() if s not in ordered]
        if failed:
            local = [(s, tokens) for s, tokens in local if s.pool not in failed]
        for s, tokens in local:   # no allocator change: the tokens fit in a private block
            s._tail.extend(tokens)
            s._num_tokens += len(tokens)
        for state, (tokens, _, _) in zip(response.created, creates):
            if state.sequence_id:
                c = state.num_committed_blocks * state.block_size
                seq = Sequence(self, state, list(tokens[c:]), private=True)
                self._epochs[seq.pool] = seq.epoch
                if remote:
                    seq._hashes = list(state.block_hashes)
                    self._live.add(seq)
                result.created.append(seq)
        result.copies.extend(CopyPair(c.pool_id, c.src, c.dst) for c in response.copies)

    # ------------------------------------------------------------ local ownership (``local``)
    def _check_alive(self) -> None:
        """LeaseExpired once the lease may have expired (the fence, on our own clock)."""
        if self.lease_error is not None:
            raise self.lease_error
        if self.journal_error is not None:
            raise self.journal_error
        if time.monotonic() > self._alive_until:
            self.lease_error = errors.LeaseExpired(
                f"lease {self.lease_id} may have expired: no keep-alive went through for "
                f"{self.lease.ttl_seconds:g} s minus a margin; no further change is made")
            raise self.lease_error

    def migrate(self, seq: Sequence, pool: str = "") -> Sequence:
        """Moves a live sequence to another pool (DESIGN §13): a copy of it is made in
        ``pool`` ("": where the allocator places it), whose blocks are filled from the old
        ones by fetch orders (queued for ``take_tier_orders``: run them before computing on
        the copy), and the old sequence is freed by the allocator (its blocks stay pinned
        until the fetches ran). Returns the copy; ``seq`` is freed. Needs ``collect_tier_orders`` (a client
        whose workers run the orders).

        Raises:
            FailedPrecondition: no worker runs this client's orders; the destination is
                draining. ResourceExhausted: too few blocks there. Nothing changed then.
        """
        if seq.freed or seq.lost:
            raise freed_error(seq)
        if not self.collect_tier_orders:
            raise errors.FailedPrecondition("migrate needs a client whose workers run its fetch orders "
                                            "(collect_tier_orders)")
        self.flush()          # (local mode: the allocator's record of the sequence is ours)
        hashes = self._committed_hashes(seq)
        reply = self._call(self.stub.MigrateSequence, pb.MigrateSequenceRequest(
            lease_id=self.lease_id, sequence_id=seq.id, pool_id=pool, block_hashes=b"".join(hashes),
            request_id=new_request_id()))
        state = reply.sequence
        copy = Sequence(self, state, list(seq._tail), private=True)
        copy._num_tokens = seq._num_tokens   # (remote mode: appends into a private block are ours alone so far)
        self._heard([(state.pool_id, state.generation)])
        self._epochs[copy.pool] = copy.epoch
        if self.local:
            self._adopt([copy])
        else:
            copy._hashes = list(hashes)
            self._live.add(copy)
        if state.HasField("grant"):
            self._add_grants([state.grant])
        self._add_tier_orders(reply.fetches)
        self._moved(seq)
        return copy

    def _moved(self, seq: Sequence) -> None:
        """``seq`` was freed by its migration: its blocks leave this client's tables, none
        for its reserve (the migration's pin holds them)."""
        with self._lock:
            if self.local:
                pj = self._journals[seq.pool]
                refs = pj.refs
                for b in seq._table:
                    r = refs.get(b, 0) - 1
                    if r > 0:
                        refs[b] = r
                    else:
                        refs.pop(b, None)
                        pj.hash_of.pop(b, None)
            seq.freed = True
            seq._room = 0
            self._live.discard(seq)

    def leave_pool(self, pool_id: str) -> None:
        """Stops keeping blocks in reserve in ``pool_id`` (a pool being drained: ``kvservice
        drain``): the next Syncs give its reserve back and ask for none. Sequences there
        are the caller's to migrate or free."""
        with self._lock:
            pj = self._journals.get(pool_id) if self.local else None
            if pj is not None:
                pj.leaving = True
        if self.local:
            self.flush()

    def _committed_hashes(self, seq: Sequence) -> list[bytes]:
        """The hash of each committed block of ``seq``, as this client recorded them."""
        if self.local:
            known = self._journals[seq.pool].hash_of
            hashes = [known.get(b) for b in seq._table[:seq._committed]]
        else:
            hashes = list(seq._hashes or [])[:seq._committed]
            hashes += [None] * (seq._committed - len(hashes))
        if any(h is None for h in hashes):
            raise errors.FailedPrecondition(f"sequence {seq.id}: the hash of a committed block is unknown here; "
                                            "it cannot be migrated")
        return hashes

    def get(self, sequence_id: str) -> pb.Sequence:
        """The allocator's view of a sequence."""
        return self._call(self.stub.GetSequence, pb.GetSequenceRequest(sequence_id=sequence_id), idempotent=True)

    # ------------------------------------------------------------ pools and admin

    def register_pool(self, pool_id: str, *, num_blocks: int, block_size: int = 16, num_layers: int = 1,
                      num_kv_heads: int = 1, head_dim: int = 64, dtype: str = "float16",
                      worker_address: str = "", host_tier_blocks: int = 0, disk_tier_blocks: int = 0,
                      disk_tier_kept: bool = False, role: str = "") -> pb.Pool:
        geometry = Geometry(num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype).to_pb()
        return self._call(self.stub.RegisterPool, pb.RegisterPoolRequest(
            pool_id=pool_id, geometry=geometry, worker_address=worker_address, request_id=new_request_id(),
            host_tier_blocks=host_tier_blocks, disk_tier_blocks=disk_tier_blocks, disk_tier_kept=disk_tier_kept,
            role=role))

    # ------------------------------------------------------------ grants
    def _add_grants(self, grants) -> None:
        with self._lock:
            for g in grants:
                kept = self._grants.setdefault(g.pool_id, [])
                kept.append(g)
                if len(kept) > MAX_PENDING_GRANTS:      # (a client that never takes them: the oldest go)
                    del kept[:len(kept) - MAX_PENDING_GRANTS]

    def take_grants(self, pool_id: str, epoch: int) -> list[pb.Grant]:
        """The allocator's grants of the blocks this client got in ``pool_id`` at ``epoch``
        since the last call (``kvservice.v1.Grant``: signed for that pool's worker, which
        checks the blocks of each call against the grants it has seen): send them with the
        next call to the pool's worker, and ``requeue_grants`` them if that call fails.
        Grants of another epoch, or of another generation than the pool's as last heard,
        are void and dropped."""
        with self._lock:
            grants = self._grants.pop(pool_id, [])
            generation = self._generations.get(pool_id, 0)
        return [g for g in grants if g.epoch == epoch and (not generation or g.generation == generation)]

    def requeue_grants(self, grants: list[pb.Grant]) -> None:
        """Grants taken for a call that failed: they go with the next one (a worker that
        had admitted them already admits them again at no cost)."""
        with self._lock:
            for g in grants:
                self._grants.setdefault(g.pool_id, []).insert(0, g)

    # ------------------------------------------------------------ lower tiers (DESIGN §12)
    def _add_tier_orders(self, orders) -> None:
        if self.collect_tier_orders:
            with self._lock:
                self._tier_orders.extend(orders)

    def take_tier_orders(self) -> list[pb.TierOrder]:
        """The lower tiers' orders of the steps and Syncs answered since the last call, in
        the order the pools gave them (``collect_tier_orders`` on). Each pool's must reach
        its worker (``MoveBlocks``) before the next forward that writes its blocks."""
        with self._lock:
            out, self._tier_orders = self._tier_orders, []
        return out

    def settle_tiers(self, pool_id: str, epoch: int, settled: list[pb.TierSettlement],
                     release_pins: list[str] = (), forget: list[pb.TierOrder] = (),
                     unwritten: list[tuple[str, int]] = ()) -> int:
        """Passes on the worker's word on a pool's lower-tier orders (each settlement names
        its order, as the allocator gave it), releases the read pins of its fetches that ran,
        drops the hashes of the device blocks that the loads and fetches of ``forget``
        failed to fill, and those of the blocks of this client's sequences that a failed
        forward never wrote (``unwritten``: (sequence id, first block never written))
        (``SettleTiers``); returns how many entries were settled."""
        reply = self._call(self.stub.SettleTiers, pb.SettleTiersRequest(
            pool_id=pool_id, epoch=epoch, settled=settled, release_pins=release_pins, forget=forget,
            lease_id=self.lease_id if unwritten else "",
            unwritten=[pb.UnwrittenBlocks(sequence_id=s, first_block=k) for s, k in unwritten]), idempotent=True)
        return reply.num_settled

    def pools(self) -> list[pb.Pool]:
        """Every pool (ListPools, page after page)."""
        out: list[pb.Pool] = []
        token = ""
        while True:
            reply = self._call(self.stub.ListPools, pb.ListPoolsRequest(page_size=1000, page_token=token),
                               idempotent=True)
            out.extend(reply.pools)
            token = reply.next_page_token
            if not token:
                return out

    def drain_pool(self, pool_id: str, *, undo: bool = False) -> pb.Pool:
        """Admin: marks a pool as being drained (``DrainPool``), or no more (``undo``)."""
        return self._call(self.stub.DrainPool, pb.DrainPoolRequest(pool_id=pool_id, undo=undo), idempotent=True)

    def unregister_pool(self, pool_id: str, *, force: bool = False) -> pb.UnregisterPoolResponse:
        """Admin: removes a drained pool from the registry (``UnregisterPool``)."""
        return self._call(self.stub.UnregisterPool, pb.UnregisterPoolRequest(pool_id=pool_id, force=force))

    def pool_stats(self, pool_id: str) -> pb.PoolStats:
        return self._call(self.stub.GetPoolStats, pb.GetPoolStatsRequest(pool_id=pool_id), idempotent=True)

    def audit(self, pool_id: str = "") -> pb.AuditResponse:
        return self._call(self.stub.Audit, pb.AuditRequest(pool_id=pool_id), idempotent=True)

    # ------------------------------------------------------------ plumbing

    def _call(self, method, request, *, idempotent: bool = False):
        """One RPC with this client's deadline.

        The channel's retry policy resends it on UNAVAILABLE, to any replica that is up,
        for ``retry_budget`` seconds (``kvservice.channel``). What that policy cannot do
        is done here: a call that ran out of its deadline (a replica or a Redis that
        hangs, or a stall, rather than one that is down: gRPC's deadline covers all
        attempts), or that a replica cancelled as it shut down, is sent again, unchanged,
        while the retry budget lasts (once at least), if a second delivery is harmless: it
        has a ``request_id``, or it is ``idempotent`` (a read); round_robin sends it to the
        next replica.
        """
        self.rpc_count += 1
        again = idempotent or bool(getattr(request, "request_id", ""))
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return method(request, timeout=self.timeout)
            except grpc.RpcError as exc:
                if not (again and exc.code() in RESENT) or (attempt and time.monotonic() - start > self.retry_budget):
                    raise to_domain_error(exc) from None
                attempt += 1
                if exc.code() == grpc.StatusCode.CANCELLED:
                    time.sleep(min(0.05 * attempt, 0.5))     # (a replica shutting down: the next one)

    def _keep_alive(self) -> None:
        """A KeepAlive every TTL / 3 (``keepalive`` without ``local``: in local mode the
        flusher's Sync keeps the lease alive). Each has a deadline of TTL / 3 and the
        channel's retry policy, which fails it over to another replica; one that fails
        all the same is sent again after a short pause, until the allocator says the
        lease is gone. A success moves the fence (``_alive_until``) on."""
        ttl = self.lease.ttl_seconds
        interval = max(ttl / 3, 0.05)
        wait = interval
        while not self._stop.wait(wait):
            sent_at = time.monotonic()
            try:
                self.stub.KeepAlive(pb.KeepAliveRequest(lease_id=self.lease_id), timeout=interval)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    self.lease_error = to_domain_error(exc)
                    return
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    # not a replica or Redis away: say so (the lease may be reaped meanwhile)
                    self.keep_alive_error = to_domain_error(exc)
                    _log.warning("keep-alive of lease %s failed: %s %s", self.lease_id, exc.code().name,
                                 exc.details())
                wait = min(interval, 0.05)   # UNAVAILABLE past the retry policy, a deadline: again soon
                continue
            self.keep_alive_error = None
            self._alive_until = max(self._alive_until, sent_at + fence_seconds(ttl))
            wait = interval
            if self._doubts:
                self._settle_doubts(background=True)

    def close(self, *, revoke: bool = True) -> None:
        """Stops the keep-alive and, with ``revoke``, frees every sequence of this client."""
        if self.closed:
            return
        self._stop.set()
        self._wake.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
        if self.local and not revoke and self.lease_error is None:
            self.flush()
        try:
            if revoke:
                try:
                    self._call(self.stub.RevokeLease, pb.RevokeLeaseRequest(lease_id=self.lease_id),
                               idempotent=True)
                except (errors.NotFound, errors.FailedPrecondition):
                    pass  # the lease is gone already, and its sequences with it
        finally:
            self.closed = True
            self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_step(client: Client, appends: dict, forks: dict, frees: list) -> None:
    for s in [*forks, *frees]:
        if not isinstance(s, Sequence) or s.client is not client:
            raise ValueError(f"{s!r} is not a sequence of this client")
    seen = defaultdict(int)
    for s in frees:
        seen[s] += 1
        if seen[s] > 1:
            raise ValueError(f"sequence {s.id} is freed twice in one step")
    # (Appends are checked by Client.step's planning loop, which visits every sequence.)
    for s in [*appends, *forks, *frees]:
        if seen and s in seen and (s in appends or s in forks):
            raise ValueError(f"sequence {s.id} cannot be freed and appended to or forked in one step")
    for s, children in forks.items():
        if not isinstance(children, list) or not all(isinstance(c, list) for c in children):
            raise TypeError(f"forks[{s.id}] must be a list with one token list per child")
        # A child's tokens stay local until its block is committed: check them now.
        for t in (t for tokens in children for t in tokens):
            if not isinstance(t, int) or isinstance(t, bool):
                raise TypeError(f"token ids must be int, got {t!r} for a child of sequence {s.id}")


def _merged(a: StepResult, b: object) -> StepResult:
    """Two parts of one step's result, in order (``b`` may be an error's missing result)."""
    if not isinstance(b, StepResult):
        return a
    children = dict(a.children)
    for parent, kids in b.children.items():
        children[parent] = children.get(parent, []) + kids
    return StepResult(a.copies + b.copies, a.created + b.created, children, a.rpc or b.rpc)
