"""The memory study's report: ``memory-study.md`` and four plots, from :func:`run_study`'s dict.

Every figure on the page comes from the study dict; the only constants are the vLLM
paper's published numbers (:data:`PAPER`), shown beside ours and labelled as the paper's.
The page carries no date, so regenerating it with the same parameters changes only what
the runs change (wall times). The plots are drawn by :mod:`kvservice.simulate.plots`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: The vLLM paper (Kwon et al., "Efficient Memory Management for Large Language Model
#: Serving with PagedAttention", SOSP 2023), Fig. 2: the average share of KV cache memory
#: in each state, in percent. The paper's last state is "external fragmentation and
#: others"; None = not given.
PAPER: dict[str, dict[str, Any]] = {
    "max": {"system": "Orca (Max)", "token": 20.4, "reservation": 13.3, "internal": 57.3, "external_other": 8.9},
    "pow2": {"system": "Orca (Pow2)", "token": 26.8, "reservation": 17.9, "internal": 13.6, "external_other": 41.6},
    "oracle": {"system": "Orca (Oracle)", "token": 38.2, "reservation": None, "internal": None,
               "external_other": None},
    "paged": {"system": "vLLM", "token": 96.3, "reservation": None, "internal": None, "external_other": None},
}
#: The paper's ShareGPT and Alpaca mean lengths (input, output), the presets' targets.
PAPER_MEANS = {"sharegpt": (161, 338), "alpaca": (19, 58)}

#: Our policy names -> the labels of the report's rows.
POLICY_LABELS = {"max": "Max", "pow2": "Pow2", "oracle": "Oracle", "paged": "paged (block 16)",
                 "paged-shared": "paged-shared (block 16)"}
#: The memory states, in stacking order: (result key, timeline key, label, colour).
STATES = (
    ("token_utilization", "token", "token state", "#2e7d32"),
    ("reservation", "reservation", "reservation", "#f9a825"),
    ("internal_frag", "internal", "internal fragmentation", "#ef6c00"),
    ("external_frag", "external", "external fragmentation", "#c62828"),
    ("reserved_unused", "reserved_unused", "lease reserve (unused)", "#6d4c41"),
    ("free", "free", "free", "#b0bec5"),
)
POLICY_COLORS = {"max": "#c62828", "pow2": "#ef6c00", "oracle": "#1565c0", "paged": "#2e7d32",
                 "paged-shared": "#6a1b9a"}
DPI = 110
IMAGES = ("memory-breakdown.png", "memory-block-size.png", "memory-over-time.png", "memory-sharing.png")


# ----------------------------------------------------------------------------- formatting

def _bad(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt_pct(share: float | None) -> str:
    """A 0–1 share as the report prints it: ``0.2037 -> "20.4%"``."""
    return "n/a" if _bad(share) else f"{100 * share:.1f}%"


def fmt_paper(pct: float | None) -> str:
    """A published percentage as the report prints it (blank when the paper gives none)."""
    return "" if pct is None else f"{pct:.1f}%"


def fmt_num(x: float | None, digits: int = 1) -> str:
    """A number with ``digits`` decimals and thousands separators."""
    if _bad(x):
        return "n/a"
    return f"{x:,.{digits}f}"


def fmt_int(x: float | None) -> str:
    return "n/a" if _bad(x) else f"{int(x):,}"


def per_1k_steps(result: dict[str, Any]) -> float:
    """Requests completed per 1,000 engine steps."""
    return 1000 * result["completed_per_step"]


def fmt_seconds(s: float | None) -> str:
    if _bad(s):
        return "n/a"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def _points(a: float, b: float) -> str:
    """The gap between two shares in percentage points, as words."""
    d = 100 * (a - b)
    if abs(d) < 0.05:
        return "the same"
    return f"{abs(d):.1f} points {'higher' if d > 0 else 'lower'}"


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]], align: str = "") -> list[str]:
    header = list(header)
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join(("---:" if (align and align[i] == "r") else "---") for i in range(len(header))) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return out


def table1_row(policy: str, r: dict[str, Any]) -> list[str]:
    """Table 1's row of one of our runs."""
    return [POLICY_LABELS.get(policy, policy), "ours",
            fmt_pct(r["token_utilization"]), fmt_pct(r["reservation"]), fmt_pct(r["internal_frag"]),
            fmt_pct(r["external_frag"]), fmt_pct(r["free"]), fmt_pct(r["external_frag"] + r["free"]),
            fmt_pct(r["reserved_unused"]), fmt_int(r["max_concurrency"]), fmt_num(per_1k_steps(r)),
            fmt_int(r["failures"]), fmt_int(r["failed"]), fmt_int(r["preemptions"])]


