"""The engine's scheduling: admission, the creates a step can afford, preemption when a
pool runs short, requests recomputed after a lost sequence, and the figures of the
report (a mixin of ``Engine``, over the state its constructor makes)."""

from __future__ import annotations

import logging
import time

from kvservice import errors
from kvservice.engine.requests import (CANCELLED, DONE, FAILED, FOLLOW, PREFILL, WAIT, Completion, Output,
                                       Request, RequestError, _Branch, _Job)
from kvservice.engine.text import Detokenizer, StopMatcher

log = logging.getLogger("kvservice.engine")

#: How long after its worker failed a step a pool that a request asks for is passed over
#: by placement (seconds): its worker restarts in that time, or its pool is gone.
LOST_POOL_S = 10.0


class Scheduler:
    """Admission, creates, preemption and the report's figures (``Engine``'s)."""

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


    def _pool_of(self, req: Request) -> str:
        """The pool a request asks for (``Request.pool``), unless the engine has no worker
        for it or its worker failed a step within ``LOST_POOL_S``; else "" (placed)."""
        pool = req.pool
        if not pool or pool not in self._stubs or pool in self._draining:
            return ""
        lost = self._lost_pools.get(pool)
        return "" if lost is not None and time.monotonic() - lost < LOST_POOL_S else pool

    def _plan_creates(self, appends: dict, forks: dict) -> list[tuple[_Job, _Branch, list[int]]]:
        """This step's creates, as (job, branch, prompt tokens): unplaced branches of running
        jobs, then waiting jobs in order, while the predicted free blocks, ``max_num_seqs``
        and ``max_prefill_tokens`` allow. With nothing running, the first is always tried.
        A prompt whose first block another prompt of this engine is being computed with (a
        create of this step, or a prefill not written yet) and that no prefill of this
        engine wrote yet waits one step: blocks are announced once written
        (docs/allocator.md), and the next step's create hits them rather than computing
        them again."""
        creates: list[tuple[_Job, _Branch, list[int]]] = []
        if self._hold:
            return creates
        # Local mode: the lease's reserve holds blocks in no table, which creates cannot take
        # (the SDK counts them over all pools: an overestimate for each pool).
        reserved = self.client.reserved_blocks() if self.local else 0
        avail = {p: self._num_blocks[p] - self._used_blocks(p) - reserved for p in self._stubs
                 if p not in self._draining}
        if any(self._roles.get(p) != "decode" for p in avail):     # (prompts go to prefill or both pools)
            avail = {p: n for p, n in avail.items() if self._roles.get(p) != "decode"}
        if not avail:
            return creates
        for s in appends:
            if s.pool in avail and (s.num_tokens % s.block_size == 0 or s in forks):
                avail[s.pool] -= 1 + len(forks.get(s, ()))
        seqs = len(self._live) + sum(len(k) for k in forks.values())
        budget = self.max_prefill_tokens
        idle = not self._live
        target = max(avail, key=avail.get)   # a step's creates land together (placed from the state before it)

        def split(job: _Job) -> bool:
            return job.req.n > 1 and not any(b.outputs for b in job.branches)

        writing = {_first_block(x.context, x.seq.block_size) for j in self._running for x in j.branches
                   if x.state == PREFILL and x.seq is not None}
        written = self._prefilled

        def take(job: _Job, b: _Branch) -> bool:
            nonlocal seqs, budget, idle
            width = job.req.n if split(job) else 1
            tokens = job.req.prompt + b.outputs
            pool = self._pool_of(job.req) or target
            first = _first_block(tokens, self._block_size[pool])
            if first is not None and first in writing and first not in written:
                return True                  # (next step, once the other one's KV is written)
            job.forking = width > 1
            need = -(-len(tokens) // self._block_size[pool]) + width - 1
            if creates and self._solo or not idle and (need > avail[pool] or seqs + width > self.max_num_seqs
                             or (len(tokens) > budget and budget < self.max_prefill_tokens)):
                return False
            idle = False
            avail[pool] -= need
            seqs += width
            budget -= len(tokens)
            creates.append((job, b, tokens))
            writing.add(first)
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


def _first_block(tokens: list[int], block_size: int) -> tuple[int, ...] | None:
    """The first full block of a prompt that a create could hit (None: none can)."""
    return tuple(tokens[:block_size]) if len(tokens) > block_size else None


#: First blocks of the prompts an engine prefilled last (``Engine._prefilled``), at most.
PREFILLED_KEPT = 4096
