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

Example: ``Engine("127.0.0.1:50051").run([Request([1, 2, 3], max_new_tokens=8, n=4,
temperature=0.8)])`` returns a ``Report`` with one ``Completion`` of four samples.
"""

from __future__ import annotations

import itertools
import sys
import time
from array import array
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

import grpc

from kvservice import errors
from kvservice.client import Client, Sequence, StepResult
from kvservice.common.security import ClientCredentials
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc

#: Branch states: waiting for a create; created, prompt not yet computed; waiting for
#: branch 0's prefill; to be forked from branch 0 carrying ``pending``; decoding
#: (``pending`` is appended and computed next); finished.
WAIT, PREFILL, FOLLOW, FORK, DECODE, DONE = "wait", "prefill", "follow", "fork", "decode", "done"


@dataclass(slots=True)
class Request:
    """One generation request.

    Attributes:
        prompt: the prompt's token ids.
        max_new_tokens: tokens to generate per sample.
        n: parallel samples; sample ``i`` uses ``seed + i``.
        temperature: 0 for greedy (argmax), else sampling at this temperature.
        seed: the sampling seed of sample 0.
        request_id: a name for the request (default: its index in the run).
    """

    prompt: list[int]
    max_new_tokens: int = 16
    n: int = 1
    temperature: float = 0.0
    seed: int = 0
    request_id: str = ""

    def __post_init__(self) -> None:
        if not self.prompt or self.max_new_tokens < 1 or self.n < 1 or self.temperature < 0:
            raise ValueError(f"request {self.request_id!r}: need a prompt, max_new_tokens >= 1, "
                             f"n >= 1 and temperature >= 0")


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
    """

    request_id: str
    outputs: list[list[int]]
    logits: list[list[array]] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str = ""


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
            wall time. completions: one per request, in submission order.
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
    failed: int = 0
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


class _Branch:
    """One sample of a request."""

    __slots__ = ("index", "seed", "state", "outputs", "logits", "seq", "context", "pending")

    def __init__(self, index: int, seed: int) -> None:
        self.index, self.seed, self.state, self.pending = index, seed, WAIT, 0   # pending: next token to feed
        self.outputs: list[int] = []
        self.logits: list[array] = []
        self.seq: Sequence | None = None
        self.context: list[int] = []      # the tokens its sequence was created with


class _Job:
    """A request in flight: its branches and bookkeeping."""

    def __init__(self, req: Request, index: int) -> None:
        self.req, self.index = req, index
        self.branches = [_Branch(i, req.seed + i) for i in range(req.n)]
        self.admitted, self.cached, self.preemptions, self.error = 0, -1, 0, ""   # admitted: order
        self.forking = False   # branch 0 was created for all n: the others fork after its prefill

    @property
    def done(self) -> bool:
        return all(b.state == DONE for b in self.branches)


