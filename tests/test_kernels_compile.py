"""CPU-only checks of the CUDA kernels: every instantiation compiles through NVRTC for
sm_80 and sm_90 (no GPU, no driver), a broken source is caught, and the launch
arithmetic of ``kernels.cuda_backend`` (row tiles, split-K) covers every row once."""

from __future__ import annotations

import os
import random

import pytest

from kernels import cuda_backend as cb

try:
    from kernels import nvrtc_check
    NVRTC_VERSION = nvrtc_check.nvrtc_version()
    NVRTC_ERROR = None
except Exception as exc:  # the library or its CuPy binding is missing
    NVRTC_VERSION = None
    NVRTC_ERROR = f"NVRTC cannot be loaded ({type(exc).__name__}: {exc}); install cupy-cuda12x and nvidia-cuda-nvrtc-cu12"

#: `make test` always installs NVRTC (the project's `cuda` extra), so a missing one is a
#: failure, not a skip: the compile check must never pass silently. An environment that
#: deliberately has no NVRTC sets KVSERVICE_ALLOW_NO_NVRTC=1 to skip instead.
needs_nvrtc = pytest.mark.skipif(NVRTC_VERSION is None and os.environ.get("KVSERVICE_ALLOW_NO_NVRTC") == "1",
                                 reason=NVRTC_ERROR or "")


def test_nvrtc_is_available():
    if NVRTC_VERSION is None and os.environ.get("KVSERVICE_ALLOW_NO_NVRTC") != "1":
        pytest.fail(NVRTC_ERROR)


@pytest.fixture(scope="module")
def compiled():
    """Every source file for both architectures, compiled once for the module."""
    results = nvrtc_check.check_all(nvrtc_check.ARCHES, ptxas_verbose=True)   # (and ptxas's report)
    return {(r.file, r.arch): r for r in results}


@needs_nvrtc
@pytest.mark.parametrize("arch", nvrtc_check.ARCHES if NVRTC_VERSION else ["sm_80", "sm_90"])
def test_every_instantiation_compiles(compiled, arch):
    wanted = cb.instantiations()
    for file, names in wanted.items():
        result = compiled[(file, arch)]
        assert sorted(result.lowered) == sorted(names)
        for name in names:
            lowered = result.lowered[name]
            assert lowered.startswith("_Z"), f"{name} ({arch}): lowered name {lowered!r}"
        # Distinct instantiations get distinct symbols.
        assert len(set(result.lowered.values())) == len(names)


@needs_nvrtc
def test_no_instantiation_spills_more_than_when_the_table_was_made(compiled):
    """kernels/resources.json (``python -m kernels.nvrtc_check --write-baseline``) holds each
    instantiation's registers and spills; a change that spills more fails here."""
    table = nvrtc_check.resource_table(list(compiled.values()))
    version, baseline = nvrtc_check.read_baseline()
    assert ".".join(map(str, NVRTC_VERSION)) == version, \
        f"the table is NVRTC {version}'s (pyproject pins it): regenerate it for another"
    assert sum(map(len, table.values())) == len(nvrtc_check.ARCHES) * sum(map(len, cb.instantiations().values()))
    assert nvrtc_check.more_spills(table, baseline) == []
    # (the check sees one byte more than recorded, and an instantiation the table lacks)
    name, r = next(iter(table["sm_90"].items()))
    spilling = {**table, "sm_90": {**table["sm_90"], name: nvrtc_check.Resources(
        r.registers, r.spill_stores + 4, r.spill_loads + 4, r.stack + 4)}}
    assert [p.split(":")[0] for p in nvrtc_check.more_spills(spilling, baseline)] == [f"sm_90 {name}"]
    lacking = {**baseline, "sm_90": {n: x for n, x in baseline["sm_90"].items() if n != name}}
    assert "not in resources.json" in nvrtc_check.more_spills(table, lacking)[0]


def test_the_docs_show_the_recorded_register_and_spill_table():
    from pathlib import Path

    _, baseline = nvrtc_check.read_baseline()
    docs = (Path(__file__).resolve().parent.parent / "docs" / "kernels.md").read_text()
    assert nvrtc_check.markdown(baseline) in docs, "refresh docs/kernels.md: python -m kernels.nvrtc_check --table"


