"""The engine's requests and what it hands back: ``Request``, its ``Output``s and
``Completion``, the run's ``Report`` and ``Progress``, the ``Handle`` of an online request,
and the bookkeeping of a request in flight (``_Job``, one ``_Branch`` per sample)."""

from __future__ import annotations

import logging
import math
import queue
import threading
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from kvservice.client import Sequence
from kvservice.engine.text import Detokenizer, StopMatcher

if TYPE_CHECKING:
    from kvservice.engine.engine import Engine

log = logging.getLogger("kvservice.engine")

#: Branch states: waiting for a create; created, prompt not yet computed; waiting for
#: branch 0's prefill; to be forked from branch 0 carrying ``pending``; decoding
#: (``pending`` is appended and computed next); finished.
WAIT, PREFILL, FOLLOW, FORK, DECODE, DONE = "wait", "prefill", "follow", "fork", "decode", "done"

#: Why a sample ended: its ``max_new_tokens``; an end-of-sequence token, a stop token or
#: a stop string; ``Handle.cancel``; the request failed.
LENGTH, STOP, CANCELLED, FAILED = "length", "stop", "cancelled", "error"


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
        pool: the pool (worker) whose KV its sequences take while it serves; "" (the
            default): the allocator places them (docs/allocator.md, "Placement"). A pool
            that leaves is replaced by placement.
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
    pool: str = ""

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
            since: a new epoch); its requests were recomputed on the other pools.
        loaded_blocks, load_failures, offloaded_blocks: blocks loaded from a lower tier
            (prefix hits there), loads that failed their checksum (recomputed), and blocks
            copied down a tier, by the workers (DESIGN §12).
        migrated_sequences: sequences moved to another pool (off a pool being drained, or
            from a prefill pool to a decode pool: DESIGN §13).
        fetched_blocks, fetch_failures: blocks filled from another pool's worker (a prefix
            cached there, DESIGN §13), and blocks not fetched (the source gone, a checksum,
            the destination's worker gone): recomputed.
        cancelled: requests cancelled. completions: one per request, in
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
    loaded_blocks: int = 0
    load_failures: int = 0
    offloaded_blocks: int = 0
    fetched_blocks: int = 0
    fetch_failures: int = 0
    migrated_sequences: int = 0
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
                 "detok", "stops", "recompute_from")

    def __init__(self, index: int, seed: int) -> None:
        self.index, self.seed, self.state, self.pending = index, seed, WAIT, 0   # pending: next token to feed
        self.outputs: list[int] = []
        self.logits: list[array] = []
        self.seq: Sequence | None = None
        self.context: list[int] = []      # the tokens its sequence was created with
        self.finish = ""
        self.detok: Detokenizer | None = None
        self.stops: StopMatcher | None = None
        self.recompute_from = -1          # >= 0: a load of its cached prefix failed; computed from here


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