class Engine:
    """Runs requests to completion over the allocator at ``allocator`` and its workers.

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
    """

    def __init__(self, allocator: str, *, tenant: str = "", max_num_seqs: int = 64,
                 max_prefill_tokens: int = 2048, return_logits: bool = False,
                 progress: Callable[[Progress], None] | None = None, timeout: float = 60.0,
                 local: bool = True, credentials: ClientCredentials | None = None) -> None:
        self.local = local
        self.credentials = credentials or ClientCredentials.from_env()
        if not tenant and not (self.credentials.token or self.credentials.cert):
            tenant = "engine"
        self.client = Client(allocator, tenant=tenant, lease_ttl=30.0, timeout=timeout, local=local,
                             credentials=self.credentials)
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.return_logits, self.progress, self.timeout = return_logits, progress, timeout
        self._stubs: dict[str, wpb_grpc.WorkerStub] = {}
        self._channels: list[grpc.Channel] = []
        self._num_blocks: dict[str, int] = {}
        self._block_size: dict[str, int] = {}
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvs-forward")
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
            channel = self.credentials.channel(p.worker_address, [
                ("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)])
            stub = wpb_grpc.WorkerStub(channel)
            info = stub.Describe(wpb.DescribeWorkerRequest(), timeout=self.timeout)
            if not info.HasField("model"):
                raise RuntimeError(f"worker {p.worker_address} of pool {p.pool_id} serves no model (--model)")
            models.add((info.model.name, info.model.seed))
            self._channels.append(channel)
            self._stubs[p.pool_id] = stub
        if not self._stubs or len(models) > 1:
            raise RuntimeError(f"need pools with workers that serve one model; found {sorted(models)}")

    def close(self) -> None:
        """Frees every sequence (revokes the lease) and closes the connections."""
        self._executor.shutdown(wait=True)
        for c in [*self._channels, self.client]:
            c.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the run

    def run(self, requests: Iterable[Request]) -> Report:
        """Runs every request to completion; returns the report (sequences all freed).

        A request fails (``Completion.error``) only when it can never fit in the largest
        pool; a pool that is merely short makes requests wait or be preempted.
        """
        start, jobs = time.monotonic(), [_Job(r, i) for i, r in enumerate(requests)]
        self.report, self._waiting, self._running = Report(), deque(), []
        self._to_free: list[Sequence] = []
        self._live: dict[str, Sequence] = {}          # every sequence holding blocks, by id
        self._unwritten: dict[str, set[int]] = {}     # per pool: blocks whose prompt is not computed yet
        self._admit_order, self._hold, self._solo = itertools.count(1), False, False
        for job in jobs:
            need, largest = self._min_blocks(job.req), max(self._num_blocks.values())
            if need > largest:
                job.error = (f"request {job.req.request_id or job.index} needs {need} KV blocks at least; "
                             f"the largest pool has {largest}")
                for b in job.branches:
                    b.state = DONE
            else:
                self._waiting.append(job)
        while self._waiting or self._running or self._to_free:
            self._step()
            if self.progress:
                self.progress(Progress(self.report.steps, len(self._running), len(self._waiting),
                                       sum(j.done for j in jobs), len(jobs), self.report.tokens,
                                       self._used_blocks()))
        self.client.flush()   # local mode: the allocator has applied every free when run returns
        r = self.report
        for job in jobs:   # in submission order
            r.completions.append(Completion(
                job.req.request_id or str(job.index), [b.outputs for b in job.branches],
                [b.logits for b in job.branches] if self.return_logits else None,
                max(job.cached, 0), job.preemptions, job.error))
        r.requests = sum(not j.error for j in jobs)
        r.failed = len(jobs) - r.requests
        r.sharing_saving = 1 - r.peak_blocks / r.peak_unshared_blocks if r.peak_unshared_blocks else 0.0
        r.seconds = round(time.monotonic() - start, 3)
        return r

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
        if self.local:
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
        self._running = [j for j in self._running if not j.done]

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

    def _requeue(self, job: _Job) -> None:
        """Frees (next step) a running request's sequences and puts it first in line, to
        be recomputed from its tokens so far."""
        for b in job.branches:
            if b.seq is not None:
                if not b.seq.freed:
                    self._to_free.append(b.seq)
                b.seq = None
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
                sampling = wpb.SamplingParams(temperature=job.req.temperature, seed=b.seed)
                if b.state == PREFILL:
                    bs, start = s.block_size, s.num_cached_tokens
                    if self._unwritten.get(s.pool, set()).intersection(s.block_table[:start // bs]):
                        continue   # reads blocks that another prompt writes this step: wait one
                    # n > 1: the other samples' first tokens are drawn from the same position.
                    extra = ([wpb.SamplingParams(temperature=job.req.temperature, seed=x.seed)
                              for x in job.branches[1:]] if job.forking and b.index == 0 else [])
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
        calls = {}   # one Forward per worker, all in flight at once
        for pool, items in entries.items():
            epochs = {b.seq.epoch for b, _, _, _ in items}
            if len(epochs) != 1:
                raise RuntimeError(f"pool {pool}: sequences of several epochs {sorted(epochs)} in one step")
            request = wpb.ForwardRequest(epoch=epochs.pop(), copies=copies.get(pool, []),
                                         sequences=[fs for _, _, fs, _ in items], return_logits=self.return_logits,
                                         lease_id=self.client.lease_id)
            calls[pool] = self._executor.submit(self._stubs[pool].Forward, request, timeout=self.timeout)
        for pool, items in entries.items():
            response = calls[pool].result()
            rows = _rows(response.logits, len(items)) if self.return_logits else [None] * len(items)
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

    def _sampled(self, b: _Branch, job: _Job, token: int, row: array | None, state: str) -> None:
        """Records a branch's new token: it is fed next (``state``), or the branch is done."""
        b.outputs.append(token)
        b.pending = token
        if row is not None:
            b.logits.append(row)
        self.report.tokens += 1
        if len(b.outputs) >= job.req.max_new_tokens:
            b.state = DONE
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
