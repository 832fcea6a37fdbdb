"""The memory study behind ``kvservice simulate --report`` (``make study``).

Three parts, each a set of :func:`kvservice.simulate.runner.simulate` runs:

1. **policies**: one workload (ShareGPT lengths by default, ``max_len`` 2,048) under the
   contiguous policies ``max``, ``pow2`` and ``oracle`` and under ``paged`` (our allocator,
   block size 16): how much of the KV memory holds tokens, and where the rest goes;
2. **block size**: ``paged`` on the same workload at block sizes 1, 8, 16, 32, 64, 128 (the
   block-16 run of part 1 is reused);
3. **sharing**: :func:`kvservice.simulate.sharing.parallel_sampling` (four samples of a
   2,000-token prompt), and the ``parallel`` and ``system-prompt`` workloads under
   ``paged`` and ``paged-shared``.

:func:`run_study` returns every result in one dict (the input of
:func:`kvservice.simulate.report.write_report`); progress goes to stderr. The paged policies
talk to a real allocator: ``target`` if given, otherwise one started for the study
(:func:`kvservice.simulate.paged.local_allocator`).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Part 1's policies, in the order of the report.
MAIN_POLICIES = ("max", "pow2", "oracle", "paged")
#: Part 2's block sizes.
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
#: The block size of part 1's paged run and of part 3.
MAIN_BLOCK_SIZE = 16
#: Requests of parts 2 and 3 unless given: at most these many (the paged runs cost allocator
#: calls at every step; block size 1 the most), so that the default study takes minutes.
DEFAULT_SWEEP_REQUESTS = 2000
DEFAULT_SHARING_REQUESTS = 1000
#: Part 3's workloads and policies.
SHARING_WORKLOADS = ("parallel", "system-prompt")
SHARING_POLICIES = ("paged", "paged-shared")


@dataclass
class StudyParams:
    """Everything that decides the study's numbers (the report prints all of it).

    ``rate`` is the arrival rate of parts 1 and 2 (0: the preset's own rate); part 3's
    workloads always arrive at their presets' rates (each chosen to keep the pool
    saturated). ``sweep_requests`` and ``sharing_requests`` are the request counts of
    parts 2 and 3 (0: ``requests``, at most :data:`DEFAULT_SWEEP_REQUESTS` and
    :data:`DEFAULT_SHARING_REQUESTS`). ``sharing_output_len`` 0 keeps the default of
    :func:`~kvservice.simulate.sharing.parallel_sampling`.
    """

    seed: int = 0
    requests: int = 2000
    rate: float = 0.0
    capacity_tokens: int = 32768
    max_len: int = 2048
    max_num_seqs: int = 256
    target: str = ""
    workload: str = "sharegpt"
    block_sizes: tuple[int, ...] = BLOCK_SIZES
    sweep_requests: int = 0
    sharing_requests: int = 0
    sharing_prompt_len: int = 2000
    sharing_n: int = 4
    sharing_output_len: int = 0
    timeline_points: int = 400
    #: Extra keyword arguments of every ``simulate`` call (none by default).
    simulate_kwargs: dict[str, Any] = field(default_factory=dict)

    def resolved(self) -> StudyParams:
        """A copy with the 0 defaults of the part sizes filled in."""
        p = StudyParams(**{**asdict(self), "block_sizes": tuple(self.block_sizes)})
        p.sweep_requests = p.sweep_requests or min(p.requests, DEFAULT_SWEEP_REQUESTS)
        p.sharing_requests = p.sharing_requests or min(p.requests, DEFAULT_SHARING_REQUESTS)
        if not p.rate:
            from kvservice.simulate.workload import PRESETS

            p.rate = PRESETS[p.workload].rate if p.workload in PRESETS else 1.0
        return p


    def problem(self) -> str:
        """The first thing wrong with these parameters, or ''."""
        from kvservice.simulate.workload import PRESETS

        if self.workload not in PRESETS:
            return f"unknown workload {self.workload!r} (choose from {', '.join(PRESETS)})"
        if min(self.requests, self.capacity_tokens, self.max_num_seqs, self.sharing_n,
               self.sharing_prompt_len) < 1 or self.rate < 0:
            return "requests, capacity, max_num_seqs and the parallel-sampling sizes must be >= 1"
        if self.capacity_tokens < self.max_len:
            return f"the capacity ({self.capacity_tokens}) must be >= max_len ({self.max_len})"
        for bs in (*self.block_sizes, MAIN_BLOCK_SIZE):
            if not 1 <= bs <= 256 or bs & (bs - 1):
                return f"block size {bs} is not a power of two in 1..256"
            if self.capacity_tokens % bs:
                return f"the capacity ({self.capacity_tokens}) must be a multiple of every block size ({bs})"
        for preset in (self.workload, *SHARING_WORKLOADS):
            if PRESETS[preset].shared_prefix + 2 > self.max_len:
                return f"max_len {self.max_len} is too short for the {preset!r} workload"
        return ""


def _log(msg: str) -> None:
    print(f"[study] {msg}", file=sys.stderr, flush=True)


class _Progress:
    """A ``progress(done, total)`` callback that reports every quarter (or, on a terminal,
    rewrites one line)."""

    def __init__(self, label: str, log: Callable[[str], None] = _log) -> None:
        self.label, self.log = label, log
        self.t0 = time.monotonic()
        self.next_quarter = 1
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.monotonic() - self.t0
        if self.tty:
            sys.stderr.write(f"\r[study] {self.label}: {done}/{total} ({elapsed:.0f} s)\x1b[K")
            sys.stderr.flush()
        elif total > 0 and done * 4 >= self.next_quarter * total and done < total:
            while done * 4 >= self.next_quarter * total:
                self.next_quarter += 1
            self.log(f"{self.label}: {done}/{total} ({elapsed:.0f} s)")

    def finish(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def parse_block_sizes(value: Any) -> tuple[int, ...]:
    """``[1, 8, 16]``, ``(1, 8)``, ``"1,8,16"`` or ``"1 8 16"`` -> a tuple of positive ints."""
    if value is None or value == "":
        return BLOCK_SIZES
    if isinstance(value, int):
        items: list[Any] = [value]
    elif isinstance(value, str):
        items = [v for v in value.replace(",", " ").split() if v]
    else:
        items = []
        for v in value:
            items.extend(parse_block_sizes(v) if isinstance(v, str) else [int(v)])
    sizes = tuple(int(v) for v in items)
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"block sizes must be positive integers, got {value!r}")
    return sizes


@contextlib.contextmanager
def _allocator(target: str) -> Iterator[str]:
    if target:
        yield target
        return
    from kvservice.simulate.paged import local_allocator

    _log("starting a local allocator (embedded Redis)")
    with local_allocator() as t:
        yield t


def run_study(params: StudyParams, *, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Runs the three parts of the study.

    Args:
        params: the study's parameters.
        log: where the progress lines go (stderr by default).

    Returns:
        ``{"params", "policies", "block_sizes", "sharing", "runs", "workloads", "seconds"}``:
        ``params`` are the resolved parameters; ``policies`` maps each of
        :data:`MAIN_POLICIES` to its ``simulate`` result; ``block_sizes`` is a list of
        paged results in block-size order; ``sharing`` holds ``parallel_sampling`` (the
        result of that call, plus ``seconds``) and ``workloads`` (workload -> policy ->
        result); ``runs`` lists every run's part, workload, policy, block size, requests,
        steps and wall time, in the order they ran; ``workloads`` describes each trace
        (preset, rate, samples, shared prefix and ``workload.summary``'s mean lengths).
    """
    from kvservice.simulate.runner import simulate
    from kvservice.simulate.sharing import parallel_sampling
    from kvservice.simulate.workload import PRESETS, generate, summary

    p = params.resolved()
    t_start = time.monotonic()
    runs: list[dict[str, Any]] = []
    workloads: dict[tuple[str, int], list[Any]] = {}
    traces: list[dict[str, Any]] = []

    def requests_of(preset: str, n: int) -> list[Any]:
        key = (preset, n)
        if key not in workloads:
            rate = p.rate if preset == p.workload else PRESETS[preset].rate
            workloads[key] = generate(preset, n, seed=p.seed, rate=rate, max_len=p.max_len)
            traces.append({"workload": preset, "rate": rate, "description": PRESETS[preset].description,
                           "samples": PRESETS[preset].n, "shared_prefix": PRESETS[preset].shared_prefix,
                           **summary(workloads[key])})
        return workloads[key]

    def run(part: str, preset: str, n: int, policy: str, block_size: int, target: str) -> dict[str, Any]:
        label = f"{part}: {preset} x {n}, {policy}" + (f" @{block_size}" if policy.startswith("paged") else "")
        log(f"{label} ...")
        progress = _Progress(label, log)
        t0 = time.monotonic()
        result = simulate(
            requests_of(preset, n), policy, capacity_tokens=p.capacity_tokens, block_size=block_size,
            max_len=p.max_len, target=target if policy.startswith("paged") else None,
            max_num_seqs=p.max_num_seqs, progress=progress, timeline_points=p.timeline_points,
            workload=preset, seed=p.seed, **p.simulate_kwargs)
        progress.finish()
        wall = time.monotonic() - t0
        result.setdefault("seconds", wall)
        runs.append({"part": part, "workload": preset, "policy": policy, "block_size": block_size,
                     "requests": n, "steps": result.get("steps"), "seconds": result["seconds"],
                     "audit_ok": bool(result.get("audit_ok", True)) and not result.get("num_used_blocks", 0)})
        log(f"{label}: {result.get('steps')} steps, token share {result['token_utilization']:.1%}, "
            f"{wall:.1f} s (study {time.monotonic() - t_start:.0f} s)")
        return result

    with _allocator(p.target) as target:
        # 1. the policies
        policies: dict[str, dict[str, Any]] = {}
        for i, policy in enumerate(MAIN_POLICIES):
            policies[policy] = run(f"1/3 policies ({i + 1}/{len(MAIN_POLICIES)})", p.workload, p.requests,
                                   policy, MAIN_BLOCK_SIZE, target)

        # 2. the block-size sweep (reusing part 1's paged run where it is the same run)
        sweep: list[dict[str, Any]] = []
        sizes = sorted(set(p.block_sizes))
        for i, bs in enumerate(sizes):
            if bs == MAIN_BLOCK_SIZE and p.sweep_requests == p.requests:
                log(f"2/3 block sizes ({i + 1}/{len(sizes)}): block {bs} is part 1's paged run")
                sweep.append(policies["paged"])
                continue
            sweep.append(run(f"2/3 block sizes ({i + 1}/{len(sizes)})", p.workload, p.sweep_requests,
                             "paged", bs, target))

        # 3. sharing
        log("3/3 sharing: parallel sampling ...")
        t0 = time.monotonic()
        kwargs: dict[str, Any] = {"prompt_len": p.sharing_prompt_len, "n": p.sharing_n,
                                  "block_size": MAIN_BLOCK_SIZE, "seed": p.seed}
        if p.sharing_output_len:
            kwargs["output_len"] = p.sharing_output_len
        ps = dict(parallel_sampling(target, **kwargs))
        ps.setdefault("seconds", time.monotonic() - t0)
        runs.append({"part": "3/3 sharing", "workload": f"parallel sampling n={p.sharing_n}",
                     "policy": "paged-shared", "block_size": MAIN_BLOCK_SIZE, "requests": 1,
                     "steps": ps.get("steps"), "seconds": ps["seconds"],
                     "audit_ok": bool(ps.get("audit_ok", True)) and not ps.get("num_used_blocks", 0)})
        log(f"3/3 sharing: parallel sampling: {ps['physical_blocks']} physical blocks vs "
            f"{ps['independent_blocks']} independent, saving {ps['saving']:.1%}, {ps['seconds']:.1f} s")
        shared: dict[str, dict[str, dict[str, Any]]] = {}
        for preset in SHARING_WORKLOADS:
            shared[preset] = {}
            for policy in SHARING_POLICIES:
                shared[preset][policy] = run("3/3 sharing", preset, p.sharing_requests, policy,
                                             MAIN_BLOCK_SIZE, target)

    seconds = time.monotonic() - t_start
    log(f"done in {seconds:.0f} s")
    params_out = asdict(p)
    params_out["block_sizes"] = list(sizes)
    params_out["target"] = p.target  # "" = a local allocator started for the study
    return {
        "params": params_out,
        "policies": policies,
        "block_sizes": sweep,
        "sharing": {"parallel_sampling": ps, "workloads": shared},
        "runs": runs,
        "workloads": traces,
        "seconds": seconds,
    }


