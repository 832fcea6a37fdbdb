"""The memory study's four plots (matplotlib, Agg backend, a fixed DPI), from the study dict.

Colours, labels and the paper's numbers are shared with :mod:`kvservice.simulate.report`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvservice.simulate.report import (DPI, PAPER, POLICY_COLORS, POLICY_LABELS, STATES, fmt_pct,
                                       last_block_waste, per_1k_steps)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)


def plot_breakdown(study: dict[str, Any], path: Path) -> None:
    """Plot 1: our breakdown per policy, stacked, with the paper's token share marked."""
    plt = _pyplot()
    policies = list(study["policies"])
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    x = list(range(len(policies)))
    bottom = [0.0] * len(policies)
    for key, _, label, color in STATES:
        vals = [100 * study["policies"][p][key] for p in policies]
        ax.bar(x, vals, 0.6, bottom=bottom, label=label, color=color, edgecolor="white", linewidth=0.5)
        for i, v in enumerate(vals):
            if v >= 4:
                ax.text(i, bottom[i] + v / 2, f"{v:.1f}", ha="center", va="center", fontsize=8,
                        color="white" if key != "free" else "black")
        bottom = [b + v for b, v in zip(bottom, vals)]
    marked = False
    for i, p in enumerate(policies):
        if p in PAPER:
            y = PAPER[p]["token"]
            ax.plot([i - 0.38, i + 0.38], [y, y], color="black", linewidth=2, linestyle="--",
                    label=None if marked else "paper: token state")
            ax.text(i + 0.4, y, f"{y:.1f}", va="center", fontsize=8)
            marked = True
    ax.set_xticks(x, [POLICY_LABELS.get(p, p) for p in policies])
    ax.set_xlim(-0.6, len(policies) - 0.15)
    ax.set_ylim(0, 100)
    ax.set_ylabel("share of KV memory (%)")
    ax.set_title("Where the KV memory goes (averaged over the measured steps)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    _save(fig, path)


def plot_block_size(study: dict[str, Any], path: Path) -> None:
    """Plot 2: token share, unfilled slots and block-table length vs block size."""
    plt = _pyplot()
    runs = study["block_sizes"]
    bs = [r["block_size"] for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    tok = [100 * r["token_utilization"] for r in runs]
    ax1.plot(bs, tok, "o-", color="#2e7d32", label="token state")
    for xv, yv in zip(bs, tok):
        ax1.annotate(f"{yv:.1f}", (xv, yv), textcoords="offset points", xytext=(0, -13), ha="center", fontsize=7)
    ax1.plot(bs, [100 * last_block_waste(r) for r in runs], "^-", color="#f9a825",
             label="unfilled slots of last blocks\n(reservation + internal)")
    ax1.plot(bs, [100 * r["internal_frag"] for r in runs], "s-", color="#ef6c00", label="internal fragmentation")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(bs, [str(b) for b in bs])
    ax1.set_xlabel("block size (tokens)")
    ax1.set_ylabel("share of KV memory (%)")
    ax1.set_ylim(0, 100)
    ax1.set_title("Memory vs block size (paged)")
    ax1.legend(fontsize=8, loc="center left")
    ax2.plot(bs, [r["avg_block_table_len"] for r in runs], "o-", color="#1565c0")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xticks(bs, [str(b) for b in bs])
    ax2.set_xlabel("block size (tokens)")
    ax2.set_ylabel("average block-table length (entries)")
    ax2.set_title("Block-table length vs block size")
    _save(fig, path)


def plot_over_time(study: dict[str, Any], path: Path) -> None:
    """Plot 3: token share and running sequences over the steps, per policy."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.6), sharex=True)
    for p, r in study["policies"].items():
        tl = r.get("timeline") or {}
        steps = tl.get("step") or []
        if not steps:
            continue
        color = POLICY_COLORS.get(p)
        ax1.plot(steps, [100 * v for v in tl["token"]], color=color, linewidth=1.2,
                 label=POLICY_LABELS.get(p, p))
        ax2.plot(steps, tl["running"], color=color, linewidth=1.2, label=POLICY_LABELS.get(p, p))
    ax1.set_ylabel("token state (% of KV memory)")
    ax1.set_ylim(0, 100)
    ax1.set_title("KV memory holding tokens, over the run", pad=24)
    ax1.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=5, frameon=False)
    ax2.set_ylabel("running requests")
    ax2.set_xlabel("engine step")
    _save(fig, path)


def plot_sharing(study: dict[str, Any], path: Path) -> None:
    """Plot 4: the parallel-sampling blocks, and paged vs paged-shared on the sharing workloads."""
    plt = _pyplot()
    ps = study["sharing"]["parallel_sampling"]
    wls = study["sharing"]["workloads"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
    ax = axes[0]
    names = ["independent", "physical\n(shared)", "minimum"]
    vals = [ps["independent_blocks"], ps["physical_blocks"], ps["minimum_blocks"]]
    ax.bar(names, vals, color=["#90a4ae", "#6a1b9a", "#2e7d32"])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:,}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("KV blocks")
    ax.set_title(f"n={ps.get('n', '?')} samples, {ps.get('prompt_len', '?'):,}-token prompt\n"
                 f"saving {fmt_pct(ps['saving'])}")
    workloads = list(wls)
    width = 0.38
    pols = ("paged", "paged-shared")
    ax = axes[1]
    for j, pol in enumerate(pols):
        xs = [i + (j - 0.5) * width for i in range(len(workloads))]
        ys = [wls[w][pol]["max_concurrency"] for w in workloads]
        ax.bar(xs, ys, width, color=POLICY_COLORS[pol], label=pol)
        for xv, yv in zip(xs, ys):
            ax.text(xv, yv, f"{yv:,}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max([1] + [wls[w][p]["max_concurrency"] for w in workloads for p in pols]) * 1.3)
    ax.set_title("peak concurrency (requests running)")
    ax = axes[2]
    for j, pol in enumerate(pols):
        xs = [i + (j - 0.5) * width for i in range(len(workloads))]
        base = [per_1k_steps(wls[w]["paged"]) for w in workloads]
        vals = [per_1k_steps(wls[w][pol]) for w in workloads]
        ys = [v / b if b else 0.0 for v, b in zip(vals, base)]
        ax.bar(xs, ys, width, color=POLICY_COLORS[pol], label=pol)
        for xv, yv, v in zip(xs, ys, vals):
            ax.text(xv, yv, f"{yv:.2f}×\n({v:.1f})", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, max([1.0] + [per_1k_steps(wls[w][p]) / per_1k_steps(wls[w]["paged"])
                                for w in workloads for p in pols if per_1k_steps(wls[w]["paged"])]) * 1.35)
    ax.set_title("throughput relative to paged\n(completed requests / 1k steps in brackets)")
    for ax in axes[1:]:
        ax.set_xticks(range(len(workloads)), workloads)
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    _save(fig, path)
