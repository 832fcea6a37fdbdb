"""A continuous-batching inference engine over the allocator and the workers' ``Forward``.

The SDK runs in local mode by default (DESIGN §5): each engine step's appends, forks and
frees change the client's block tables at once, with no allocator RPC (the journal reaches
the allocator in the background); only the step's creates make one synchronous call, the
prefix lookup being global. ``local=False`` sends every ownership change of the step in
one batched ``Step`` RPC instead. Then one ``Forward`` RPC per worker, all workers in
parallel. Prompts are placed by the allocator, where they cost least (the uncached prompt
tokens plus the pool's load: docs/allocator.md); only their uncached part is computed.
``n > 1`` samples share the prompt through fork and copy-on-write. When a pool runs
short, admission waits and decoding preempts the most recently admitted request, which
is recomputed later from its tokens so far; a worker that fails a step has its requests
recomputed on the other pools. See docs/engine.md for the step loop and the report's
definitions.

The engine is this module's ``Engine`` (the loop and the step), its scheduling
(``scheduler.Scheduler``: admission, creates, preemption, the report's figures), its
forward path (``forward.ForwardPath``: the workers' connections and ``Forward`` calls)
and the requests it serves (``requests``: ``Request``, ``Handle``, ``Completion``...).

Two ways to use it. ``run(requests)`` runs a batch to completion and returns a
``Report``. ``start()`` runs the step loop in a thread; ``submit(request)`` then adds a
request at any time and returns a ``Handle`` that yields the request's ``Output``s as
they are generated (``events()``), its ``Completion`` at the end (``result()``), and
cancels it (``cancel()``: its blocks are freed at the next step).

With a model that has a tokenizer (the workers send it), the engine speaks text:
``engine.tokenizer`` encodes prompts and renders chats, every sample stops at the model's
end-of-sequence tokens (unless ``ignore_eos``) and at the request's ``stop`` strings, and
outputs carry text as well as token ids.

Example: ``Engine("127.0.0.1:50051").run([Request([1, 2, 3], max_new_tokens=8, n=4,
temperature=0.8)])`` returns a ``Report`` with one ``Completion`` of four samples.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import grpc

from kvservice import errors
from kvservice.client import Client, Sequence, StepResult
from kvservice.common.security import ClientCredentials
from kvservice.engine.forward import ForwardPath
from kvservice.engine.requests import (DECODE, FOLLOW, FORK, PREFILL, Completion, EngineBusy, Handle, Output,
                                       Progress, Report, Request, RequestError, _Job)
from kvservice.engine.scheduler import Scheduler
from kvservice.engine.tiers import TierPath
from kvservice.engine.text import Tokenizer
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc

log = logging.getLogger("kvservice.engine")

#: The online loop reads the pool list again this often (seconds) while idle.
REFRESH_S = 10.0


class Engine(Scheduler, ForwardPath, TierPath):
    """Runs requests over the allocator at ``allocator`` and its workers.

    Args:
        allocator: ``host:port`` of an allocator; the workers are its pools'
            ``worker_address``.
        tenant: the lease's tenant (prefix-cache scope); empty: the authenticated identity
            (``credentials``), or "engine" on a server that authenticates nobody.
        credentials: the token and TLS files for the allocator and the workers (default:
            the ``KVSERVICE_*`` variables; ``kvservice.common.security.ClientCredentials``).
        max_num_seqs: running sequences at most.
        max_prefill_tokens: prompt tokens admitted per step at most (a longer prompt is
            admitted alone).
        return_logits: keep every generated token's logits row in the completions.
        progress: called with a ``Progress`` after every step.
        timeout: seconds per RPC.
        local: the SDK's local mode (no allocator RPC on the decode path); False: every
            step's ownership changes in one synchronous ``Step`` RPC.
        max_waiting: ``submit`` refuses a request (``EngineBusy``) while this many wait
            for KV blocks already (0: no bound).
        fetch: a prompt's prefix cached in another pool is fetched from that pool's
            worker (DESIGN §13) rather than recomputed; False: each pool's own cache only.
    """

    def __init__(self, allocator: str, *, tenant: str = "", max_num_seqs: int = 64,
                 max_prefill_tokens: int = 2048, return_logits: bool = False,
                 progress: Callable[[Progress], None] | None = None, timeout: float = 60.0,
                 local: bool = True, credentials: ClientCredentials | None = None, max_waiting: int = 0,
                 fetch: bool = True) -> None:
        self.local = local
        self.credentials = credentials or ClientCredentials.from_env()
        if not tenant and not (self.credentials.token or self.credentials.cert):
            tenant = "engine"
        # (a block's hash is announced once the worker has written its KV: _forward)
        self.client = Client(allocator, tenant=tenant, lease_ttl=30.0, timeout=timeout, local=local,
                             credentials=self.credentials, commit_after_write=True)
        self.client.collect_tier_orders = True     # (run by the workers: kvservice/engine/tiers.py)
        self.client.collect_fetches = fetch
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.return_logits, self.progress, self.timeout = return_logits, progress, timeout
        self.max_waiting = max_waiting
        self._stubs: dict[str, wpb_grpc.WorkerStub] = {}
        self._channels: list[grpc.Channel] = []
        self._num_blocks: dict[str, int] = {}
        self._block_size: dict[str, int] = {}
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvs-forward")
        #: The served model (``worker_pb2.ModelInfo``, without its tokenizer) and, when it
        #: has one, its tokenizer.
        self.model: wpb.ModelInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.report = Report()
        self._waiting: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._to_free: list[Sequence] = []
        self._live: dict[str, Sequence] = {}          # every sequence holding blocks, by id
        self._unwritten: dict[str, set[int]] = {}     # per pool: blocks whose prompt is not computed yet
        #: The first blocks (token tuples) of the prompts this engine prefilled last, oldest
        #: first: a create that shares one needs not wait for another's prefill (_plan_creates).
        self._prefilled: OrderedDict[tuple[int, ...], None] = OrderedDict()
        #: Per (pool, epoch): blocks whose hash promises content they do not hold (a failed
        #: load, or a prompt that a failed step never wrote): computed again by whoever
        #: counts them as cached (kvservice/engine/tiers.py).
        self._tainted: dict[tuple[str, int], set[int]] = {}
        #: Pools whose worker failed a step, and when: a request that asks for one is placed
        #: elsewhere for ``LOST_POOL_S`` (``_pool_of``).
        self._lost_pools: dict[str, float] = {}
        #: Pools being drained (``_move_sequences``); the pool list as the watcher last read
        #: it; each pool's role (both, prefill, decode: RegisterPoolRequest.role).
        self._draining: set[str] = set()
        self._roles: dict[str, str] = {}
        self._listed_pools: dict | None = None
        self._pool_watch: threading.Thread | None = None
        self._closing = threading.Event()
        self._admit_order, self._hold, self._solo = itertools.count(1), False, False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._submitted = itertools.count()
        self._finished = 0
        self.refresh_workers()

    # ------------------------------------------------------------ workers

    def close(self) -> None:
        """Stops the loop (requests still in flight end ``cancelled``), frees every
        sequence (revokes the lease) and closes the connections."""
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            self._thread.join()
            self._thread = None
        self._closing.set()
        if self._pool_watch is not None:
            self._pool_watch.join()
        self._executor.shutdown(wait=True)
        for c in [*self._channels, self.client]:
            c.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ requests

    def check(self, req: Request) -> None:
        """Raises ``RequestError`` (naming the field) unless the engine can serve ``req``:
        it fits in the largest pool when it runs alone, in the model's context and
        vocabulary, and it asks for stop strings only of a model with a tokenizer."""
        vocab = self.model.vocab_size if self.model else 0
        bad = next((t for t in req.prompt if not 0 <= t < vocab), None) if vocab else None
        if bad is not None:
            raise RequestError(f"prompt token {bad} is not in the vocabulary (0..{vocab - 1})", "prompt")
        context = self.model.max_position_embeddings if self.model else 0
        if context and len(req.prompt) + req.max_new_tokens > context:
            raise RequestError(f"the prompt's {len(req.prompt)} tokens + max_new_tokens {req.max_new_tokens} exceed "
                               f"the model's context of {context} tokens", "max_new_tokens")
        need, largest = self._min_blocks(req), max(self._num_blocks.values())
        if need > largest:
            raise RequestError(f"request {req.request_id!r} needs {need} KV blocks at least (prompt of "
                               f"{len(req.prompt)} tokens, max_new_tokens {req.max_new_tokens}, n {req.n}); "
                               f"the largest pool has {largest}", "max_new_tokens")
        if req.stop and self.tokenizer is None:
            raise RequestError("stop strings need a model with a tokenizer; this one speaks token ids", "stop")
        if req.pool and req.pool not in self._num_blocks:
            raise RequestError(f"pool {req.pool!r} is none of the engine's ({', '.join(sorted(self._num_blocks))})",
                               "pool")

    def start(self) -> "Engine":
        """Runs the step loop in a thread, for ``submit``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="kvs-engine", daemon=True)
            self._thread.start()
        return self

    def submit(self, req: Request, on_event: Callable[[Output | Completion], None] | None = None) -> Handle:
        """Adds a request to the running loop (``start()`` first).

        Args:
            req: the request; checked first (``check``).
            on_event: called from the loop's thread with each ``Output`` and, last, the
                ``Completion`` (default: kept for ``Handle.events``).

        Raises:
            RequestError: the request cannot be served (nothing was queued).
            EngineBusy: ``max_waiting`` requests wait already.
        """
        if self._thread is None:
            raise RuntimeError("submit() needs the loop: call start() first (or run() for a batch)")
        self.check(req)
        if self.max_waiting and len(self._waiting) + self._inbox.qsize() >= self.max_waiting:
            raise EngineBusy(f"{len(self._waiting)} requests wait for KV blocks already (at most {self.max_waiting})")
        handle = Handle(self, req, on_event)
        self._inbox.put(("submit", handle))
        self._wake.set()
        return handle

    @property
    def num_running(self) -> int:
        """Requests with sequences in the pools."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be admitted (for KV blocks or a sequence slot)."""
        return len(self._waiting) + self._inbox.qsize()

    # ------------------------------------------------------------ the loop

    def run(self, requests: Iterable[Request]) -> Report:
        """Runs every request to completion; returns the report (sequences all freed).

        A request fails (``Completion.error``) only when it can never fit in the largest
        pool; a pool that is merely short makes requests wait or be preempted.
        """
        if self._thread is not None:
            raise RuntimeError("run() while the loop serves submit(): submit the requests instead")
        start, self.report = time.monotonic(), Report()
        jobs = [_Job(r, i) for i, r in enumerate(requests)]
        for job in jobs:
            self._admit(job)
        while self._busy():
            self._step()
            if self.progress:
                self.progress(Progress(self.report.steps, len(self._running), len(self._waiting),
                                       sum(j.completion is not None for j in jobs), len(jobs), self.report.tokens,
                                       self._used_blocks()))
        self.client.flush()   # local mode: the allocator has applied every free when run returns
        r = self.report
        r.completions = [j.completion for j in jobs]   # in submission order
        r.sharing_saving = 1 - r.peak_blocks / r.peak_unshared_blocks if r.peak_unshared_blocks else 0.0
        r.seconds = round(time.monotonic() - start, 3)
        return r

    def _serve(self) -> None:
        """The online loop: takes submissions and cancellations between steps; sleeps
        when there is nothing to do."""
        jobs: dict[Handle, _Job] = {}
        refreshed = time.monotonic()
        while not self._stopping:
            self._wake.clear()
            self._take_inbox(jobs)
            if not self._busy():
                if time.monotonic() - refreshed > REFRESH_S:   # pools registered since
                    refreshed = time.monotonic()
                    try:
                        self.refresh_workers()
                    except Exception:   # keep serving with the workers known
                        log.exception("refreshing the pool list failed")
                self._wake.wait(1.0)
                continue
            try:
                self._step()
            except Exception as exc:   # a worker or the allocator failed: the running requests fail
                log.exception("engine step failed")
                self._fail_running(f"{type(exc).__name__}: {exc}")
            for h in [h for h, j in jobs.items() if j.completion is not None]:
                del jobs[h]
            if self.progress:
                self.progress(Progress(self.report.steps, len(self._running), len(self._waiting),
                                       self._finished, self._finished + len(jobs), self.report.tokens,
                                       self._used_blocks()))
        self._take_inbox(jobs)
        for job in jobs.values():
            job.cancelled = True
        try:
            self._cancel_ready(force=True)
        except Exception:   # the lease is revoked on close all the same
            log.exception("freeing the last sequences failed")

    def _take_inbox(self, jobs: dict) -> None:
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                job = _Job(handle.request, next(self._submitted), handle)
                jobs[handle] = job
                self._admit(job)
            elif handle in jobs:
                jobs[handle].cancelled = True
        self._cancel_ready()

    # ------------------------------------------------------------ one step

    def _step(self) -> None:
        """The step's ownership changes (local, or one allocator call), then one Forward
        per worker."""
        r = self.report
        r.steps += 1
        self._move_sequences()
        self._recompute_lost()
        appends: dict[Sequence, list[int]] = {}
        forks: dict[Sequence, list[list[int]]] = {}
        for job in self._running:
            b0 = job.branches[0]
            for b in job.branches:
                if b.state == DECODE:
                    appends[b.seq] = [b.pending]
            kids = [b for b in job.branches if b.state == FORK]
            if kids and b0.state == DECODE:
                forks[b0.seq] = [[b.pending] for b in kids]
        creates = self._plan_creates(appends, forks)
        frees = list(self._to_free)
        before = {s: s.num_tokens for s in appends}
        prompts = [(tokens, self._pool_of(job.req), b"") for job, _, tokens in creates]
        try:
            if self.local:
                result, created, shortage = self._change_locally(appends, forks, frees, prompts)
            else:
                result, created, shortage = self._change(appends, forks, frees, prompts)
        except errors.SequenceLost:
            # A resync in the background lost sequences of this step (the SDK changed
            # nothing of the call that named them): recompute them, plan the step again.
            self._to_free = [s for s in self._to_free if not s.freed]
            self._recompute_lost()
            return
        self._to_free = [s for s in self._to_free if not s.freed]
        for (job, b, tokens), seq in zip(creates, created):
            if seq is None:
                continue
            b.seq, b.state, b.context = seq, PREFILL, tokens
            b.recompute_from = -1
            self._live[seq.id] = seq
            r.prefix_hit_tokens += seq.num_cached_tokens
            if job.cached < 0:
                job.cached = seq.num_cached_tokens
            if job.forking and b.index == 0:   # n > 1: the others are forked after its prefill
                for x in job.branches[1:]:
                    x.state = FOLLOW
            if job not in self._running:
                job.admitted = next(self._admit_order)
                self._running.append(job)
                self._waiting.remove(job)
            bs = seq.block_size
            self._unwritten.setdefault(seq.pool, set()).update(seq.block_table[seq.num_cached_tokens // bs:])
        for parent, kids in result.children.items():
            job = next(j for j in self._running if j.branches[0].seq and j.branches[0].seq.id == parent)
            for b, child in zip([b for b in job.branches if b.state == FORK], kids):
                b.seq, b.state = child, DECODE
                self._live[child.id] = child
        r.cow_copies += len(result.copies)
        self._live = {sid: s for sid, s in self._live.items() if not s.freed}
        # Admission waits after a failed create, until blocks come back (or nothing runs).
        self._solo = None in created     # next time, try one request alone
        self._hold = (self._hold or None in created) and not any(s.freed for s in frees) \
            and bool(self._running or self._to_free)
        if shortage is not None and None not in created:
            self._preempt(shortage, appends, before)
        self._measure()
        if not self._forward(result, before) and shortage is not None:
            time.sleep(0.02)   # nothing could run: the pools are held by someone else
        self._recompute_lost()     # (sequences a resync lost during the step)
        for job in [j for j in self._running if j.done]:
            self._running.remove(job)
            self._finish(job)

    def _change_locally(self, appends: dict, forks: dict, frees: list, creates: list
                        ) -> tuple[StepResult, list[Sequence | None], errors.ResourceExhausted | None]:
        """Local mode: the step's changes as ``_change`` returns them, in three parts.

        The frees first: the blocks they release serve this step's growth (the SDK sizes a
        step's reserve before it applies the step's own frees). Then appends and forks, with
        no RPC, so that a refused create cannot take their copy pairs and children with it.
        Then the creates, the step's only synchronous call.

        With several pools each create is a call of its own, so that one pool's refusal
        never holds back the creates that another pool could serve.
        """
        self._change({}, {}, frees, [])
        result, _, shortage = self._change(appends, forks, [], [])
        created: list[Sequence | None] = []
        for batch in ([creates] if len(self._stubs) == 1 else [[c] for c in creates]):
            made, got, refused = self._change({}, {}, [], batch)
            result.copies.extend(made.copies)
            created.extend(got)
            shortage = shortage or refused
        return result, created, shortage

    def _change(self, appends: dict, forks: dict, frees: list, creates: list
                ) -> tuple[StepResult, list[Sequence | None], errors.ResourceExhausted | None]:
        """One ``Client.step``: its result, the created sequences (None where a create was
        refused) and the ResourceExhausted it raised, if any. On RESOURCE_EXHAUSTED the
        result holds what was applied all the same (a remote step's other pools; in local
        mode, nothing: the SDK refuses a step its reserves cannot cover before any change)."""
        if not (appends or forks or frees or creates):
            return StepResult(), [], None
        try:
            result = self.client.step(appends, forks=forks, frees=frees, creates=creates)
            return result, list(result.created), None
        except errors.ResourceExhausted as exc:
            result = exc.result if isinstance(exc.result, StepResult) else StepResult()
            done = iter(result.created)
            states = exc.partial.created if exc.partial is not None else []
            created = [next(done) if i < len(states) and states[i].sequence_id else None
                       for i in range(len(creates))]
            return result, created, exc