def params_from_args(args: Any) -> StudyParams:
    """The study's parameters from ``kvservice simulate``'s parsed flags (missing ones keep
    :class:`StudyParams`' defaults)."""
    d = StudyParams()

    def get(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    return StudyParams(
        seed=int(get("seed", d.seed)),
        requests=int(get("requests", d.requests)),
        rate=float(get("rate", d.rate)),
        capacity_tokens=int(get("capacity_tokens", d.capacity_tokens)),
        max_len=int(get("max_len", d.max_len)),
        max_num_seqs=int(get("max_num_seqs", d.max_num_seqs)),
        target=str(get("target", d.target) or ""),
        workload=str(get("workload", d.workload) or d.workload),
        block_sizes=parse_block_sizes(get("block_sizes", d.block_sizes)),
        sweep_requests=int(get("sweep_requests", d.sweep_requests) or 0),
        sharing_requests=int(get("sharing_requests", d.sharing_requests) or 0),
        sharing_prompt_len=int(get("sharing_prompt_len", d.sharing_prompt_len)),
        sharing_n=int(get("sharing_n", d.sharing_n)),
        sharing_output_len=int(get("sharing_output_len", d.sharing_output_len) or 0),
        timeline_points=int(get("timeline_points", d.timeline_points)),
        simulate_kwargs={"debug": True} if getattr(args, "check", False) else {},
    )


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def main(args: Any) -> int:
    """``kvservice simulate --report``: runs the study, writes ``<out_dir>/memory-study.md``
    and ``<out_dir>/img/memory-*.png``; with ``--json`` also prints the study as JSON.

    Returns:
        0; 1 if a paged run's pool failed the allocator's audit or kept blocks in use
        (the report is written all the same); 2 for bad parameters.
    """
    from kvservice.simulate.report import write_report

    try:
        params = params_from_args(args)
    except ValueError as exc:
        print(f"kvservice simulate --report: {exc}", file=sys.stderr)
        return 2
    problem = params.problem()
    if problem:
        print(f"kvservice simulate --report: {problem}", file=sys.stderr)
        return 2
    out_dir = Path(getattr(args, "out_dir", None) or "docs")
    study = run_study(params)
    path = write_report(study, out_dir)
    images = sorted(str(p) for p in (out_dir / "img").glob("memory-*.png"))
    where = sys.stderr if getattr(args, "json", False) else sys.stdout
    print(f"report: {path}", file=where)
    for img in images:
        print(f"plot:   {img}", file=where)
    print(f"study wall time: {study['seconds']:.0f} s", file=where)
    if getattr(args, "json", False):
        json.dump(_jsonable(study), sys.stdout)
        print()
    bad = [r for r in study["runs"] if not r["audit_ok"]]
    for r in bad:
        print(f"kvservice simulate --report: {r['workload']} {r['policy']}@{r['block_size']}: the allocator's "
              f"audit failed or blocks were left in use", file=sys.stderr)
    return 1 if bad else 0
