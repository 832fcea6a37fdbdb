"""``kvservice simulate``: where the KV memory of a serving engine goes, per policy.

Draws one trace from a workload preset and runs it under each policy: the contiguous
baselines (``max``, ``pow2``, ``oracle``) in-process, the paged ones (``paged``,
``paged-shared``) on a real allocator (one started with an embedded Redis unless
``--target`` names a running one), once per block size. Prints the parameters and a
table, or with ``--json`` only a JSON list of the results (without timelines).
``--report`` hands the arguments to the memory study (plots and docs).

Example::

    kvservice simulate --workload sharegpt --requests 2000 --policies max,pow2,oracle,paged
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from kvservice.simulate.runner import PAGED_POLICIES, POLICIES
from kvservice.simulate.workload import PRESETS

#: Block sizes of the paged policies unless ``--block-sizes`` is given.
DEFAULT_BLOCK_SIZES = [16]

#: The table's columns: header, result key, format.
COLUMNS = (
    ("policy", "policy", "{:<12}"), ("bs", "block_size", "{:>4}"), ("token%", "token_utilization", "{:>7.1%}"),
    ("resv%", "reservation", "{:>6.1%}"), ("intern%", "internal_frag", "{:>7.1%}"),
    ("extern%", "external_frag", "{:>7.1%}"), ("reserve%", "reserved_unused", "{:>8.1%}"),
    ("free%", "free", "{:>6.1%}"), ("failures", "failures", "{:>8}"),
    ("preempt", "preemptions", "{:>7}"), ("max_conc", "max_concurrency", "{:>8}"),
    ("completed", "completed", "{:>9}"), ("failed", "failed", "{:>6}"), ("steps", "steps", "{:>7}"),
    ("seconds", "seconds", "{:>7.1f}"),
)


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one policy")
    for p in names:
        if p not in POLICIES:
            raise argparse.ArgumentTypeError(f"unknown policy {p!r} (choose from {', '.join(POLICIES)})")
    return list(dict.fromkeys(names))


def _block_sizes(text: str) -> list[int]:
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            bs = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not an integer") from None
        if not 1 <= bs <= 256 or bs & (bs - 1):
            raise argparse.ArgumentTypeError(f"{bs} is not a power of two in 1..256")
        sizes.append(bs)
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one block size")
    return list(dict.fromkeys(sizes))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``simulate`` flags to ``parser``."""
    parser.add_argument("--workload", default="sharegpt", choices=list(PRESETS),
                        help="workload preset (default sharegpt)")
    parser.add_argument("--policies", type=_policies, default=["max", "pow2", "oracle", "paged"],
                        help=f"comma list of {', '.join(POLICIES)} (default max,pow2,oracle,paged)")
    parser.add_argument("--block-sizes", type=_block_sizes, default=None,
                        help="comma list of block sizes for the paged policies (default 16; "
                             "with --report: the study's sweep)")
    parser.add_argument("--requests", type=_positive(int), default=2000, help="requests in the trace (default 2000)")
    parser.add_argument("--rate", type=_positive(float), default=None,
                        help="arrivals per step (default: the preset's, which keeps the pool saturated)")
    parser.add_argument("--capacity-tokens", type=_positive(int), default=32768,
                        help="KV slots (default 32768 = 16 x 2048)")
    parser.add_argument("--max-len", type=_positive(int), default=2048, help="model maximum length (default 2048)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    parser.add_argument("--max-num-seqs", type=_positive(int), default=256,
                        help="most samples running at once (default 256)")
    parser.add_argument("--target", default="", help="use the allocator at host:port instead of starting one")
    parser.add_argument("--timeline-points", type=_positive(int), default=400,
                        help="points of each run's timeline (default 400)")
    parser.add_argument("--check", action="store_true",
                        help="check the memory invariants at every step (slow)")
    parser.add_argument("--json", action="store_true", help="print only a JSON list of the results on stdout")
    parser.add_argument("--report", action="store_true",
                        help="run the memory study: plots and tables into --out-dir")
    parser.add_argument("--out-dir", default="docs", help="where --report writes (default docs)")
    parser.add_argument("--sweep-requests", type=_positive(int), default=None,
                        help="with --report: requests of the block-size sweep (default: --requests, at most 2000)")
    parser.add_argument("--sharing-requests", type=_positive(int), default=None,
                        help="with --report: requests of the sharing workloads (default: --requests, at most 1000)")


def _validate(args: argparse.Namespace) -> str:
    """The first problem with the arguments taken together, or ''."""
    if args.max_len < 2:
        return f"--max-len must be >= 2, got {args.max_len}"
    if args.capacity_tokens < args.max_len:
        return f"--capacity-tokens ({args.capacity_tokens}) must be >= --max-len ({args.max_len})"
    if PRESETS[args.workload].shared_prefix + 2 > args.max_len:
        return f"--max-len {args.max_len} is too short for the {args.workload!r} system prompt"
    if any(p in PAGED_POLICIES for p in args.policies):
        for bs in args.block_sizes or DEFAULT_BLOCK_SIZES:
            if args.capacity_tokens % bs:
                return f"--capacity-tokens ({args.capacity_tokens}) must be a multiple of every --block-sizes ({bs})"
    return ""


