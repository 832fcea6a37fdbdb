"""The memory study's report (``kvservice simulate --report``): a tiny real study through
``study.main`` (simulator, local allocator process, report), then the page and the plots."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import struct
from pathlib import Path

import pytest

from kvservice.simulate import report
from kvservice.simulate import study as study_mod

pytestmark = pytest.mark.e2e

SEED = 23
PARAMS = dict(
    workload="sharegpt", requests=24, rate=1.0, capacity_tokens=4096, max_len=512, seed=SEED,
    max_num_seqs=32, target="", block_sizes="8,16,64", json=True,
    sweep_requests=0, sharing_requests=12, sharing_prompt_len=200, sharing_n=4, sharing_output_len=12,
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Runs ``study.main`` once; returns (study dict from its JSON, markdown text, out dir)."""
    out = tmp_path_factory.mktemp("study")
    args = argparse.Namespace(**PARAMS, out_dir=str(out))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = study_mod.main(args)
    assert rc == 0
    study = json.loads(stdout.getvalue())
    md = (out / "memory-study.md").read_text(encoding="utf-8")
    return study, md, out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _lines(md: str) -> list[str]:
    return md.splitlines()


def test_study_shape(generated):
    study, _, _ = generated
    assert list(study["policies"]) == ["max", "pow2", "oracle", "paged"]
    assert [r["block_size"] for r in study["block_sizes"]] == [8, 16, 64]
    assert all(r["policy"] == "paged" for r in study["block_sizes"])
    # the block-16 point of the sweep is part 1's paged run (same requests)
    assert study["block_sizes"][1]["steps"] == study["policies"]["paged"]["steps"]
    assert set(study["sharing"]["workloads"]) == {"parallel", "system-prompt"}
    for runs in study["sharing"]["workloads"].values():
        assert set(runs) == {"paged", "paged-shared"}
        assert all(r["num_requests"] == 12 for r in runs.values())
    ps = study["sharing"]["parallel_sampling"]
    assert ps["minimum_blocks"] <= ps["physical_blocks"] <= ps["independent_blocks"]
    every = list(study["policies"].values()) + study["block_sizes"] + [
        r for runs in study["sharing"]["workloads"].values() for r in runs.values()]
    for r in every:
        total = (r["token_utilization"] + r["reservation"] + r["internal_frag"] + r["external_frag"]
                 + r["reserved_unused"] + r["free"])
        assert total == pytest.approx(1.0, abs=1e-6), r["policy"]
        paged = r["policy"].startswith("paged")
        assert (r["reserved_unused"] > 0) == paged, r["policy"]   # the SDK's lease reserve: paged runs only
        assert not paged or 1 <= r["peak_reserved_blocks"] <= 4   # the study allocator's cap
    p = study["params"]
    assert (p["seed"], p["requests"], p["capacity_tokens"], p["max_len"]) == (SEED, 24, 4096, 512)
    assert p["sweep_requests"] == 24 and p["sharing_requests"] == 12
    assert len(study["runs"]) == 4 + 2 + 1 + 4  # the block-16 sweep point is not run twice


def test_sections_and_parameters(generated):
    _, md, _ = generated
    for heading in ("# Memory study", "## How this page was produced", "## What is measured",
                    "## 1. Policies: share of KV memory", "## 2. Block size", "## 3. Over time",
                    "## 4. Sharing", "## Reading guide"):
        assert re.search(rf"^{re.escape(heading)}", md, re.MULTILINE), heading
    assert "make study" in md and "kvservice simulate --report" in md
    lines = _lines(md)
    assert _row(("seed", SEED)) in lines
    assert _row(("requests (part 1)", "24")) in lines
    assert _row(("requests (part 3, sharing workloads)", "12")) in lines
    assert _row(("KV capacity", "4,096 token slots")) in lines
    assert _row(("max_len", "512 tokens")) in lines
    assert _row(("max_num_seqs", 32)) in lines
    assert _row(("block sizes (part 2)", "8, 16, 64")) in lines
    assert ("kvservice simulate --report --workload sharegpt --requests 24 --rate 1 --capacity-tokens 4096 "
            f"--max-len 512 --max-num-seqs 32 --seed {SEED} --block-sizes 8,16,64 --sweep-requests 24 "
            "--sharing-requests 12") in md
    # part 3 used fewer requests than part 1: the page says so
    assert "part 3 uses fewer requests than part 1" in md
    # no dates: regenerating the page only changes what the runs change
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", md)
    for name in ("token state", "reservation", "internal fragmentation", "external fragmentation",
                 "lease reserve (unused)", "free", "Measured steps"):
        assert f"**{name}" in md, name


