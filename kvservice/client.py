"""The Python SDK: a client that holds a lease, and sequence handles.

The hot path stays off the network (DESIGN §5): each ``Sequence`` keeps its block table,
length and the tokens of its uncommitted blocks locally. Appending tokens that fit in a
private last block changes only local state; the allocator is called when ownership
changes (a block boundary is crossed, the last block is shared, fork, free), and all such
changes of one engine step go in one ``Step`` RPC. Full blocks are committed to the
prefix cache with the next RPC that the sequence takes part in (or its free).

Example::

    from kvservice.client import Client

    with Client("127.0.0.1:50051", tenant="acme") as client:
        seq = client.create(prompt_ids)              # prefix-cached blocks are shared
        print(seq.block_table, seq.num_cached_tokens)
        seq.append([42])                             # no RPC inside a private block
        child = seq.fork()                           # shares every block
        res = client.step({seq: [7], child: [9]})    # one RPC; res.copies = CoW pairs
        child.free(); seq.free()
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvservice import errors
from kvservice.channel import open_channel
from kvservice.common import hashing
from kvservice.common.geometry import Geometry
from kvservice.journal import COPY, FORK, FREE, GROW, PoolJournal
from kvservice.v1 import allocator_pb2 as pb
from kvservice.v1 import allocator_pb2_grpc as pb_grpc


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
                 "_prompt_hashes", "lost", "freed", "__weakref__")

    def __init__(self, client: "Client", state: pb.Sequence, tail: list[int], private: bool) -> None:
        self.client = client
        self.id = state.sequence_id
        self.number = int(self.id.rsplit("/", 1)[1])   # n of <pool>/<epoch>/<n>
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

    def append(self, token_ids: Iterable[int]) -> StepResult:
        """Appends tokens; calls the allocator only when ownership changes."""
        return self.client.step({self: list(token_ids)})

    def fork(self, token_ids: Iterable[int] = ()) -> "Sequence":
        """A child that shares every block; ``token_ids`` are appended to the child only."""
        return self.client.step(forks={self: [list(token_ids)]}).children[self.id][0]

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

    def _pending_commits(self) -> list[pb.BlockCommit]:
        bs = self.block_size
        full = self._num_tokens // bs - self._committed
        return [pb.BlockCommit(index=self._committed + i, token_ids=self._tail[i * bs:(i + 1) * bs])
                for i in range(full)]

    def _apply_commits(self, committed: int, last_hash: bytes) -> None:
        drop = (committed - self._committed) * self.block_size
        if drop:
            del self._tail[:drop]
        self._committed = committed
        self._last_hash = last_hash


class Client:
    """A connection to the allocator with one lease, kept alive in the background.

    Args:
        target: the allocator's replicas: ``host:port``, ``"host1:port1,host2:port2"`` or a
            list of ``host:port`` (or one gRPC target, e.g. ``dns:///name:port``). Calls go
            to any replica that is up (gRPC's ``round_robin``) and are resent unchanged,
            same request id, when their replica fails (``kvservice.channel``).
        tenant: the tenant name (prefix-cache salt).
        lease_ttl: seconds the allocator waits after the last keep-alive before freeing
            every sequence of this client.
        timeout: per-RPC deadline in seconds.
        keepalive: run the keep-alive thread (every ``lease_ttl / 3`` seconds).
        retry_budget: seconds a call keeps being resent while no replica answers it (the
            retry policy's backoffs add up to this; the ``timeout`` bounds it too): more
            than a replica's restart.
    """

    def __init__(self, target: str | list[str], *, tenant: str = "default", lease_ttl: float = 10.0,
                 timeout: float = 10.0, keepalive: bool = True, local: bool = False,
                 flush_interval: float = 0.005, retry_budget: float = 5.0) -> None:
        self.target = target
        self.timeout = timeout
        self.channel = open_channel(target, retry_budget)
        self.stub = pb_grpc.AllocatorStub(self.channel)
        self.rpc_count = 0          # RPCs made on the caller's thread, keep-alives excepted
        self.closed = False
        self.lease_error: errors.KvsError | None = None
        #: With ``local``: growth, copy-on-write, commits, forks and frees change local state
        #: at once and reach the allocator through the journal (``Sync``, in the background).
        self.local = local
        self.flush_interval = flush_interval
        self.sync_count = 0         # Syncs sent by the flusher thread
        self.journal_error: errors.KvsError | None = None
        self._journals: dict[str, PoolJournal] = {}
        self._live: set[Sequence] = set()      # (local) the sequences not freed
        self._lost: list[Sequence] = []         # (local) lost in resyncs, not yet taken
        self._resyncing = False                 # (local) a pool must resync first
        self._sent_at = 0.0                     # (local) when the last Sync went out
        self._unanswered: tuple[pb.SyncRequest, list[PoolJournal]] | None = None   # (local) to send again
        #: Creates whose reply never came: sent again (same request id) until answered,
        #: then their sequences freed: the caller was told they failed.
        self._doubtful: list[pb.StepRequest] = []
        self._doubt_lock = threading.Lock()
        self.resync_count = 0
        self._lock = threading.RLock()
        self._sync_lock = threading.Lock()
        self._wake = threading.Event()
        granted_at = time.monotonic()
        self.lease = self._call(self.stub.GrantLease, pb.GrantLeaseRequest(
            tenant=tenant, ttl_seconds=lease_ttl, request_id=_request_id()))
        self._alive_until = granted_at + _fence(self.lease.ttl_seconds)
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
        """One engine step over many sequences: at most one RPC.

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
                created sequences in ``result``.
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
        if self.local:
            return self._step_local(appends, forks, frees, creates)
        return self._step_remote(appends, forks, frees, creates)

    def _step_remote(self, appends: dict, forks: dict, frees: list, creates: list) -> StepResult:
        """A step whose ownership changes go to the allocator in one Step RPC."""
        self._check_alive()
        if self._doubtful and not self.local and self._keeper is None:
            self._settle()       # (no keep-alive thread to do it)
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
                raise ValueError(f"sequence {s.id} was freed")
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
                if n // s.block_size > s._committed:
                    riders.append(s)
                else:
                    local.append((s, tokens))
                continue
            order.append(s)
        result = StepResult()
        if not order and not creates:
            for s, tokens in appends.items():
                s._tail.extend(tokens)
                s._num_tokens += len(tokens)
            return result
        request = pb.StepRequest(lease_id=self.lease_id, request_id=_request_id())
        for s in order:
            added = len(appends.get(s, ()))
            request.updates.add(
                sequence_id=s.id, num_tokens=s._num_tokens, parent_hash=s._last_hash,
                commits=s._pending_commits(), free=s in free_set,
                fork_grow_to=[s._num_tokens + len(t) for t in forks.get(s, ())],
                grow_to=s._num_tokens + added if added else 0)
        for tokens, pool, extra in creates:
            request.creates.add(token_ids=tokens, pool_id=pool, extra_key=extra)
        # Sequences with blocks to commit ride along for free.
        for s in riders:
            order.append(s)
            request.updates.add(sequence_id=s.id, num_tokens=s._num_tokens,
                                parent_hash=s._last_hash, commits=s._pending_commits())
        result.rpc = True
        try:
            response = self._call(self.stub.Step, request)
            failed: set[str] = set()
        except errors.KvsError as exc:
            if isinstance(exc, (errors.Unavailable, errors.DeadlineExceeded)) and request.creates \
                    and not request.updates:
                with self._doubt_lock:     # made or not: settled later (no orphan either way)
                    self._doubtful.append(request)
            if exc.partial is None:
                raise
            response = exc.partial
            failed = {u.sequence_id.split("/")[0] for u in request.updates} | {c.pool_id for c in request.creates}
            failed -= {d.sequence_id.split("/")[0] for d in response.updates if d.sequence_id}
            failed -= {c.pool_id for c in response.created if c.sequence_id}
            self._apply(response, order, appends, forks, frees, creates, failed, result, local)
            exc.result = result  # the applied pools' copies, children and creates
            raise
        self._apply(response, order, appends, forks, frees, creates, failed, result, local)
        return result

    def _apply(self, response: pb.StepResponse, order: list[Sequence], appends: dict, forks: dict,
               frees: list, creates: list, failed: set[str], result: StepResult,
               local: list[tuple[Sequence, list[int]]] | None = None) -> None:
        """Applies a step's response; ``local``: the appends that took no part in the RPC
        (default: every append whose sequence is not in ``order``)."""
        for s, d in zip(order, response.updates):
            if not d.sequence_id:
                continue
            if d.freed:
                s.freed = True
                continue
            s._apply_commits(d.num_committed_blocks, d.last_hash)
            kids = []
            for child_state, tokens in zip(d.children, forks.get(s, ())):
                bs = s.block_size
                tail = s._tail[: s._num_tokens - s._committed * bs] + list(tokens)
                child = Sequence(self, child_state, tail, private=bool(tokens))
                child.num_cached_tokens = s.num_cached_tokens
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
                result.created.append(Sequence(self, state, list(tokens[c:]), private=True))
        result.copies.extend(CopyPair(c.pool_id, c.src, c.dst) for c in response.copies)

    # ------------------------------------------------------------ local ownership (``local``)

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
            try:
                self._step_journaled(slow, forks, frees, result)
            except BaseException as exc:
                if slow is not appends:
                    with self._lock:
                        self._undo_fast(appends, slow)
                if created is not None and isinstance(exc, errors.KvsError):
                    exc.result = StepResult(copies=list(created.copies), created=created.created, rpc=True)
                raise
        if created is not None:
            result.created = created.created
            result.copies.extend(created.copies)
            result.rpc = True
        return result

    def _create_local(self, creates: list) -> StepResult:
        """The step's creates, in one call; the new sequences join the local state. The
        prefix lookup needs no pending change applied first (a pending commit can only make
        it miss, a pending free only leave a block referenced a little longer); the pool's
        capacity may: refused, the lease gives its reserve back in the refusing pool (a
        create cannot take reserved blocks), the journal is flushed and the call made once
        more."""
        try:
            try:
                created = self._step_remote({}, {}, [], creates)
            except errors.ResourceExhausted as exc:
                with self._lock:
                    pj = self._journals.get(exc.pool_id)
                    if pj is not None and pj.reserve:
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
                raise _freed(s)
            for t in tokens:
                if t.__class__ is not int and (not isinstance(t, int) or isinstance(t, bool)):
                    raise TypeError(f"token ids must be int, got {t!r} for sequence {s.id}")
        for s in (*forks, *frees):
            if s.freed:
                raise _freed(s)

    def _step_journaled(self, appends: dict, forks: dict, frees: list, result: StepResult) -> None:
        """The step's frees, forks and appends that change ownership: checked, covered by
        the reserves (a synchronous Sync when they are not), then applied and journaled."""
        self._check_local(appends, forks, frees)
        if frees:
            # First, and whatever becomes of the rest: the blocks they release serve the
            # step (partial ones back in the reserve; the others once the Sync that covers
            # the step has applied the frees).
            with self._lock:
                for s in frees:
                    self._free_local(s)
        self._ensure_reserves(appends, forks)
        try:
            with self._lock:
                self._apply_local(appends, forks, result)
        finally:
            for pj in self._journals.values():
                pj.floor = 0
        # Send now, unless a Sync went out less than flush_interval ago: the step is done,
        # and an engine is about to wait for its forward pass (a Sync sent then does not
        # compete with the next step for the interpreter).
        if time.monotonic() - self._sent_at >= self.flush_interval:
            self._wake.set()

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
        if pj is None:
            pj = self._journals[s.pool] = PoolJournal(s.pool, s.epoch, s.block_size)
        return pj

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
                pool, (blocks, _) = next(iter(short.items()))
                have = len(self._journals[pool].reserve)
                raise errors.ResourceExhausted(f"pool {pool}: the step needs up to {blocks} blocks, the lease's "
                                               f"reserve holds {have}", pool_id=pool, needed=blocks, available=have)
            self._sync_once(short, recheck=shortfall)

    def _blocks_for(self, s: "Sequence", added: int, forked: bool) -> int:
        bs = s.block_size
        t = s._num_tokens
        copy = 1 if t % bs and (forked or self._journals[s.pool].shared(s._table[-1])) else 0
        return copy + max(0, -(-(t + added) // bs) - len(s._table))

    def _append_local(self, s: "Sequence", tokens: list[int], result: StepResult) -> None:
        pj = self._journals[s.pool]
        bs = s.block_size
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
        if blocks or t1 // bs > s._committed:
            self._log_grow(pj, s, blocks)
        # (else: the allocator learns this length with the sequence's next entry, or at a flush)
        s._room = _room(s)

    @staticmethod
    def _log_grow(pj: PoolJournal, s: "Sequence", blocks: list[int] = ()) -> None:
        """One GROW entry at the sequence's length: the blocks it added and the full
        blocks not committed yet (with their hashes). A block that fills on the fast
        path is committed here, with the sequence's next entry (its next block, a fork,
        a free or a flush): one entry per block in decode, not two."""
        t1, bs = s._num_tokens, s.block_size
        k = t1 // bs - s._committed
        if k > 0:
            parent = last = s._last_hash
            data = s._tail[:k * bs]
            hash_of, at, table = pj.hash_of, s._committed, s._table
            for i in range(0, k * bs, bs):
                last = hash_of[table[at]] = hashing.block_hash(last, data[i:i + bs])
                at += 1
            pj.log(GROW, s.number, t1, blocks, commit_tokens=data, num_commits=k, parent_hash=parent)
            s._apply_commits(t1 // bs, last)
        else:
            pj.log(GROW, s.number, t1, blocks)
        s._logged = t1

    def _fork_local(self, s: "Sequence") -> "Sequence":
        pj = self._journals[s.pool]
        if s._num_tokens // s.block_size > s._committed:
            self._log_grow(pj, s)        # (its full blocks committed before they are shared)
        n = pj.numbers.popleft()
        state = pb.Sequence(sequence_id=f"{s.pool}/{s.epoch}/{n}", pool_id=s.pool, epoch=s.epoch,
                            block_table=s._table, num_tokens=s._num_tokens, num_cached_tokens=s.num_cached_tokens,
                            num_committed_blocks=s._committed, last_hash=s._last_hash, block_size=s.block_size)
        child = Sequence(self, state, list(s._tail), private=False)
        pj.hold(s._table)
        pj.log(FORK, s.number, s._num_tokens, child=n)
        s._logged = child._logged = s._num_tokens
        s._room = 0      # the partial last block is shared now: the next write copies it
        self._live.add(child)
        return child

    def _free_local(self, s: "Sequence") -> None:
        pj = self._journals[s.pool]
        if s._num_tokens // s.block_size > s._committed:
            self._log_grow(pj, s)        # (its full blocks committed: they stay cached)
        pj.log(FREE, s.number, s._num_tokens)
        pj.release(s._table, s._num_tokens)
        s.freed = True
        s._room = 0
        self._live.discard(s)

    def flush(self) -> None:
        """A barrier: returns once the allocator has applied every local change made so
        far (and the lease was kept alive), and the creates whose reply was lost are
        settled (their sequences freed) if the allocator can be reached."""
        if self._doubtful:
            self._settle()
        if not self.local:
            return
        with self._lock:
            for s in self._live:
                if s._num_tokens != s._logged:      # lengths (and full blocks) no entry has said yet
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
            if self._unanswered is not None and not self._exchange(*self._unanswered, background=background):
                return
            if recheck is not None:
                short = recheck()
                if not short:
                    return
            with self._lock:
                journals = list(self._journals.values())
                parts = []
                for pj in journals:
                    if pj.resyncing:
                        parts.append(pj.resync_request(self._claims(pj)))
                        continue
                    part = pj.sync_request()
                    if short and pj.pool_id in short:
                        blocks, numbers = short[pj.pool_id]
                        part["need_blocks"] = blocks
                        part["want_sequence_numbers"] = max(part["want_sequence_numbers"], numbers + pj.NUMBERS)
                    parts.append(part)
            # (built outside the lock: copying the entries into the message takes a while)
            for part in parts:
                if "journal" in part:
                    part["journal"] = pb.JournalEntries(**part["journal"])
            request = pb.SyncRequest(lease_id=self.lease_id, request_id=_request_id(),
                                     pools=[pb.PoolSync(**part) for part in parts])
            self._exchange(request, journals, background=background)

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
        self._unanswered = None
        with self._lock:
            for pj, ack in zip(journals, reply.pools):
                if ack.resynced:
                    self._resynced(pj, ack)
                else:
                    pj.synced(ack)
            self._resyncing = any(j.resyncing for j in self._journals.values())
            self._alive_until = sent_at + _fence(self.lease.ttl_seconds)
        return True

    def _claims(self, pj: PoolJournal) -> list[pb.SequenceClaim]:
        """Every live sequence of the pool as this client holds it (for a resync)."""
        hb = hashing.HASH_BYTES
        missing = bytes(hb)     # (never: every committed block's hash is kept; a wrong one loses the sequence)
        return [pb.SequenceClaim(sequence=s.number, num_tokens=s._num_tokens, block_table=s._table,
                                 num_committed_blocks=s._committed, last_hash=s._last_hash,
                                 block_hashes=b"".join(pj.hash_of.get(b, missing) for b in s._table[:s._committed]),
                                 num_cached_tokens=s.num_cached_tokens)
                for s in self._live if s.pool == pj.pool_id]

    def _resynced(self, pj: PoolJournal, ack: pb.PoolReserve) -> None:
        """A resync's reply: the lost sequences are dropped (see ``lost_sequences``)."""
        lost = set(ack.lost_sequences)
        kept = []
        for s in [s for s in self._live if s.pool == pj.pool_id]:
            if s.number in lost:
                s.lost = s.freed = True
                s._room = 0
                self._live.discard(s)
                self._lost.append(s)
            else:
                kept.append(s._table)
                s._logged = s._num_tokens      # (the claim carried its length)
        pj.resynced(ack, kept)
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
            if self._doubtful:
                self._settle()

    def reserved_blocks(self) -> int:
        """Blocks this client holds in reserve, over all pools (its own view)."""
        with self._lock:
            return sum(len(j.reserve) + len(j.returning) for j in self._journals.values())

    def journal_lags(self) -> list[float]:
        """Seconds from a local change to the allocator's acknowledgement of it, for the
        recent changes of every pool."""
        with self._lock:
            return [lag for j in self._journals.values() for lag in j.lags]

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

    def get(self, sequence_id: str) -> pb.Sequence:
        """The allocator's view of a sequence."""
        return self._call(self.stub.GetSequence, pb.GetSequenceRequest(sequence_id=sequence_id))

    # ------------------------------------------------------------ pools and admin

    def register_pool(self, pool_id: str, *, num_blocks: int, block_size: int = 16, num_layers: int = 1,
                      num_kv_heads: int = 1, head_dim: int = 64, dtype: str = "float16",
                      worker_address: str = "") -> pb.Pool:
        geometry = Geometry(num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype).to_pb()
        return self._call(self.stub.RegisterPool, pb.RegisterPoolRequest(
            pool_id=pool_id, geometry=geometry, worker_address=worker_address, request_id=_request_id()))

    def pools(self) -> list[pb.Pool]:
        return list(self._call(self.stub.ListPools, pb.ListPoolsRequest()).pools)

    def pool_stats(self, pool_id: str) -> pb.PoolStats:
        return self._call(self.stub.GetPoolStats, pb.GetPoolStatsRequest(pool_id=pool_id))

    def audit(self, pool_id: str = "") -> pb.AuditResponse:
        return self._call(self.stub.Audit, pb.AuditRequest(pool_id=pool_id))

    # ------------------------------------------------------------ plumbing

    def _call(self, method, request, *, retries: int = 1):
        """One RPC with this client's deadline.

        The channel's retry policy resends it on UNAVAILABLE, to any replica that is up,
        for ``retry_budget`` seconds (``kvservice.channel``). What that policy cannot do
        is done here: a call that ran out of its deadline (a replica that hangs, stopped
        or cut off, rather than one that is down: gRPC's deadline covers all attempts), or
        that a replica cancelled as it shut down, is sent again, unchanged, up to
        ``retries`` times, if its ``request_id`` makes a second delivery harmless;
        round_robin sends it to the next replica.
        """
        self.rpc_count += 1
        for attempt in range(retries + 1):
            try:
                return method(request, timeout=self.timeout)
            except grpc.RpcError as exc:
                if (exc.code() in _RESENT and attempt < retries
                        and getattr(request, "request_id", None)):
                    continue
                raise to_domain_error(exc) from None
        raise AssertionError("unreachable")

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
                wait = min(interval, 0.05)   # UNAVAILABLE past the retry policy, a deadline: again soon
                continue
            self._alive_until = max(self._alive_until, sent_at + _fence(ttl))
            wait = interval
            if self._doubtful:
                self._settle()

    def _settle(self) -> None:
        """Creates whose reply was lost past the retry policy: each is sent again under its
        request id (the allocator answers a repeat with its first outcome, or makes it now)
        and the sequences it made are freed, so that none is left behind unknown to us."""
        with self._doubt_lock:
            doubtful, self._doubtful = self._doubtful, []
        keep = []
        for request in doubtful:
            try:
                reply = self.stub.Step(request, timeout=self.timeout)
            except grpc.RpcError as exc:
                err = to_domain_error(exc)
                if isinstance(err, (errors.Unavailable, errors.DeadlineExceeded)):
                    keep.append(request)
                elif err.partial is not None:
                    self._free_made(err.partial.created)
                continue
            self._free_made(reply.created)
        if keep:
            with self._doubt_lock:
                self._doubtful[:0] = keep

    def _free_made(self, created: Iterable[pb.Sequence]) -> None:
        ids = [c.sequence_id for c in created if c.sequence_id]
        if ids:
            try:
                self.stub.FreeSequences(pb.FreeSequencesRequest(lease_id=self.lease_id, request_id=_request_id(),
                                                                sequence_ids=ids), timeout=self.timeout)
            except grpc.RpcError:
                pass     # (the lease's end frees them)

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
                    self._call(self.stub.RevokeLease, pb.RevokeLeaseRequest(lease_id=self.lease_id), retries=1)
                except (errors.NotFound, errors.FailedPrecondition):
                    pass  # the lease is gone already, and its sequences with it
        finally:
            self.closed = True
            self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def to_domain_error(exc: grpc.RpcError) -> errors.KvsError:
    """The ``kvservice.errors`` exception for any failed call, with its status details
    (``KvsError`` with the call's ``code`` for a status the service does not send on
    purpose; details that cannot be read are left out, never raised)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    cls = errors.BY_STATUS.get(code, errors.KvsError)
    message = (exc.details() if hasattr(exc, "details") else "") or str(code)
    info = error_details_pb2.ErrorInfo()
    partial = None
    try:
        status = rpc_status.from_call(exc) if hasattr(exc, "trailing_metadata") else None
    except Exception:  # noqa: BLE001 - a malformed or mismatched status: keep code and message
        status = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                detail.Unpack(info)
            elif detail.Is(pb.StepResponse.DESCRIPTOR):
                partial = pb.StepResponse()
                detail.Unpack(partial)
    reason = info.reason or None
    meta = info.metadata
    if reason == "LEASE_EXPIRED":
        cls = errors.LeaseExpired
    if cls is errors.ResourceExhausted:
        err: errors.KvsError = errors.ResourceExhausted(
            message, pool_id=meta.get("pool_id", ""), needed=_int(meta.get("needed")),
            available=_int(meta.get("available")), partial=partial, reason=reason)
    else:
        err = cls(message, partial=partial, reason=reason)
        if cls is errors.KvsError:
            err.code = code
    return err


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0


#: Failures ``Client._call`` sends again (beside the channel policy's UNAVAILABLE).
_RESENT = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _freed(s: Sequence) -> errors.KvsError | ValueError:
    if s.lost:
        return errors.SequenceLost(f"sequence {s.id} was lost when the allocator resynchronised after losing "
                                   "writes: recompute it")
    return ValueError(f"sequence {s.id} was freed")


def _room(s: Sequence) -> int:
    """The length below which appends stay inside the sequence's private last block,
    filling it at most (0 when the next token needs a block: a full last block, or a
    shared one)."""
    return (s._committed + 1) * s.block_size + 1 if len(s._table) > s._committed else 0


def _fence(ttl: float) -> float:
    """How long after a keep-alive was sent the lease is surely still alive: the TTL minus
    a margin (a tenth of it, at least 50 ms) for clock drift and the reply's way back."""
    return ttl - max(0.05, ttl / 10)


def _request_id() -> str:
    return uuid.uuid4().hex


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