def paper_row(policy: str) -> list[str]:
    """Table 1's row of the paper's numbers for ``policy``."""
    p = PAPER[policy]
    return [POLICY_LABELS.get(policy, policy), f"paper: {p['system']}", fmt_paper(p["token"]),
            fmt_paper(p["reservation"]), fmt_paper(p["internal"]), "", "", fmt_paper(p["external_other"]),
            "", "", "", "", "", ""]


def last_block_waste(r: dict[str, Any]) -> float:
    """A paged run's unfilled slots of allocated blocks: reservation + internal fragmentation."""
    return r["reservation"] + r["internal_frag"]


def sweep_row(r: dict[str, Any]) -> list[str]:
    """The block-size table's row of one paged run."""
    return [str(r["block_size"]), fmt_pct(r["token_utilization"]), fmt_pct(r["reservation"]),
            fmt_pct(r["internal_frag"]), fmt_pct(r["external_frag"] + r["free"]), fmt_pct(r["reserved_unused"]),
            fmt_num(r["avg_block_table_len"]), fmt_int(r["peak_blocks"]), fmt_int(r["max_concurrency"]),
            fmt_num(per_1k_steps(r)), fmt_int(r["preemptions"]), fmt_seconds(r.get("seconds"))]


def sharing_row(workload: str, policy: str, r: dict[str, Any]) -> list[str]:
    """The sharing table's row of one run."""
    return [workload, policy, fmt_pct(r["token_utilization"]), fmt_pct(r["reserved_unused"]),
            fmt_int(r["max_concurrency"]),
            fmt_num(per_1k_steps(r)), fmt_num(r["tokens_per_step"]), fmt_int(r["peak_blocks"]),
            fmt_int(r["preemptions"]), fmt_int(r.get("prefix_hit_tokens")), fmt_int(r.get("cow_copies")),
            "yes" if saturated(r) else "no"]


def saturated(r: dict[str, Any]) -> bool:
    """Whether a request ever had to wait for memory in this run (else the pool was never the limit
    and the measured steps are only arrival steps)."""
    return r["failures"] > 0


def command_line(params: dict[str, Any]) -> str:
    """The ``kvservice simulate --report`` command line that reproduces the study."""
    parts = ["kvservice simulate --report",
             f"--workload {params['workload']}",
             f"--requests {params['requests']}",
             f"--rate {params['rate']:g}",
             f"--capacity-tokens {params['capacity_tokens']}",
             f"--max-len {params['max_len']}",
             f"--max-num-seqs {params['max_num_seqs']}",
             f"--seed {params['seed']}",
             "--block-sizes " + ",".join(str(b) for b in params["block_sizes"]),
             f"--sweep-requests {params['sweep_requests']}",
             f"--sharing-requests {params['sharing_requests']}"]
    if (params.get("simulate_kwargs") or {}).get("debug"):
        parts.append("--check")
    if params.get("timeline_points", 400) != 400:
        parts.append(f"--timeline-points {params['timeline_points']}")
    if params.get("target"):
        parts.append(f"--target {params['target']}")
    return " ".join(parts)


# ----------------------------------------------------------------------------- text