def test_table1_ours_and_paper(generated):
    study, md, _ = generated
    lines = _lines(md)
    labels = {"max": "Max", "pow2": "Pow2", "oracle": "Oracle", "paged": "paged (block 16)"}
    for policy, r in study["policies"].items():
        expected = _row([labels[policy], "ours", _pct(r["token_utilization"]), _pct(r["reservation"]),
                         _pct(r["internal_frag"]), _pct(r["external_frag"]), _pct(r["free"]),
                         _pct(r["external_frag"] + r["free"]), _pct(r["reserved_unused"]), f"{r['max_concurrency']:,}",
                         f"{1000 * r['completed_per_step']:,.1f}", f"{r['failures']:,}", f"{r['failed']:,}",
                         f"{r['preemptions']:,}"])
        assert expected in lines, expected
    # the paper's numbers, labelled as the paper's
    blank = [""] * 6
    assert _row(["Max", "paper: Orca (Max)", "20.4%", "13.3%", "57.3%", "", "", "8.9%", *blank]) in lines
    assert _row(["Pow2", "paper: Orca (Pow2)", "26.8%", "17.9%", "13.6%", "", "", "41.6%", *blank]) in lines
    assert _row(["Oracle", "paper: Orca (Oracle)", "38.2%", "", "", "", "", "", *blank]) in lines
    assert _row(["paged (block 16)", "paper: vLLM", "96.3%", "", "", "", "", "", *blank]) in lines
    paged = study["policies"]["paged"]
    assert f"**paged (block 16)**: {_pct(paged['token_utilization'])} of the memory holds tokens" in md
    assert (f"The SDK's lease reserve held {_pct(paged['reserved_unused'])} of the memory on average "
            f"(at most {paged['peak_reserved_blocks']:,} blocks after a step)") in md


def test_block_size_table_and_optimum(generated):
    study, md, _ = generated
    lines = _lines(md)
    for r in study["block_sizes"]:
        row = [r["block_size"], _pct(r["token_utilization"]), _pct(r["reservation"]), _pct(r["internal_frag"]),
               _pct(r["external_frag"] + r["free"]), _pct(r["reserved_unused"]), f"{r['avg_block_table_len']:,.1f}",
               f"{r['peak_blocks']:,}"]
        assert any(line.startswith(_row(row)[:-1]) for line in lines), row
    best = max(study["block_sizes"], key=lambda r: (r["token_utilization"], -r["block_size"]))
    assert f"block size **{best['block_size']}** keeps the largest share" in md


def test_sharing_section(generated):
    study, md, _ = generated
    lines = _lines(md)
    ps = study["sharing"]["parallel_sampling"]
    assert f"**{ps['physical_blocks']:,}** physical blocks" in md
    assert f"**{_pct(ps['saving'])}**" in md
    assert ps["saving"] == pytest.approx(1 - ps["physical_blocks"] / ps["independent_blocks"], abs=1e-9)
    for w, runs in study["sharing"]["workloads"].items():
        for policy, r in runs.items():
            row = _row([w, policy, _pct(r["token_utilization"]), _pct(r["reserved_unused"]),
                        f"{r['max_concurrency']:,}", f"{1000 * r['completed_per_step']:,.1f}",
                        f"{r['tokens_per_step']:,.1f}"])
            assert any(line.startswith(row[:-1]) for line in lines), row


def test_plots_are_pngs(generated):
    _, md, out = generated
    for name in report.IMAGES:
        path = Path(out, "img", name)
        assert path.is_file(), name
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 400 and height >= 250, (name, width, height)
        assert len(data) > 10_000, (name, len(data))
        assert f"(img/{name})" in md, name


def test_block_sizes_argument_forms():
    assert study_mod.parse_block_sizes("1,8,16") == (1, 8, 16)
    assert study_mod.parse_block_sizes([1, 8, 16]) == (1, 8, 16)
    assert study_mod.parse_block_sizes(["1,8", "16"]) == (1, 8, 16)
    assert study_mod.parse_block_sizes(None) == study_mod.BLOCK_SIZES
    with pytest.raises(ValueError):
        study_mod.parse_block_sizes("8,0")
    args = argparse.Namespace(seed=3, requests=10, rate=2.0, capacity_tokens=999, max_len=256,
                              max_num_seqs=8, target="", workload="alpaca", block_sizes=[16, 32])
    p = study_mod.params_from_args(args)
    assert (p.seed, p.requests, p.capacity_tokens, p.workload, p.block_sizes) == (3, 10, 999, "alpaca", (16, 32))


def test_bad_parameters_exit_2(tmp_path, capsys):
    base = {**PARAMS, "out_dir": str(tmp_path)}
    for bad in ({"capacity_tokens": 4000}, {"block_sizes": "8,24"}, {"workload": "nope"},
                {"capacity_tokens": 256}):
        assert study_mod.main(argparse.Namespace(**{**base, **bad})) == 2, bad
        assert "kvservice simulate --report:" in capsys.readouterr().err
    assert not (tmp_path / "memory-study.md").exists()