class ProgressBar:
    """One line on stderr per run: a bar, done/total requests, steps, elapsed seconds."""

    def __init__(self, label: str, stream=sys.stderr) -> None:
        self.label, self.stream = label, stream
        self.live = stream.isatty()
        self.started = time.perf_counter()
        self.last = 0.0
        self.state = {"done": 0, "total": 0, "step": 0}

    def line(self) -> str:
        s = self.state
        frac = s["done"] / s["total"] if s["total"] else 1.0
        bar = "#" * int(frac * 24)
        return (f"{self.label:<18} [{bar:<24}] {s['done']:>6}/{s['total']} requests, "
                f"step {s['step']:>7}, {time.perf_counter() - self.started:6.1f}s")

    def __call__(self, status: dict) -> None:
        self.state = status
        now = time.perf_counter()
        if self.live and now - self.last >= 0.1:
            self.last = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def close(self) -> None:
        self.stream.write(("\r" if self.live else "") + self.line() + "\n")
        self.stream.flush()


def _runs(args: argparse.Namespace) -> list[tuple[str, int]]:
    runs = []
    for p in args.policies:
        runs += [(p, bs) for bs in args.block_sizes or DEFAULT_BLOCK_SIZES] if p in PAGED_POLICIES else [(p, 1)]
    return runs


def main(args: argparse.Namespace) -> int:
    """Runs ``kvservice simulate``; returns the exit status (2: bad arguments, 1: a run
    ended with a failed audit or blocks still in use)."""
    if getattr(args, "report", False):
        from kvservice.simulate.study import main as study_main

        return study_main(args)
    problem = _validate(args)
    if problem:
        print(f"kvservice simulate: {problem}", file=sys.stderr)
        return 2
    from kvservice.simulate.runner import simulate
    from kvservice.simulate.workload import generate, summary

    preset = PRESETS[args.workload]
    rate = args.rate if args.rate is not None else preset.rate
    requests = generate(args.workload, args.requests, seed=args.seed, rate=rate, max_len=args.max_len)
    runs = _runs(args)
    if not args.json:
        s = summary(requests)
        print(f"kvservice simulate: seed {args.seed}, workload {args.workload}: {preset.description}")
        print(f"  lengths: lognormal, prompt mean {preset.input_mean:g} sigma {preset.input_sigma:g}"
              f"{f' after a {preset.shared_prefix}-token shared prefix' if preset.shared_prefix else ''}, "
              f"output mean {preset.output_mean:g} sigma {preset.output_sigma:g}, n={preset.n}; "
              f"drawn: prompt {s['mean_prompt']:.1f}, output {s['mean_output']:.1f}")
        print(f"  requests {args.requests}, rate {rate:g}/step (last arrival at step {s['last_arrival']}), "
              f"capacity {args.capacity_tokens} tokens, max_len {args.max_len}, max_num_seqs {args.max_num_seqs}")
        print(f"  policies {', '.join(f'{p}@{bs}' if p in PAGED_POLICIES else p for p, bs in runs)}; "
              f"allocator {args.target or 'started locally (embedded Redis)'}")
        print("  shares are means over the measured steps: those that start with requests still waiting;")
        print("  reserve%: blocks in the SDK's lease reserve (granted in bulk, in no block table yet)")
        print()
    results = []
    with contextlib.ExitStack() as stack:
        target = args.target
        if not target and any(p in PAGED_POLICIES for p, _ in runs):
            from kvservice.simulate.paged import local_allocator

            target = stack.enter_context(local_allocator())
        for policy, bs in runs:
            bar = ProgressBar(f"{policy}@{bs}" if policy in PAGED_POLICIES else policy)
            try:
                result = simulate(requests, policy, capacity_tokens=args.capacity_tokens, block_size=bs,
                                  max_len=args.max_len, target=target or None,
                                  max_num_seqs=args.max_num_seqs, timeline_points=args.timeline_points,
                                  workload=args.workload, seed=args.seed, debug=args.check, status=bar)
            finally:
                bar.close()
            result["rate"] = rate
            results.append(result)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "timeline"} for r in results]))
    else:
        _table(results)
    bad = [r for r in results if not r["audit_ok"] or r.get("num_used_blocks", 0)]
    for r in bad:
        print(f"kvservice simulate: {r['policy']}@{r['block_size']}: audit failed or blocks left in use: "
              f"{r.get('audit_problems') or r.get('num_used_blocks')}", file=sys.stderr)
    return 1 if bad else 0


def _table(results: list[dict]) -> None:
    widths = [max(len(h), len(fmt.format("" if key == "policy" else 0))) for h, key, fmt in COLUMNS]
    print(" ".join(h.rjust(w) if i else h.ljust(w) for i, ((h, _, _), w) in enumerate(zip(COLUMNS, widths))))
    for r in results:
        print(" ".join(fmt.format(r[key]).rjust(w) if i else fmt.format(r[key]).ljust(w)
                       for i, ((_, key, fmt), w) in enumerate(zip(COLUMNS, widths))))
    print()
    for r in results:
        name = f"{r['policy']}@{r['block_size']}" if r["policy"] in PAGED_POLICIES else r["policy"]
        line = f"{name}: {r['measured_steps']} measured steps of {r['steps']}"
        if not r["measured_regime"]:
            line += " (no step had requests waiting: every step is measured)"
        if r["policy"] in PAGED_POLICIES:
            line += (f"; audit {'ok' if r['audit_ok'] else 'FAILED'}, {r['num_used_blocks']} blocks in use "
                     f"at the end, peak {r['peak_blocks']} blocks, {r['avg_block_table_len']:.1f} blocks "
                     f"per sequence, at most {r['peak_reserved_blocks']} in reserve after a step")
        print(line)
