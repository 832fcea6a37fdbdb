"""A continuous-batching inference engine over the allocator and the workers' ``Forward``.

The SDK runs in local mode by default (DESIGN §5): each engine step's appends, forks and
frees change the client's block tables at once, with no allocator RPC (the journal reaches
the allocator in the background); only the step's creates make one synchronous call, the
prefix lookup being global. ``local=False`` sends every ownership change of the step in
one batched ``Step`` RPC instead. Then one ``Forward`` RPC per worker, all workers in
parallel. Prompts are placed by the allocator (longest cached prefix, then most free
blocks); only their uncached part is computed. ``n > 1`` samples share the prompt through
fork and copy-on-write. When a pool runs short, admission waits and decoding preempts the
most recently admitted request, which is recomputed later from its tokens so far. See
docs/engine.md for the step loop and the report's definitions.

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
import math
import queue
import sys
import threading
import time
from array import array
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import grpc

from kvservice import errors
from kvservice.client import Client, Sequence, StepResult
from kvservice.rpc import to_domain_error
from kvservice.common.security import ClientCredentials
from kvservice.engine.text import Detokenizer, StopMatcher, Tokenizer
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc

log = logging.getLogger("kvservice.engine")

#: Branch states: waiting for a create; created, prompt not yet computed; waiting for
#: branch 0's prefill; to be forked from branch 0 carrying ``pending``; decoding
#: (``pending`` is appended and computed next); finished.
WAIT, PREFILL, FOLLOW, FORK, DECODE, DONE = "wait", "prefill", "follow", "fork", "decode", "done"

#: Why a sample ended: its ``max_new_tokens``; an end-of-sequence token, a stop token or
#: a stop string; ``Handle.cancel``; the request failed.
LENGTH, STOP, CANCELLED, FAILED = "length", "stop", "cancelled", "error"


#: The online loop reads the pool list again this often (seconds) while idle.
REFRESH_S = 10.0
#: After a worker failed a step, the loop waits this long (seconds) before the next one.
LOST_WORKER_PAUSE_S = 0.1
#: The channels to the workers: large tensors; a connection attempt to a worker that is
#: gone gives up after 2 s, not gRPC's default 20 s (a killed container's address drops
#: packets: its steps fail, and are recomputed elsewhere, that much sooner).
WORKER_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
                          ("grpc.min_reconnect_backoff_ms", 2000), ("grpc.initial_reconnect_backoff_ms", 500),
                          ("grpc.max_reconnect_backoff_ms", 5000))


class EngineBusy(RuntimeError):
    """``submit`` refused a request: ``max_waiting`` requests wait for KV blocks already."""


class RequestError(ValueError):
    """A request the engine cannot serve as asked: ``field`` names the offending field."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class Request:
    """One generation request.

    Attributes:
        prompt: the prompt's token ids.
        max_new_tokens: tokens to generate per sample at most.
        n: parallel samples; sample ``i`` uses ``seed + i``.
        temperature: 0 for greedy (argmax), else sampling at this temperature.
        seed: the sampling seed of sample 0.
        request_id: a name for the request (default: its index in the run).
        top_p: nucleus sampling, in (0, 1] (1: off).
        top_k: sample among the k most likely tokens (0: off).
        stop: strings that end a sample (not included in its text); needs a tokenizer.
        stop_token_ids: more token ids that end a sample, besides the model's
            end-of-sequence ids.
        ignore_eos: go on past the model's end-of-sequence tokens (``max_new_tokens``
            tokens always).
    """

    prompt: list[int]
    max_new_tokens: int = 16
    n: int = 1
    temperature: float = 0.0
    seed: int = 0
    request_id: str = ""
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        name = f"request {self.request_id!r}"
        checks = ((bool(self.prompt), "prompt", "needs a prompt (at least one token)"),
                  (self.max_new_tokens >= 1, "max_new_tokens", f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
                  (self.n >= 1, "n", f"n must be >= 1, got {self.n}"),
                  (math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
                   f"temperature must be finite and >= 0, got {self.temperature}"),
                  (math.isfinite(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
                  (self.top_k >= 0, "top_k", f"top_k must be >= 0 (0: off), got {self.top_k}"),
                  (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"))
        for ok, where, message in checks:
            if not ok:
                raise RequestError(f"{name}: {message}", where)
        self.stop, self.stop_token_ids = tuple(self.stop), tuple(self.stop_token_ids)


@dataclass(slots=True)
class Output:
    """What one step added to one sample of a request (``Handle.events``).

    Attributes:
        index: the sample. token_ids: its new tokens. text: the text they complete (held
        back while it could begin a stop string). finish_reason: set on the sample's last
        output (``length``, ``stop``, ``cancelled`` or ``error``).
    """

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None


@dataclass(slots=True)
class Completion:
    """A request's result.

    Attributes:
        request_id: the request's name.
        outputs: the generated tokens of each sample.
        logits: with ``return_logits``: per sample, one float32 row (the vocabulary) per
            generated token, from the position that produced it.
        num_cached_tokens: prompt tokens served by the prefix cache (first admission).
        num_preemptions: how often the request was preempted and recomputed.
        error: why the request failed ("" when it did not).
        texts: each sample's text (with a tokenizer; cut before a stop string).
        finish_reasons: why each sample ended (``length``, ``stop``, ``cancelled``,
            ``error``).
        num_prompt_tokens: the prompt's length.
    """

    request_id: str
    outputs: list[list[int]]
    logits: list[list[array]] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str = ""
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    num_prompt_tokens: int = 0


@dataclass(slots=True)
class Report:
    """What a run did (definitions in docs/engine.md).

    Attributes:
        requests: requests completed. tokens: tokens generated (all samples).
        peak_blocks: physical blocks in use at the peak (all pools).
        kv_utilization: at that peak, slots holding a token / slots of the used blocks.
        prefix_hit_tokens: prompt tokens served by the prefix cache (not recomputed).
        cow_copies: copy-on-write block copies. sharing_saving: 1 - peak_blocks / the
            peak of an unshared run (every sequence holding private copies of its blocks).
        prefill_tokens: prompt tokens computed by the workers.
        steps, preemptions, failed, seconds: engine steps, preemptions, failed requests,
            wall time. worker_failures: steps a worker failed (unreachable, or restarted
            since: a new epoch); its requests were recomputed on the other pools. cancelled: requests cancelled. completions: one per request, in
            submission order (``run``; the online loop hands them to the handles).
    """

    requests: int = 0
    tokens: int = 0
    peak_blocks: int = 0
    kv_utilization: float = 0.0
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    sharing_saving: float = 0.0
    peak_unshared_blocks: int = 0
    prefill_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    worker_failures: int = 0
    failed: int = 0
    cancelled: int = 0
    seconds: float = 0.0
    completions: list[Completion] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The figures as a JSON-ready dict (no completions)."""
        return {k: v for k, v in ((f, getattr(self, f)) for f in self.__slots__) if k != "completions"}


@dataclass(slots=True)
class Progress:
    """Passed to the progress callback after every engine step."""
    step: int
    running: int
    waiting: int
    finished: int
    total: int
    tokens: int
    blocks: int


class Handle:
    """A submitted request (``Engine.submit``): its outputs as they come, its result,
    its cancellation. Thread-safe."""

    def __init__(self, engine: "Engine", request: Request,
                 on_event: Callable[[Output | Completion], None] | None) -> None:
        self.engine, self.request = engine, request
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._on_event = on_event or self._events.put
        self._done = threading.Event()
        self._completion: Completion | None = None

    def _emit(self, event: Output | Completion) -> None:
        if isinstance(event, Completion):
            self._completion = event
            self._done.set()
        try:
            self._on_event(event)
        except Exception:   # the caller's callback: it must not stop the loop
            log.exception("on_event of request %r failed", self.request.request_id)

    def events(self, timeout: float | None = None) -> Iterator[Output]:
        """The request's outputs in order, until its end (without ``on_event`` only).

        Raises:
            TimeoutError: nothing came for ``timeout`` seconds.
        """
        while True:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no output for {timeout} s") from None
            if isinstance(event, Completion):
                return
            yield event

    def result(self, timeout: float | None = None) -> Completion:
        """Waits for the request's end; its completion."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request.request_id!r} did not finish within {timeout} s")
        return self._completion

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Ends the request: every unfinished sample ends ``cancelled`` and its blocks are
        freed at the engine's next step (after its prompt's computation, if that is under
        way). A finished request is left as it is."""
        self.engine._inbox.put(("cancel", self))
        self.engine._wake.set()


class _Branch:
    """One sample of a request."""

    __slots__ = ("index", "seed", "state", "outputs", "logits", "seq", "context", "pending", "finish",
                 "detok", "stops")

    def __init__(self, index: int, seed: int) -> None:
        self.index, self.seed, self.state, self.pending = index, seed, WAIT, 0   # pending: next token to feed
        self.outputs: list[int] = []
        self.logits: list[array] = []
        self.seq: Sequence | None = None
        self.context: list[int] = []      # the tokens its sequence was created with
        self.finish = ""
        self.detok: Detokenizer | None = None
        self.stops: StopMatcher | None = None


class _Job:
    """A request in flight: its branches and bookkeeping."""

    def __init__(self, req: Request, index: int, handle: Handle | None = None) -> None:
        self.req, self.index, self.handle = req, index, handle
        self.branches = [_Branch(i, req.seed + i) for i in range(req.n)]
        self.admitted, self.cached, self.preemptions, self.error = 0, -1, 0, ""   # admitted: order
        self.forking = False   # branch 0 was created for all n: the others fork after its prefill
        self.cancelled = False
        self.completion: Completion | None = None

    @property
    def done(self) -> bool:
        return all(b.state == DONE for b in self.branches)


class Engine:
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
    """

    def __init__(self, allocator: str, *, tenant: str = "", max_num_seqs: int = 64,
                 max_prefill_tokens: int = 2048, return_logits: bool = False,
                 progress: Callable[[Progress], None] | None = None, timeout: float = 60.0,
                 local: bool = True, credentials: ClientCredentials | None = None, max_waiting: int = 0) -> None:
        self.local = local
        self.credentials = credentials or ClientCredentials.from_env()
        if not tenant and not (self.credentials.token or self.credentials.cert):
            tenant = "engine"
        self.client = Client(allocator, tenant=tenant, lease_ttl=30.0, timeout=timeout, local=local,
                             credentials=self.credentials)
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
        self._admit_order, self._hold, self._solo = itertools.count(1), False, False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._submitted = itertools.count()
        self._finished = 0
        self.refresh_workers()

    # ------------------------------------------------------------ workers

    def refresh_workers(self) -> None:
        """Reads the pool list; connects to each pool's worker and checks they serve one model."""
        models = set()
        for p in self.client.pools():
            self._num_blocks[p.pool_id] = p.geometry.num_blocks
            self._block_size[p.pool_id] = p.geometry.block_size
            if p.pool_id in self._stubs or not p.worker_address:
                continue
            channel = self.credentials.channel(p.worker_address, [*WORKER_CHANNEL_OPTIONS])
            stub = wpb_grpc.WorkerStub(channel)
            info = stub.Describe(wpb.DescribeWorkerRequest(include_tokenizer=self.model is None),
                                 timeout=self.timeout)
            if not info.HasField("model"):
                raise RuntimeError(f"worker {p.worker_address} of pool {p.pool_id} serves no model (--model)")
            models.add((info.model.name, info.model.seed))
            if self.model is None:
                if info.model.HasField("tokenizer"):
                    self.tokenizer = Tokenizer.from_info(info.model.tokenizer)
                self.model = wpb.ModelInfo()
                self.model.CopyFrom(info.model)
                self.model.ClearField("tokenizer")
            models.add((self.model.name, self.model.seed))   # a worker added later serves the same
            self._channels.append(channel)
            self._stubs[p.pool_id] = stub
        if not self._stubs or len(models) > 1:
            raise RuntimeError(f"need pools with workers that serve one model; found {sorted(models)}")

    def close(self) -> None:
        """Stops the loop (requests still in flight end ``cancelled``), frees every
        sequence (revokes the lease) and closes the connections."""
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            self._thread.join()
            self._thread = None
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

    def _busy(self) -> bool:
        return bool(self._waiting or self._running or self._to_free)

    def _admit(self, job: _Job) -> None:
        """Queues a job, or ends it at once with an error if it can never be served."""
        try:
            self.check(job.req)
        except RequestError as exc:
            job.error = str(exc)
            for b in job.branches:
                b.state, b.finish = DONE, FAILED
            self._finish(job)
            return
        for b in job.branches:
            if self.tokenizer is not None:
                b.detok = Detokenizer(self.tokenizer, job.req.prompt)
                b.stops = StopMatcher(job.req.stop)
        self._waiting.append(job)

    def _finish(self, job: _Job) -> None:
        """Records a finished job's completion and hands it to its handle."""
        r = self.report
        job.completion = Completion(
            job.req.request_id or str(job.index), [b.outputs for b in job.branches],
            [b.logits for b in job.branches] if self.return_logits else None,
            max(job.cached, 0), job.preemptions, job.error,
            [b.stops.text if b.stops else "" for b in job.branches], [b.finish for b in job.branches],
            len(job.req.prompt))
        if job.error:
            r.failed += 1
        elif job.cancelled and any(b.finish == CANCELLED for b in job.branches):
            r.cancelled += 1
        else:
            r.requests += 1
        self._finished += 1
        if job.handle is not None:
            job.handle._emit(job.completion)

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

    def _cancel_ready(self, force: bool = False) -> None:
        """Ends the cancelled jobs: a waiting one at once, a running one once no prompt of
        it is being computed (its blocks must hold what the prefix cache says); its
        sequences are freed next step (``force``: now, the loop is stopping)."""
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
            self._end(job, CANCELLED)
        for job in [j for j in self._running if j.cancelled]:
            if force or not any(b.state in (PREFILL, FOLLOW) for b in job.branches):
                self._running.remove(job)
                self._end(job, CANCELLED)
        if force and self._to_free:
            self._change({}, {}, list(self._to_free), [])
            self._to_free = [s for s in self._to_free if not s.freed]

    def _end(self, job: _Job, reason: str) -> None:
        """Ends a job's unfinished samples with ``reason``; their sequences are freed next step."""
        for b in job.branches:
            self._release(b)
            if b.state != DONE:
                b.state, b.finish = DONE, reason
                if job.handle is not None:
                    job.handle._emit(Output(b.index, [], b.stops.flush() if b.stops else "", reason))
        self._finish(job)

    def _fail_running(self, error: str) -> None:
        for job in list(self._running):
            job.error = error
            self._running.remove(job)
            self._end(job, FAILED)

    def _min_blocks(self, req: Request) -> int:
        """Blocks a request holds at its peak when it runs alone, sharing what it can."""
        bs = max(self._block_size.values())
        total = len(req.prompt) + req.max_new_tokens - 1   # the last token is never fed back
        shared = len(req.prompt) // bs if req.n > 1 else 0
        return shared + req.n * (-(-total // bs) - shared)


    # ------------------------------------------------------------ one step

    def _step(self) -> None:
        """The step's ownership changes (local, or one allocator call), then one Forward
        per worker."""
        r = self.report
        r.steps += 1
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
        prompts = [(tokens, "", b"") for _, _, tokens in creates]
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

    def _plan_creates(self, appends: dict, forks: dict) -> list[tuple[_Job, _Branch, list[int]]]:
        """This step's creates, as (job, branch, prompt tokens): unplaced branches of running
        jobs, then waiting jobs in order, while the predicted free blocks, ``max_num_seqs``
        and ``max_prefill_tokens`` allow. With nothing running, the first is always tried."""
        creates: list[tuple[_Job, _Branch, list[int]]] = []
        if self._hold:
            return creates
        # Local mode: the lease's reserve holds blocks in no table, which creates cannot take
        # (the SDK counts them over all pools: an overestimate for each pool).
        reserved = self.client.reserved_blocks() if self.local else 0
        avail = {p: self._num_blocks[p] - self._used_blocks(p) - reserved for p in self._stubs}
        for s in appends:
            if s.pool in avail and (s.num_tokens % s.block_size == 0 or s in forks):
                avail[s.pool] -= 1 + len(forks.get(s, ()))
        seqs = len(self._live) + sum(len(k) for k in forks.values())
        budget = self.max_prefill_tokens
        idle = not self._live
        target = max(avail, key=avail.get)   # a step's creates land together (placed from the state before it)

        def split(job: _Job) -> bool:
            return job.req.n > 1 and not any(b.outputs for b in job.branches)

        def take(job: _Job, b: _Branch) -> bool:
            nonlocal seqs, budget, idle
            width = job.req.n if split(job) else 1
            job.forking = width > 1
            tokens = job.req.prompt + b.outputs
            need, pool = -(-len(tokens) // self._block_size[target]) + width - 1, target
            if creates and self._solo or not idle and (need > avail[pool] or seqs + width > self.max_num_seqs
                             or (len(tokens) > budget and budget < self.max_prefill_tokens)):
                return False
            idle = False
            avail[pool] -= need
            seqs += width
            budget -= len(tokens)
            creates.append((job, b, tokens))
            return True

        for job in self._running:
            for b in job.branches:
                if b.state == WAIT and not take(job, b):
                    return creates
        for job in list(self._waiting):
            todo = [b for b in job.branches if b.state == WAIT]
            if split(job):
                todo = todo[:1]          # one prompt, forked after its prefill
            if not all([take(job, b) for b in todo]):
                break
        return creates

    def _preempt(self, exc: errors.ResourceExhausted, appends: dict, before: dict) -> None:
        """Growth failed in a pool: frees (next step) the sequences of the most recently
        admitted request there, and requeues it to be recomputed from its tokens so far."""
        stuck = {s.pool for s in appends if s.num_tokens == before[s]}
        pools = {exc.pool_id} if exc.pool_id else stuck
        victims = [j for j in self._running
                   if any(b.seq is not None and b.seq.pool in pools for b in j.branches)
                   and not any(b.state in (PREFILL, FOLLOW) for b in j.branches)]
        if not victims:
            return
        self._requeue(max(victims, key=lambda j: j.admitted))

    def _recompute_lost(self) -> None:
        """Requests whose sequences the allocator lost (it lost writes and could not prove,
        when the SDK resynchronised, that their blocks were still ours): recomputed from
        their tokens so far, as after a preemption."""
        lost = {s.id for s in self.client.lost_sequences()}
        if not lost:
            return
        for job in [j for j in self._running if any(b.seq is not None and b.seq.id in lost for b in j.branches)]:
            self._requeue(job)
        self._to_free = [s for s in self._to_free if s.id not in lost]
        self._live = {sid: s for sid, s in self._live.items() if sid not in lost}

    def _release(self, b: _Branch) -> None:
        """Detaches a branch's sequence, to be freed next step."""
        if b.seq is not None:
            if not b.seq.freed:
                self._to_free.append(b.seq)
            b.seq = None

    def _requeue(self, job: _Job) -> None:
        """Frees (next step) a running request's sequences and puts it first in line, to
        be recomputed from its tokens so far."""
        for b in job.branches:
            self._release(b)
            if b.state != DONE:
                b.state = WAIT
        job.preemptions += 1
        self.report.preemptions += 1
        self._running.remove(job)
        self._waiting.appendleft(job)

    def _forward(self, result: StepResult, before: dict) -> int:
        """Builds each pool's ForwardRequest, calls the workers in parallel, applies the
        sampled tokens; returns the number of sequences computed."""
        r = self.report
        entries: dict[str, list[tuple[_Branch, _Job, wpb.ForwardSequence, str]]] = {}

        def add(pool: str, b: _Branch, job: _Job, fs: wpb.ForwardSequence, kind: str) -> None:
            entries.setdefault(pool, []).append((b, job, fs, kind))
        for job in self._running:
            for b in job.branches:
                s = b.seq
                if s is not None and s.lost:
                    continue           # (recomputed: _recompute_lost)
                sampling = _sampling(job.req, b.seed)
                if b.state == PREFILL:
                    bs, start = s.block_size, s.num_cached_tokens
                    if self._unwritten.get(s.pool, set()).intersection(s.block_table[:start // bs]):
                        continue   # reads blocks that another prompt writes this step: wait one
                    # n > 1: the other samples' first tokens are drawn from the same position.
                    extra = ([_sampling(job.req, x.seed) for x in job.branches[1:]]
                             if job.forking and b.index == 0 else [])
                    add(s.pool, b, job, wpb.ForwardSequence(
                        token_ids=b.context[start:], start_position=start, block_table=s.block_table,
                        slot_mapping=s.slot_mapping(start), sampling=sampling, extra_samples=extra), PREFILL)
                elif b.state == DECODE and s.num_tokens == before.get(s, s.num_tokens - 1) + 1:
                    n = s.num_tokens
                    add(s.pool, b, job, wpb.ForwardSequence(
                        token_ids=[b.pending], start_position=n - 1, block_table=s.block_table,
                        slot_mapping=s.slot_mapping(n - 1), sampling=sampling), DECODE)
        copies: dict[str, list[wpb.BlockCopy]] = {}   # applied by the worker before the step's writes
        for c in result.copies:
            copies.setdefault(c.pool, []).append(wpb.BlockCopy(src=c.src, dst=c.dst))
        calls = {pool: self._executor.submit(self._forward_call, pool, items, copies.get(pool, []))
                 for pool, items in entries.items()}   # one Forward per worker, all in flight at once
        for pool in list(entries):
            try:
                response, entries[pool] = calls[pool].result()
            except (errors.Unavailable, errors.DeadlineExceeded, errors.FailedPrecondition) as exc:
                if isinstance(exc, errors.FailedPrecondition) and exc.reason != "EPOCH_CHANGED":
                    raise
                self._worker_lost(pool, exc)
                del entries[pool]
                continue
            items = entries[pool]
            rows = _rows(response.logits, len(items)) if self.return_logits and items else [None] * len(items)
            extra = iter(response.extra_tokens)
            for (b, job, fs, kind), token, row in zip(items, response.next_tokens, rows):
                if kind == PREFILL:
                    r.prefill_tokens += len(fs.token_ids)
                    self._unwritten[pool].difference_update(fs.block_table[fs.start_position // b.seq.block_size:])
                    if fs.extra_samples:   # n > 1: the others' first tokens; they fork next step
                        for x in job.branches[1:]:
                            self._sampled(x, job, next(extra), row, FORK)
                        job.forking = False
                self._sampled(b, job, token, row, DECODE)
        return sum(len(items) for items in entries.values())

    def _worker_lost(self, pool: str, exc: errors.KvsError) -> None:
        """A worker that cannot be reached, or that restarted since (its pool has a new
        epoch: its KV is gone), failed a step: the requests with sequences in its pool are
        recomputed from their tokens so far, as after a preemption, wherever placement puts
        them (a pool whose worker stopped heartbeating is placed last: docs/allocator.md).
        The other pools' results of the step are kept."""
        jobs = [j for j in self._running if any(b.seq is not None and b.seq.pool == pool for b in j.branches)]
        log.warning("the worker of pool %s failed a step (%s: %s): %d request(s) recomputed elsewhere",
                    pool, type(exc).__name__, exc, len(jobs))
        self.report.worker_failures += 1
        for job in jobs:
            self._requeue(job)
        self._unwritten.pop(pool, None)
        time.sleep(LOST_WORKER_PAUSE_S)   # (until placement sees the silence, the next create may land there again)

    def _forward_call(self, pool: str, items: list, copies: list[wpb.BlockCopy]) -> tuple[wpb.ForwardResponse, list]:
        """One worker's Forward, and the items it computed. A worker that refuses it for
        the pool's generation (the pool's state may have rolled back: RolledBack) is sent
        it again once the client has resynchronised there, without the sequences the
        resync lost (and their copy-on-write pairs)."""
        for attempt in range(2):
            epochs = {b.seq.epoch for b, _, _, _ in items}
            if len(epochs) > 1:
                raise RuntimeError(f"pool {pool}: sequences of several epochs {sorted(epochs)} in one step")
            request = wpb.ForwardRequest(epoch=epochs.pop() if epochs else 0, copies=copies,
                                         sequences=[fs for _, _, fs, _ in items], return_logits=self.return_logits,
                                         lease_id=self.client.lease_id, generation=self.client.generation(pool))
            stub = self._stubs.get(pool)
            if stub is None:
                raise errors.Unavailable(f"no connection to the worker of pool {pool} (not reachable when the "
                                         f"pool list was read)")
            try:
                return stub.Forward(request, timeout=self.timeout), items
            except grpc.RpcError as exc:
                err = to_domain_error(exc)
                if attempt or not isinstance(err, errors.RolledBack):
                    raise err from None
            log.warning("pool %s refused a step for its generation (its Redis restarted or failed over): "
                        "resynchronising", pool)
            self.client.resync(pool)
            items = [x for x in items if not x[0].seq.lost]
            kept = {blk for x in items for blk in x[0].seq.block_table}
            copies = [c for c in copies if c.dst in kept]
            if not items:
                return wpb.ForwardResponse(), items
        raise AssertionError("unreachable")

    def _sampled(self, b: _Branch, job: _Job, token: int, row: array | None, state: str) -> None:
        """Records a branch's new token: it is fed next (``state``), or the branch is done
        (its ``max_new_tokens``, an end-of-sequence or stop token, a stop string)."""
        req = job.req
        b.outputs.append(token)
        b.pending = token
        if row is not None:
            b.logits.append(row)
        self.report.tokens += 1
        finish, text = "", ""
        if token in req.stop_token_ids or (not req.ignore_eos and self.tokenizer is not None
                                           and token in self.tokenizer.eos_token_ids):
            finish = STOP         # the token itself is no text
        elif b.detok is not None:
            text, stopped = b.stops.feed(b.detok.add(token))
            finish = STOP if stopped else ""
        if not finish and len(b.outputs) >= req.max_new_tokens:
            finish = LENGTH
        if finish and b.stops is not None:
            text += b.stops.flush()
        if job.handle is not None:
            job.handle._emit(Output(b.index, [token], text, finish or None))
        if finish:
            b.state, b.finish = DONE, finish
            if b.seq is not None:
                self._to_free.append(b.seq)
                b.seq = None
        else:
            b.state = state

    # ------------------------------------------------------------ figures

    def _used_blocks(self, pool: str | None = None) -> int:
        """Distinct physical blocks held by this engine's live sequences (one pool or all)."""
        return len({(s.pool, blk) for s in self._live.values() if pool is None or s.pool == pool
                    for blk in s.block_table})

    def _measure(self) -> None:
        """Updates the peak figures from the live block tables (exact after every step)."""
        held: dict[tuple[str, int], int] = {}
        unshared = 0
        for s in self._live.values():
            bs, table = s.block_size, s.block_table
            unshared += len(table)
            for i, blk in enumerate(table):
                key = (s.pool, blk)
                held[key] = max(held.get(key, 0), min(bs, s.num_tokens - i * bs))
        r = self.report
        if len(held) > r.peak_blocks:
            slots = sum(self._block_size[p] for p, _ in held)
            r.peak_blocks = len(held)
            r.kv_utilization = round(sum(held.values()) / slots, 4)
        r.peak_unshared_blocks = max(r.peak_unshared_blocks, unshared)


def _sampling(req: Request, seed: int) -> wpb.SamplingParams:
    return wpb.SamplingParams(temperature=req.temperature, seed=seed, top_p=req.top_p, top_k=req.top_k)


def _rows(tensor: wpb.Tensor, count: int) -> list[array]:
    """Splits a float32 ``[count, vocab]`` tensor into rows."""
    if tensor.dtype != "float32" or len(tensor.shape) != 2 or tensor.shape[0] != count:
        raise RuntimeError(f"unexpected logits {tensor.dtype} {list(tensor.shape)} for {count} sequences")
    flat = array("f")
    flat.frombytes(tensor.data)
    if sys.byteorder == "big":  # the wire is little-endian
        flat.byteswap()
    vocab = tensor.shape[1]
    return [flat[i * vocab:(i + 1) * vocab] for i in range(count)]
