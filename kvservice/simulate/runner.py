"""The step loop of a continuous-batching engine, measuring where its KV memory goes.

One loop serves every policy; only the memory model differs (``ContiguousMemory`` for
``max``, ``pow2``, ``oracle``; ``PagedMemory``, i.e. the real allocator through the SDK,
for ``paged`` and ``paged-shared``). Each step:

1. requests whose arrival step has come join the FCFS queue;
2. requests that completed in the previous step release their memory;
3. every running request gains one token per sample (a paged run may have to preempt
   the most recently admitted requests first: they go back to the front of the queue,
   and are recomputed when admitted again);
4. the queue's head is admitted while its memory can be placed and the running samples
   stay within ``max_num_seqs``; its prompt is processed in this step (the first output
   token is produced now and written to the KV cache in the next step);
5. the memory is measured; requests whose KV now holds ``prompt + output`` tokens are
   complete.

A request that could never run (``prompt + output > max_len``, more samples than
``max_num_seqs``, or memory that does not fit in the empty pool) is counted ``failed``
and dropped: every request ends ``completed`` or ``failed``.

**Where the memory goes.** For a live sample with ``A`` allocated slots (contiguous: its
buddy block; paged: the slots of its blocks, a block shared by several samples counted
once), ``t`` tokens in its KV and final length ``f``:

- ``token = t``: slots holding tokens;
- ``reservation = min(A, f) - t``: slots held for tokens that will come;
- ``internal = A - min(A, f)``: slots that will never hold a token (buddy rounding, a
  reservation for the maximum length, the unused tail of a paged final block);
- ``external``: at a step where the queue's head could not be placed although the free
  slots were at least what it needed, all free slots (stranded in holes), else 0;
- ``reserved_unused``: paged: the slots of the blocks in the lease's reserve after the
  step (the allocator gave them to the SDK, which has not put them in a table yet; the
  SDK refills the reserve in bulk, DESIGN §5); contiguous: 0;
- ``free``: the remaining free slots.

The six add up to the capacity at every step. Reported shares are their means over the
**measured steps**: the steps that start with a non-empty queue, i.e. while memory (or
the batch limit) holds requests back. If no step qualifies, every step is measured
(``measured_regime`` is then False).
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections import defaultdict, deque
from typing import Callable

from kvservice.simulate.contiguous import ContiguousMemory
from kvservice.simulate.workload import SimRequest

POLICIES = ("max", "pow2", "oracle", "paged", "paged-shared")
PAGED_POLICIES = ("paged", "paged-shared")
SERIES = ("token", "reservation", "internal", "external", "reserved_unused", "free")


class RunState:
    """A request's life in one run (the memory models read and update it).

    Attributes:
        req: the request.
        n: samples.
        f: final length of each sample (prompt + output).
        t0: tokens of each sample when (last) admitted.
        order: admission number (later admissions have larger numbers).
        admitted: the step of the last admission.
        finish: the step at which it will hold ``f`` tokens.
        waited: it could not be placed at least once.
        slots: contiguous: the buddy offsets of its samples.
        seqs: paged: the SDK sequences of its samples.
        fork_pending: paged-shared: admitted as one sequence, to be forked next step.
    """

    __slots__ = ("req", "n", "f", "t0", "order", "admitted", "finish", "waited", "slots", "seqs",
                 "fork_pending")

    def __init__(self, req: SimRequest) -> None:
        self.req, self.n, self.f, self.t0 = req, req.n, req.final_len, req.prompt_len
        self.order = self.admitted = self.finish = -1
        self.waited = self.fork_pending = False
        self.slots: list[int] = []
        self.seqs: list = []


def simulate(requests: list[SimRequest], policy: str, *, capacity_tokens: int, block_size: int = 16,
             max_len: int = 2048, target: str | None = None, max_num_seqs: int = 256,
             progress: Callable[[int, int], None] | None = None, timeline_points: int = 400,
             workload: str = "", seed: int | None = None, debug: bool = False,
             on_step: Callable[[dict], None] | None = None,
             status: Callable[[dict], None] | None = None) -> dict:
    """Runs a trace under one policy and measures where the KV memory goes.

    Args:
        requests: the trace (any order; run by arrival step, then id).
        policy: ``max``, ``pow2``, ``oracle``, ``paged`` or ``paged-shared``.
        capacity_tokens: KV slots (paged: ``capacity_tokens // block_size`` blocks).
        block_size: tokens per block (paged policies; a power of two in 1..256).
        max_len: the model's maximum length.
        target: ``host:port`` of an allocator (required for the paged policies).
        max_num_seqs: the most samples running at once.
        progress: called with ``(done requests, total)`` as requests finish.
        timeline_points: the timeline is averaged down to at most this many points.
        workload: the preset's name, recorded in the result.
        seed: the trace's seed, recorded (and the seed of paged token ids; default 0).
        debug: check the memory model's invariants at every step (slow; for tests).
        on_step: called after every simulated step with that step's accounting (slots).
        status: called with ``{"done", "total", "step", "running", "waiting"}`` as the
            run advances (for progress bars).

    Returns:
        A dict: ``policy``, ``block_size`` (contiguous: 1), ``workload``, ``seed``,
        ``num_requests``, ``capacity_tokens`` (as given; the shares use the pool's
        ``num_blocks * block_size`` slots), ``max_len``, ``max_num_seqs``; the six shares
        ``token_utilization``, ``reservation``, ``internal_frag``, ``external_frag``,
        ``reserved_unused``, ``free`` (0-1, summing to 1); ``failures`` (head-of-line
        requests that had to wait, once each, plus paged steps whose growth forced a
        preemption, plus RESOURCE_EXHAUSTED replies), ``failed``, ``completed``, ``max_concurrency``
        (requests), ``preemptions``, ``steps``, ``measured_steps``, ``measured_regime``,
        ``seq_limited_steps`` (measured steps whose head waited for ``max_num_seqs``
        rather than memory), ``tokens_per_step`` (output tokens of completed requests
        per step), ``completed_per_step``, ``avg_block_table_len``, ``peak_blocks``,
        ``audit_ok``, ``num_used_blocks`` (at the end), ``seconds`` and ``timeline``
        (``step``, the six series as shares, ``running``; bucket means). Paged runs add
        ``pool_id``, ``cow_copies``, ``prefix_hit_tokens``, ``evictions``, ``exhausted``,
        ``peak_reserved_blocks`` and ``audit_problems``.

    Raises:
        ValueError: an unknown policy or a parameter out of range.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    paged = policy in PAGED_POLICIES
    if paged and (block_size < 1 or block_size > 256 or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two in 1..256, got {block_size}")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    if capacity_tokens < (block_size if paged else 1):
        raise ValueError(f"capacity_tokens must hold at least one block, got {capacity_tokens}")
    if max_num_seqs < 1 or timeline_points < 1:
        raise ValueError("max_num_seqs and timeline_points must be >= 1")
    if paged and not target:
        raise ValueError(f"policy {policy!r} runs the allocator: give target='host:port'")
    started = time.perf_counter()
    if paged:
        from kvservice.simulate.paged import PagedMemory

        mem = PagedMemory(target, shared=policy == "paged-shared", capacity_tokens=capacity_tokens,
                          block_size=block_size, seed=seed or 0)
    else:
        mem = ContiguousMemory(policy, capacity_tokens=capacity_tokens, max_len=max_len)
    try:
        result = _run(mem, requests, max_len, max_num_seqs, progress, status, debug, on_step, timeline_points)
        result.update(mem.finish())
    finally:
        mem.close()
    result.update(policy=policy, block_size=mem.block_size, workload=workload, seed=seed,
                  num_requests=len(requests), capacity_tokens=capacity_tokens, max_len=max_len,
                  max_num_seqs=max_num_seqs, seconds=time.perf_counter() - started)
    return result


def _run(mem, requests, max_len, max_num_seqs, progress, status, debug, on_step, points) -> dict:
    reqs = sorted(requests, key=lambda r: (r.arrival, r.id))
    total, cap = len(reqs), mem.capacity
    queue: deque[RunState] = deque()
    running: dict[int, RunState] = {}           # by admission order
    finishing: dict[int, list[RunState]] = defaultdict(list)
    to_release: list[RunState] = []
    numbers = itertools.count()
    nxt = step = done = completed = failed = waits = running_seqs = max_conc = out_tokens = 0
    sums, all_sums = [0] * len(SERIES), [0] * len(SERIES)
    measured = processed = seq_limited = 0
    table_sum = all_table_sum = 0.0
    paged = not isinstance(mem, ContiguousMemory)
    series = {k: array("d") for k in ("step", *SERIES, "running")}

    def report() -> None:
        if progress is not None:
            progress(done, total)
        if status is not None:
            status({"done": done, "total": total, "step": step, "running": len(running), "waiting": len(queue)})

    while done < total:
        in_regime = bool(queue)                    # requests still waiting from earlier steps
        while nxt < total and reqs[nxt].arrival <= step:
            queue.append(RunState(reqs[nxt]))
            nxt += 1
        if not queue and not running and not to_release:
            step = reqs[nxt].arrival                # idle until the next arrival
            continue
        if to_release:
            mem.release(to_release)
            to_release = []
        if running:
            for v in mem.grow(running, step):      # preempted, latest admission first
                del running[v.order]
                running_seqs -= v.n
                queue.appendleft(v)
        blocked = capped = None
        while queue:
            head = queue[0]
            if head.order < 0 and (head.f > max_len or head.n > max_num_seqs or not mem.fits_ever(head)):
                queue.popleft()
                failed += 1
                done += 1
                report()
                continue
            if running_seqs + head.n > max_num_seqs:
                capped = head
                break
            if not mem.admit(head, step):
                blocked = head
                if not head.waited:
                    head.waited = True
                    waits += 1
                break
            queue.popleft()
            head.order, head.admitted = next(numbers), step
            head.finish = step + head.f - head.t0
            running[head.order] = head
            running_seqs += head.n
            finishing[head.finish].append(head)
        for r in reversed(mem.flush(step)):        # refused by the allocator: back to the queue
            del running[r.order]
            running_seqs -= r.n
            queue.appendleft(r)
        if debug:
            mem.check(running, step)
        token, covered, allocated, reserved = mem.token, mem.covered, mem.allocated, mem.reserved
        free = cap - allocated - reserved
        external = 0
        if blocked is not None and free >= mem.need_slots(blocked):
            external, free = free, 0
        vals = (token, covered - token, allocated - covered, external, reserved, free)
        if min(vals) < 0 or allocated + reserved > cap:
            raise AssertionError(f"step {step}: inconsistent accounting {vals} of {cap} slots")
        processed += 1
        per_seq = mem.logical_blocks / running_seqs if paged and running_seqs else 0.0
        all_table_sum += per_seq
        for i, v in enumerate(vals):
            all_sums[i] += v
        if in_regime:
            measured += 1
            seq_limited += capped is not None
            table_sum += per_seq
            for i, v in enumerate(vals):
                sums[i] += v
        series["step"].append(step)
        for k, v in zip(SERIES, vals):
            series[k].append(v / cap)
        series["running"].append(len(running))
        max_conc = max(max_conc, len(running))
        if on_step is not None:
            on_step({"step": step, "capacity": cap, "allocated": allocated, "running": len(running),
                     "waiting": len(queue), **dict(zip(SERIES, vals))})
        for r in finishing.pop(step, ()):
            if running.get(r.order) is r and r.finish == step:
                del running[r.order]
                running_seqs -= r.n
                to_release.append(r)
                completed += 1
                done += 1
                out_tokens += r.n * r.req.output_len
                report()
        step += 1
        if step % 256 == 0:
            report()
    if to_release:                                 # the last completions' frees
        mem.release(to_release)
        mem.flush(step)
    report()
    regime = measured > 0
    use, count, tables = (sums, measured, table_sum) if regime else (all_sums, processed, all_table_sum)
    shares = [s / (cap * count) if count else float(k == "free") for k, s in zip(SERIES, use)]
    return {
        "token_utilization": shares[0], "reservation": shares[1], "internal_frag": shares[2],
        "external_frag": shares[3], "reserved_unused": shares[4], "free": shares[5],
        "failures": waits + mem.failures, "failed": failed, "completed": completed,
        "max_concurrency": max_conc, "preemptions": mem.preemptions, "steps": step,
        "measured_steps": count, "measured_regime": regime, "seq_limited_steps": seq_limited,
        "tokens_per_step": out_tokens / step if step else 0.0,
        "completed_per_step": completed / step if step else 0.0,
        "avg_block_table_len": tables / count if count else 0.0,
        "timeline": _downsample(series, points),
    }


def _downsample(series: dict[str, array], points: int) -> dict[str, list]:
    """Averages each series over at most ``points`` equal buckets (``step``: a bucket's first)."""
    n = len(series["step"])
    if n <= points:
        return {k: [int(x) for x in v] if k == "step" else list(v) for k, v in series.items()}
    bounds = [i * n // points for i in range(points + 1)]
    out: dict[str, list] = {}
    for k, v in series.items():
        if k == "step":
            out[k] = [int(v[bounds[i]]) for i in range(points)]
        else:
            out[k] = [sum(v[bounds[i]:bounds[i + 1]]) / (bounds[i + 1] - bounds[i]) for i in range(points)]
    return out