def best_block_size(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweep's run with the largest token share (the smaller block on a tie)."""
    return max(runs, key=lambda r: (r["token_utilization"], -r["block_size"]))


def _block_size_text(runs: list[dict[str, Any]]) -> list[str]:
    """Where the block-size optimum lies and why, from the sweep's numbers."""
    if not runs:
        return ["The sweep has no runs."]
    by = sorted(runs, key=lambda r: r["block_size"])
    best = best_block_size(by)
    small, large = by[0], by[-1]
    tok = best["token_utilization"]
    out = [(f"On memory alone, block size **{best['block_size']}** keeps the largest share of the KV memory "
            f"in tokens ({fmt_pct(tok)}).")]
    if len(by) == 1:
        return out
    waste = [last_block_waste(r) for r in by]
    grows = all(b >= a for a, b in itertools.pairwise(waste))
    trend = "grow with the block" if grows else "do not simply grow with the block"
    points = [r for r in by if r is small or r is best or r is large]
    listed = ", ".join(f"{fmt_pct(last_block_waste(r))} at block {r['block_size']}" for r in points)
    out.append(
        f"The slots that allocated blocks leave unfilled (reservation + internal fragmentation: a sequence's "
        f"last block, up to block size − 1 slots each) {trend}: {listed}.")
    if best is not small:
        out.append(
            f"Smaller blocks than {best['block_size']} waste less of the last block but hold no more tokens "
            f"here ({fmt_pct(small['token_utilization'])} at block {small['block_size']}): past that point "
            f"the last block is no longer what limits the batch.")
    out.append(
        f"Small blocks pay elsewhere: the average block table grows from "
        f"{fmt_num(large['avg_block_table_len'])} entries at block {large['block_size']} to "
        f"{fmt_num(small['avg_block_table_len'])} at block {small['block_size']} (metadata per sequence, table "
        f"entries for the attention kernel to read), and a sequence needs a new block, an allocator update, "
        f"every `block_size` generated tokens.")
    t_small = small.get("seconds")
    ref = next((r for r in by if r["block_size"] == 16), None)
    if ref is not None and ref is not small and t_small and ref.get("seconds"):
        out.append(f"The simulated run at block {small['block_size']} took {t_small / ref['seconds']:.1f}× "
                   f"the wall time of block 16's: more allocator updates, longer tables to carry.")
    near = [r for r in by if r["token_utilization"] >= tok - 0.01]
    widest = max(near, key=lambda r: r["block_size"])
    if widest is not best:
        out.append(
            f"Up to block **{widest['block_size']}** the token share stays within one point of the best "
            f"({fmt_pct(widest['token_utilization'])}) with {fmt_num(widest['avg_block_table_len'])} table "
            f"entries per sequence: the largest block that gives up (almost) no memory, and the best "
            f"trade-off by these numbers.")
    else:
        larger = [r for r in by if r["block_size"] > best["block_size"]]
        if larger:
            gaps = "; ".join(
                f"block {r['block_size']}: {100 * (tok - r['token_utilization']):.1f} points less, tables "
                f"{best['avg_block_table_len'] / r['avg_block_table_len']:.0f}× shorter"
                if r["avg_block_table_len"] else f"block {r['block_size']}: "
                f"{100 * (tok - r['token_utilization']):.1f} points less" for r in larger)
            out.append(f"No larger block comes within one point of it; what each larger block gives up in "
                       f"token share, and gains in table length: {gaps}.")
    return out


def _compare_text(study: dict[str, Any]) -> list[str]:
    out = []
    for p, r in study["policies"].items():
        if p not in PAPER:
            continue
        ours, paper = r["token_utilization"], PAPER[p]["token"] / 100
        out.append(f"- **{POLICY_LABELS.get(p, p)}**: {fmt_pct(ours)} of the memory holds tokens, "
                   f"{_points(ours, paper)} than the paper's {PAPER[p]['system']} ({fmt_paper(PAPER[p]['token'])}).")
    pol = study["policies"]
    gaps = []
    for p, r in pol.items():
        paper = PAPER.get(p, {})
        for label, ours, theirs in (("reservation", r["reservation"], paper.get("reservation")),
                                    ("internal fragmentation", r["internal_frag"], paper.get("internal")),
                                    ("external + free", r["external_frag"] + r["free"], paper.get("external_other"))):
            if theirs is not None and abs(100 * ours - theirs) > 5:
                gaps.append(f"{POLICY_LABELS.get(p, p)} {label} {fmt_pct(ours)} against {fmt_paper(theirs)}")
    if gaps:
        out.append(f"- Where our breakdown of the waste departs from the paper's by more than 5 points: "
                   f"{'; '.join(gaps)}. How waste splits between internal and external fragmentation depends "
                   f"on how placement rounds a reservation (here: a buddy allocator rounds every reservation "
                   f"to a power of two, which we count as internal) and on what the paper counts as "
                   f"\"others\"; token state is the figure that compares directly.")
    if "paged" in pol and "max" in pol and pol["max"]["token_utilization"] > 0:
        ratio = pol["paged"]["token_utilization"] / pol["max"]["token_utilization"]
        out.append(f"- Paging holds {ratio:.1f}× as many tokens in the same memory as Max; at its peak it ran "
                   f"{fmt_int(pol['paged']['max_concurrency'])} requests at once against Max's "
                   f"{fmt_int(pol['max']['max_concurrency'])}, and finished the workload in "
                   f"{fmt_int(pol['paged']['steps'])} steps against {fmt_int(pol['max']['steps'])}.")
    if "paged" in pol:
        g = pol["paged"]
        out.append(f"- The SDK's lease reserve held {fmt_pct(g['reserved_unused'])} of the memory on average "
                   f"(at most {fmt_int(g.get('peak_reserved_blocks'))} blocks after a step): blocks the "
                   f"allocator granted in bulk for the next steps' growth, in no block table yet. They are "
                   f"neither free nor holding tokens, and counted apart as *lease reserve*.")
        other = g["external_frag"] + g["free"]
        if other > 0.005:
            out.append(f"- Paging's remaining {fmt_pct(other)} external + free is memory left free at steps "
                       f"when the queue's next request could not start: its prompt's blocks did not fit next "
                       f"to the running sequences' growth, or the batch was at `max_num_seqs`.")
    return out


def _sharing_text(study: dict[str, Any]) -> list[str]:
    ps = study["sharing"]["parallel_sampling"]
    s = ps["saving"]
    verdict = ("more than half" if s > 0.5 else "exactly half" if s == 0.5 else "less than half")
    extra = ps["physical_blocks"] - ps["minimum_blocks"]
    out = [(f"{ps.get('n', '?')} samples of a {ps.get('prompt_len', 0):,}-token prompt "
            f"({fmt_int(ps.get('output_len'))} output tokens each, block {ps.get('block_size', '?')}) occupy "
            f"**{ps['physical_blocks']:,}** physical blocks, against {ps['independent_blocks']:,} if every "
            f"sample held its own copy of the prompt and {ps['minimum_blocks']:,} at the least: sharing saves "
            f"**{fmt_pct(s)}**, {verdict} of the memory (the reference figure for this case: over half).")]
    if extra > 0:
        out.append(f"The allocator holds {extra:,} block(s) more than the minimum.")
    elif extra == 0:
        out.append("The allocator reaches the minimum: no block is held twice.")
    return out


def _workload_text(study: dict[str, Any]) -> list[str]:
    out = []
    for w, runs in study["sharing"]["workloads"].items():
        a, b = runs["paged"], runs["paged-shared"]
        ca, cb = a["max_concurrency"], b["max_concurrency"]
        ta, tb = per_1k_steps(a), per_1k_steps(b)
        conc = ("raises the peak concurrency from" if cb > ca else
                "lowers the peak concurrency from" if cb < ca else "leaves the peak concurrency at")
        conc_txt = f"{conc} {ca:,} to {cb:,} requests" if cb != ca else f"{conc} {ca:,} requests"
        if ta > 0:
            thr = (f"and changes completed requests per 1k steps by {100 * (tb - ta) / ta:+.1f}% "
                   f"({fmt_num(ta)} → {fmt_num(tb)})")
        else:
            thr = f"with {fmt_num(tb)} completed requests per 1k steps"
        line = (f"- **{w}**: sharing {conc_txt} {thr}; the workload took {fmt_int(b['steps'])} steps "
                f"instead of {fmt_int(a['steps'])}.")
        idle = [(pol, r) for pol, r in (("paged", a), ("paged-shared", b)) if not saturated(r)]
        if idle:
            names = " and ".join(f"`{x}`" for x, _ in idle)
            peak = max(r["max_concurrency"] for _, r in idle)
            line += (f" Under {names} no request ever waited for memory: the arrivals or the batch limit "
                     f"(`max_num_seqs` {study['params']['max_num_seqs']}; at most {peak:,} requests ran at "
                     f"once) set the pace, not the pool, so its token share is not comparable with a "
                     f"memory-bound run's.")
        out.append(line)
    return out


def _trace_rows(study: dict[str, Any]) -> list[list[str]]:
    rows = []
    for t in study.get("workloads", []):
        paper = PAPER_MEANS.get(t["workload"])
        rows.append([f"`{t['workload']}`", fmt_int(t["requests"]), f"{t['rate']:g}", str(t.get("samples", 1)),
                     fmt_int(t.get("shared_prefix", 0)), fmt_num(t["mean_prompt"]), fmt_num(t["mean_output"]),
                     f"{paper[0]} / {paper[1]}" if paper else "", t.get("description", "")])
    return rows


def render_markdown(study: dict[str, Any]) -> str:
    """The page's markdown (images are referenced as ``img/memory-*.png``)."""
    P = study["params"]
    pol = study["policies"]
    L: list[str] = []
    add = L.append

    add("# Memory study: where the KV cache memory goes")
    add("")
    add("How much of the KV memory holds tokens when each sequence gets one contiguous reservation (sized "
        "for the maximum length, a power of two, or the exact final length) and when kvservice pages it; "
        "how the block size trades memory against block-table length; and what sharing saves. Every "
        "number on this page was produced by the simulator with the parameters below; the only numbers "
        "not computed here are the vLLM paper's, marked *paper*.")
    add("")
    add("*This page is generated by the command below; do not edit it by hand.*")
    add("")

    # -- how it was produced
    add("## How this page was produced")
    add("")
    add("```sh")
    add("make study     # runs: .venv/bin/kvservice simulate --report")
    add(command_line(P))
    add("```")
    add("")
    reserve = ("The study's own allocator caps every lease's reserve at its size under memory pressure "
               "(`--reserve-pressure-share 1`: `reserve_min_blocks`, 4 by default, what the default settings "
               "give a memory-bound pool), so that the reserve after a step does not depend on when the SDK's "
               "background flusher ran. " if not P.get("target") else
               "The reserve's size follows the settings of the allocator at the target. ")
    add("The second line is the same run with every parameter spelled out. The simulator is a "
        "continuous-batching step loop (FCFS admission, one token per running sample per step); the "
        "contiguous policies place their reservations with a buddy allocator, the paged policies run on "
        "the real kvservice allocator through the SDK in local mode, as the engine does (one fresh pool per "
        "run; a step's frees, appends and forks change the SDK's block tables at once, taking blocks from "
        "the lease's reserve; a flush has the allocator apply them; the step's creates make one call). "
        + reserve + "Runs are deterministic for a seed, except for which cached blocks a reserve refill "
        "evicts (it depends on when the flusher sent it): prefix-hit tokens and evictions of the paged "
        "runs may differ a little from one run to the next.")
    add("")
    ps = study["sharing"]["parallel_sampling"]
    target = f"`{P['target']}`" if P.get("target") else "a local allocator with an embedded Redis, started for the study"
    rows = [
        ("workload (parts 1, 2)", f"`{P['workload']}`"),
        ("seed", P["seed"]),
        ("requests (part 1)", f"{P['requests']:,}"),
        ("requests (part 2, block sizes)", f"{P['sweep_requests']:,}"),
        ("requests (part 3, sharing workloads)", f"{P['sharing_requests']:,}"),
        ("arrival rate (parts 1, 2)", f"{P['rate']:g} per step"),
        ("KV capacity", f"{P['capacity_tokens']:,} token slots"),
        ("max_len", f"{P['max_len']:,} tokens"),
        ("max_num_seqs", P["max_num_seqs"]),
        ("block sizes (part 2)", ", ".join(str(b) for b in P["block_sizes"])),
        ("parallel sampling (part 3)", (f"n = {ps.get('n', P['sharing_n'])}, prompt "
                                        f"{ps.get('prompt_len', P['sharing_prompt_len']):,} tokens, output "
                                        f"{fmt_int(ps.get('output_len'))} tokens per sample")),
        ("timeline points", P.get("timeline_points", "")),
        ("allocator (paged policies)", target),
    ]
    L += _table(("parameter", "value"), rows)
    add("")
    smaller = [name for name, n in (("part 2", P["sweep_requests"]), ("part 3", P["sharing_requests"]))
               if n < P["requests"]]
    if smaller:
        add(f"To keep the study's run time down, {' and '.join(smaller)} "
            f"{'use' if len(smaller) > 1 else 'uses'} fewer requests than part 1 "
            f"(see above); shares compare across parts, counts (steps, concurrency) only within a part.")
        add("")
    trace_rows = _trace_rows(study)
    if trace_rows:
        add("The traces (lengths are lognormal draws clipped to `max_len`; arrivals are Poisson; part 3's "
            "workloads arrive at their presets' own rates):")
        add("")
        L += _table(("workload", "requests", "rate / step", "samples", "shared prefix", "mean prompt",
                     "mean output", "paper's means (in / out)", "description"), trace_rows, "lrrrrrrrl")
        add("")
    add(f"Wall time of each run (the whole study: {fmt_seconds(study.get('seconds'))}):")
    add("")
    L += _table(("part", "workload", "policy", "block size", "requests", "steps", "wall time", "pool audit"),
                ((r["part"], r["workload"], r["policy"],
                  r["block_size"] if str(r["policy"]).startswith("paged") else "",
                  f"{r['requests']:,}", fmt_int(r["steps"]) if r.get("steps") is not None else "",
                  fmt_seconds(r["seconds"]),
                  ("ok" if r.get("audit_ok", True) else "FAILED") if str(r["policy"]).startswith("paged") else "")
                 for r in study.get("runs", [])), "llllrrrl")
    add("")
    add("*pool audit*: after each paged run the allocator checks its pool's invariants (every block free, "
        "cached, referenced or in one lease's reserve, reference counts equal to the block tables holding "
        "them, the prefix hashes consistent) and that no block is still in use.")
    add("")

    # -- definitions
    add("## What is measured")
    add("")
    add("After every step the simulator splits the KV capacity (token slots) into six states that add up "
        "to 100%. For a live sample with `A` allocated slots (contiguous: its buddy block; paged: the "
        "slots of its blocks, a block shared by several samples counted once), `t` tokens in its KV and "
        "final length `f`:")
    add("")
    add("- **token state** = `t`: slots holding tokens (prompt and output so far), the useful part.")
    add("- **reservation** = `min(A, f) − t`: slots held for tokens that will come. A contiguous policy "
        "holds them from admission on; a paged sequence only in its last block.")
    add("- **internal fragmentation** = `A − min(A, f)`: slots that will never hold a token: a reservation "
        "for `max_len` (Max) or for the output rounded up to a power of two (Pow2), the buddy allocator's "
        "rounding to a power of two (all contiguous policies, Oracle's only waste of this kind), the unused "
        "tail of a paged sequence's final block.")
    add("- **external fragmentation**: at a step where the queue's next request could not be placed although "
        "the free slots were at least what it needed, all free slots (stranded in holes); else 0.")
    add("- **lease reserve (unused)**: paged: the slots of the blocks in the SDK's lease reserve after the "
        "step: the allocator granted them to the lease in bulk (DESIGN §5) and they are in no block table "
        "yet, so they are neither free nor holding tokens; contiguous: 0.")
    add("- **free**: the remaining free slots.")
    add("")
    add("**Measured steps.** Shares are averaged over the steps that start with a non-empty waiting queue, "
        "i.e. while memory (or the batch limit) holds requests back; ramp-up and drain, when memory is free "
        "because there is nothing to run, are left out. The paper's last state is \"external "
        "fragmentation and others\"; we compare it with our external fragmentation **plus** free, and "
        "show the lease reserve beside it.")
    unmeasured = [f"{r['policy']} on {r.get('workload') or '?'}" for r in _all_runs(study)
                  if r.get("measured_regime") is False]
    if unmeasured:
        add("")
        add(f"No step of these runs started with a waiting request, so all their steps were measured: "
            f"{', '.join(unmeasured)}.")
    add("")
    add("**Counters.** *max concurrency*: the most requests running at once (a request with n samples "
        "counts once). *completed / 1k steps*: requests finished per 1,000 steps over the whole run. "
        "*failures*: requests that had to wait for memory at least once, plus (paged) steps that preempted "
        "and allocator refusals. *failed*: requests that could never run (longer than `max_len`, or not "
        "fitting the empty pool). *preemptions*: requests a paged run evicted to let the running ones grow "
        "(recomputed when admitted again).")
    add("")

    # -- table 1
    add("## 1. Policies: share of KV memory")
    add("")
    add(f"Workload `{P['workload']}`, {P['requests']:,} requests, {P['capacity_tokens']:,} token slots. "
        "Rows marked *paper* are the vLLM paper's (Kwon et al., SOSP 2023, Fig. 2: Orca with each "
        "reservation policy, and vLLM); blank where the paper gives no number.")
    add("")
    header = ("policy", "source", "token state", "reservation", "internal frag.", "external frag.", "free",
              "external + free", "lease reserve", "max concurrency", "completed / 1k steps", "failures", "failed",
              "preemptions")
    rows = []
    for p, r in pol.items():
        rows.append(table1_row(p, r))
        if p in PAPER:
            rows.append(paper_row(p))
    L += _table(header, rows, "llrrrrrrrrrrrr")
    add("")
    L += _compare_text(study)
    add("")
    add("![Where the KV memory goes, per policy](img/memory-breakdown.png)")
    add("")
    add("*Plot 1.* Our breakdown per policy (stacked, averaged over the measured steps); the dashed line on "
        "each bar is the paper's token share for that policy.")
    add("")

    # -- block sizes
    add("## 2. Block size")
    add("")
    add(f"`paged` on the same workload ({P['sweep_requests']:,} requests, {P['capacity_tokens']:,} slots) at "
        "each block size. A block table has one entry per block of a sequence; *average block-table "
        "length* is the mean over the measured steps of block-table entries per running sample.")
    add("")
    L += _table(("block size", "token state", "reservation", "internal frag.", "external + free", "lease reserve",
                 "avg block-table length", "peak blocks", "max concurrency", "completed / 1k steps",
                 "preemptions", "wall time"),
                (sweep_row(r) for r in study["block_sizes"]), "rrrrrrrrrrrr")
    add("")
    add(" ".join(_block_size_text(study["block_sizes"])))
    add("")
    add("![Token share, unfilled slots and block-table length vs block size](img/memory-block-size.png)")
    add("")
    add("*Plot 2.* Left: token state, the unfilled slots of allocated blocks and internal fragmentation per "
        "block size (log₂ axis). Right: the average block-table length (log axes).")
    add("")

    # -- over time
    add("## 3. Over time")
    add("")
    add("![Token share and running requests over the run, per policy](img/memory-over-time.png)")
    add("")
    add("*Plot 3.* Top: the share of KV memory holding tokens (all steps, measured or not; averaged into at "
        f"most {P.get('timeline_points', '')} points per run). Bottom: requests running. A policy that "
        "wastes less memory runs more requests at once and finishes the same trace in fewer steps.")
    add("")
    steps = "; ".join(f"{POLICY_LABELS.get(p, p)} {fmt_int(r['steps'])} ({fmt_int(r['measured_steps'])} measured)"
                      for p, r in pol.items())
    add(f"Steps to finish the trace: {steps}.")
    add("")

    # -- sharing
    add("## 4. Sharing")
    add("")
    add("**Parallel sampling on a long prompt**, on the real allocator: the samples are forks of one "
        "sequence and share the prompt's blocks (reference counts; a shared block that is written is "
        "copied first).")
    add("")
    ps = study["sharing"]["parallel_sampling"]
    L += _table(("prompt tokens", "samples", "output tokens", "block size", "independent blocks",
                 "minimum blocks", "physical blocks", "saving"),
                [(fmt_int(ps.get("prompt_len")), ps.get("n", ""), fmt_int(ps.get("output_len")),
                  ps.get("block_size", ""), fmt_int(ps["independent_blocks"]), fmt_int(ps["minimum_blocks"]),
                  fmt_int(ps["physical_blocks"]), fmt_pct(ps["saving"]))], "rrrrrrrr")
    add("")
    add("*independent*: every sample with its own copy of the prompt; *minimum*: the prompt's full blocks "
        "once plus each sample's own blocks for the rest; *physical*: what the allocator holds; "
        "*saving* = 1 − physical / independent.")
    add("")
    add(" ".join(_sharing_text(study)))
    add("")
    add(f"**Workloads with sharing** ({P['sharing_requests']:,} requests each, block 16, the same capacity): `parallel` "
        "(ShareGPT lengths, 4 samples per request) and `system-prompt` (a system prompt common to every "
        "request plus a short user part), under `paged` (every sample owns all its blocks) and "
        "`paged-shared` (the samples are forks; the system prompt's blocks come from the prefix cache). "
        "Throughput: completed requests per 1,000 steps and generated tokens per step. *memory-bound*: "
        "some request had to wait for memory.")
    add("")
    rows = [sharing_row(w, p, r) for w, runs in study["sharing"]["workloads"].items() for p, r in runs.items()]
    L += _table(("workload", "policy", "token state", "lease reserve", "max concurrency", "completed / 1k steps",
                 "tokens / step", "peak blocks", "preemptions", "prefix-hit tokens", "copy-on-write copies",
                 "memory-bound"), rows, "llrrrrrrrrrl")
    add("")
    L += _workload_text(study)
    add("")
    add("![Sharing: parallel-sampling blocks and the sharing workloads](img/memory-sharing.png)")
    add("")
    add("*Plot 4.* Left: blocks held by the parallel samples. Middle and right: peak concurrency and "
        "throughput, `paged` vs `paged-shared`.")
    add("")

    # -- reading guide
    add("## Reading guide")
    add("")
    mx, pg = pol.get("max"), pol.get("paged")
    add("- **Token state is the number to size memory by.** It is the share of the KV memory doing useful "
        "work while requests wait; the rest is memory paid for and not used."
        + (f" Here Max puts {fmt_pct(mx['token_utilization'])} of it to work and paging "
           f"{fmt_pct(pg['token_utilization'])}." if mx and pg else ""))
    add("- **Reservation and internal fragmentation** are the price of sizing a sequence's memory up front. "
        "Reservation turns into token state as the sequence generates; internal fragmentation never does. "
        "A large internal share means `max_len` (or its rounding) is far above the lengths actually served.")
    add("- **External fragmentation** comes from contiguous placement as sequences of different sizes come "
        "and go: memory is free but in the wrong shape. Paged memory has next to none: any free block "
        "serves any sequence.")
    add("- **Max concurrency and completed / 1k steps** turn the shares into capacity: more tokens per GiB "
        "means a larger batch, and a larger batch means more requests finished per step. Many *failures* "
        "(waits) with few *failed* requests means memory, not request size, is the bottleneck; "
        "*preemptions* are the price paging pays for admitting without reserving (recomputation).")
    add("- **Block size** trades the last block's unfilled slots (up to `block_size − 1` per sequence) "
        "against block-table length and allocator updates per token. Pick the largest block whose token "
        "share is close to the best (part 2), within what the attention kernels support.")
    add("- **Sharing** pays off when sequences share long prefixes: parallel samples share their prompt, "
        "requests with a common system prompt share its full blocks. The memory saved goes to more "
        "requests at once.")
    add("- **Lease reserve** is what a decode step without allocator calls costs in memory: each engine's "
        "SDK holds a few blocks ahead of its growth, in no table. Its share is the cap over the pool's size: "
        "a few blocks per engine under pressure, about 1% of the pool at most otherwise.")
    add("")
    return "\n".join(L)


def _all_runs(study: dict[str, Any]) -> list[dict[str, Any]]:
    runs = list(study["policies"].values())
    runs += [r for r in study["block_sizes"] if all(r is not x for x in runs)]
    runs += [r for w in study["sharing"]["workloads"].values() for r in w.values()]
    return runs


def write_report(study: dict[str, Any], out_dir: Path) -> Path:
    """Writes ``out_dir/memory-study.md`` and ``out_dir/img/memory-*.png``.

    Args:
        study: what :func:`kvservice.simulate.study.run_study` returned.
        out_dir: the folder of the page (created if missing).

    Returns:
        The markdown file's path.
    """
    out_dir = Path(out_dir)
    img = out_dir / "img"
    img.mkdir(parents=True, exist_ok=True)
    from kvservice.simulate import plots

    plots.plot_breakdown(study, img / IMAGES[0])
    plots.plot_block_size(study, img / IMAGES[1])
    plots.plot_over_time(study, img / IMAGES[2])
    plots.plot_sharing(study, img / IMAGES[3])
    path = out_dir / "memory-study.md"
    path.write_text(render_markdown(study) + "\n", encoding="utf-8")
    return path
