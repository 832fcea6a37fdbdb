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
from typing import Iterable, Mapping

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvservice import errors
from kvservice.common.geometry import Geometry
from kvservice.common.grpc import RETRYABLE
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

    def __init__(self, client: "Client", state: pb.Sequence, tail: list[int], private: bool) -> None:
        self.client = client
        self.id = state.sequence_id
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
        target: ``host:port`` of an allocator replica.
        tenant: the tenant name (prefix-cache salt).
        lease_ttl: seconds the allocator waits after the last keep-alive before freeing
            every sequence of this client.
        timeout: per-RPC deadline in seconds.
        keepalive: run the keep-alive thread (every ``lease_ttl / 3`` seconds).
    """

    def __init__(self, target: str, *, tenant: str = "default", lease_ttl: float = 10.0,
                 timeout: float = 10.0, keepalive: bool = True) -> None:
        self.target = target
        self.timeout = timeout
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.AllocatorStub(self.channel)
        self.rpc_count = 0          # RPCs made by this client, keep-alives excepted
        self.closed = False
        self.lease_error: errors.KvsError | None = None
        self.lease = self._call(self.stub.GrantLease, pb.GrantLeaseRequest(
            tenant=tenant, ttl_seconds=lease_ttl, request_id=_request_id()))
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        if keepalive:
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
                ``StepResult``; ``partial`` is the raw response).
            kvservice.errors.KvsError: any other refusal, with the same guarantee.
        """
        if appends is None:
            appends = {}
        elif appends.__class__ is not dict or not all(t.__class__ is list for t in appends.values()):
            appends = {s: list(t) for s, t in appends.items()}   # (a dict of lists is only read)
        forks = dict(forks or {})
        frees = list(frees)
        creates = [c if isinstance(c, tuple) else (list(c), "", b"") for c in creates]
        if frees or forks:
            _check_step(self, appends, forks, frees)
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

    def _call(self, method, request, *, retries: int = 3):
        """One RPC with this client's deadline; retried with the same request on UNAVAILABLE."""
        self.rpc_count += 1
        delay = 0.05
        for attempt in range(retries + 1):
            try:
                return method(request, timeout=self.timeout)
            except grpc.RpcError as exc:
                if exc.code() in RETRYABLE and attempt < retries and getattr(request, "request_id", None):
                    time.sleep(delay)
                    delay *= 4
                    continue
                raise to_domain_error(exc) from None
        raise AssertionError("unreachable")

    def _keep_alive(self) -> None:
        interval = max(self.lease.ttl_seconds / 3, 0.05)
        while not self._stop.wait(interval):
            try:
                self.stub.KeepAlive(pb.KeepAliveRequest(lease_id=self.lease_id), timeout=interval)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    self.lease_error = to_domain_error(exc)
                    return

    def close(self, *, revoke: bool = True) -> None:
        """Stops the keep-alive and, with ``revoke``, frees every sequence of this client."""
        if self.closed:
            return
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
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