def test_instantiations_cover_every_launch():
    """Every kernel name a launcher can build is in the list the modules and the check use."""
    from kernels.backend import DTYPES, HEAD_DIMS
    inst = cb.instantiations()
    attention = set(inst[cb.ATTENTION_SOURCE])
    cache_ops = set(inst[cb.CACHE_OPS_SOURCE])
    for dt in DTYPES:
        assert cb.reduce_kernel_name(dt) in attention
        for d in HEAD_DIMS:
            for group in (1, 2, 3, 4, 6, 8, 16):
                for tokens, seqs in ((4, 4), (3, 4), (40, 4)):
                    rows, _ = cb.attention_rows(tokens, seqs, group)
                    assert cb.attention_kernel_name(dt, d, rows) in attention
    for unit in cb.COPY_UNITS:
        assert cb.reshape_kernel_name(unit) in cache_ops
        assert cb.copy_blocks_kernel_name(unit) in cache_ops
    assert sum(map(len, inst.values())) == 3 * 3 * len(cb.ATTENTION_ROWS) + 3 + 2 * len(cb.COPY_UNITS)


@needs_nvrtc
def test_broken_source_fails_the_check():
    source = cb.load_source(cb.CACHE_OPS_SOURCE).replace("k_cache[dst] = key[src];",
                                                         "k_cache[dst] = key[src] +;")
    assert source != cb.load_source(cb.CACHE_OPS_SOURCE)
    with pytest.raises(nvrtc_check.NvrtcCompileError, match="expected an expression"):
        nvrtc_check.compile_program(source, cb.instantiations()[cb.CACHE_OPS_SOURCE], "sm_90")


@needs_nvrtc
def test_unknown_instantiation_fails_the_check():
    names = cb.instantiations()[cb.CACHE_OPS_SOURCE] + ["reshape_and_cache_kernel<no_such_unit>"]
    with pytest.raises(nvrtc_check.NvrtcCompileError, match="no_such_unit"):
        nvrtc_check.compile_program(cb.load_source(cb.CACHE_OPS_SOURCE), names, "sm_80")


def test_load_source_inlines_local_headers():
    text = cb.load_source(cb.ATTENTION_SOURCE)
    assert '#include "' not in text
    assert "struct KVType<kv_bf16>" in text


# --- launch arithmetic, simulated as the kernel does it ----------------------------

def _find_sequence(qsl, group, rows, pad, slot):
    lo, hi = 0, len(qsl) - 2
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if (qsl[mid] * group) // rows + pad * mid <= slot:
            lo = mid
        else:
            hi = mid - 1
    return lo


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 8, 12, 16])
def test_row_tiles_cover_every_row_once(group):
    rng = random.Random(group)
    for _ in range(200):
        num_seqs = rng.randint(1, 7)
        q_lens = [rng.choice([0, 1, 1, 1, 2, 3, 7, 9, 17]) for _ in range(num_seqs)]
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        num_tokens = qsl[-1]
        rows, pad = cb.attention_rows(num_tokens, num_seqs, group)
        assert rows in cb.ATTENTION_ROWS
        if group % rows == 0:
            assert pad == 0
        seen = set()
        for slot in range(cb.attention_slots(num_tokens, num_seqs, group, rows, pad)):
            seq = _find_sequence(qsl, group, rows, pad, slot)
            base = (qsl[seq] * group) // rows + pad * seq
            row0 = (slot - base) * rows
            for r in range(rows):
                rr = row0 + r
                if 0 <= rr < q_lens[seq] * group:
                    assert (seq, rr) not in seen
                    seen.add((seq, rr))
        assert seen == {(i, rr) for i in range(num_seqs) for rr in range(q_lens[i] * group)}


def test_decode_puts_a_whole_group_in_one_cta():
    for group, rows in ((1, 1), (2, 2), (3, 4), (4, 4), (8, 8), (16, 8)):
        assert cb.attention_rows(32, 32, group)[0] == rows
    assert cb.attention_rows(64, 2, 1) == (8, 1)
    assert cb.attention_rows(64, 2, 8) == (8, 0)


def test_split_heuristic():
    sms = 132
    # Enough CTAs already, or a short context: no split.
    assert cb.choose_num_splits(2 * sms, 32768, sms) == 1
    assert cb.choose_num_splits(8, 512, sms) == 1
    # Batch 1, 8 KV heads, 32k context: about 2 CTAs per SM.
    s = cb.choose_num_splits(8, 32768, sms)
    assert 8 * s >= 2 * sms and 32768 / s >= cb.MIN_TOKENS_PER_SPLIT
    # Capped by the context length and MAX_SPLITS.
    assert cb.choose_num_splits(1, 2048, sms) == 2048 // cb.MIN_TOKENS_PER_SPLIT
    assert cb.choose_num_splits(1, 10**7, sms) == cb.MAX_SPLITS


def test_shared_memory_fits_the_default_limit():
    for d in (64, 128, 256):
        for bs in (8, 16, 32, 64, 128):
            for rows in cb.ATTENTION_ROWS:
                assert cb.attention_shared_bytes(d, bs, rows) <= 48 * 1024
