"""Compiles every kernel instantiation through NVRTC, with no GPU and no driver.

One NVRTC program per source file and architecture, with every name expression of
``kernels.cuda_backend.instantiations()`` added, compiled to machine code for the
architecture (``-arch=sm_80``, ``-arch=sm_90``). CuPy's ``RawModule`` cannot do this
without a driver; NVRTC itself can (``cupy_backends.cuda.libs.nvrtc``, with the NVRTC
library from the ``nvidia-cuda-nvrtc-cu12`` wheel or a CUDA toolkit). The sources include
no CUDA header, so no include path is needed.

    python -m kernels.nvrtc_check [--arch sm_80 --arch sm_90] [--verbose]
    python -m kernels.nvrtc_check --table              # registers and spills, markdown
    python -m kernels.nvrtc_check --write-baseline     # ... into kernels/resources.json

prints one line per file and architecture (instantiations, lowered names, seconds) and,
with ``--verbose``, ptxas's register and spill report. ``--table`` prints each
instantiation's registers, spill stores / loads and stack frame per architecture (from
ptxas's report, as ``docs/kernels.md`` shows it); ``--write-baseline`` records them in
``kernels/resources.json``, against which the tests fail an instantiation that spills
more than it did then.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from kernels.cuda_backend import COMPILE_OPTIONS, instantiations, load_source

ARCHES = ("sm_80", "sm_90")
#: Each instantiation's resources when the table was made (``--write-baseline``).
BASELINE = Path(__file__).with_name("resources.json")


class NvrtcCompileError(RuntimeError):
    """A program failed to compile; the message carries NVRTC's log."""


@dataclass
class CompileResult:
    file: str
    arch: str
    lowered: dict[str, str]   # name expression -> lowered (mangled) name
    log: str
    seconds: float


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's version; raises if the library cannot be loaded."""
    return tuple(_nvrtc().getVersion())


def compile_program(source: str, names: list[str], arch: str, *, file: str = "kernel.cu",
                    ptxas_verbose: bool = False) -> CompileResult:
    """Compiles ``source`` with every name expression of ``names`` for ``arch``.

    Returns the lowered name of each expression; raises ``NvrtcCompileError`` with the
    NVRTC log when the program does not compile or a name has no lowered name.
    """
    nvrtc = _nvrtc()
    options = [*COMPILE_OPTIONS, f"-arch={arch}"]
    if ptxas_verbose:
        options.append("--ptxas-options=-v")
    start = time.perf_counter()
    prog = nvrtc.createProgram(source, file, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise NvrtcCompileError(f"{file} ({arch}) failed to compile: {exc}\n{log}") from None
        log = nvrtc.getProgramLog(prog)
        lowered = {}
        for name in names:
            try:
                lowered[name] = nvrtc.getLoweredName(prog, name)
            except nvrtc.NVRTCError as exc:
                raise NvrtcCompileError(f"{file} ({arch}): no lowered name for {name}: {exc}\n{log}") from None
        if not nvrtc.getCUBIN(prog):
            raise NvrtcCompileError(f"{file} ({arch}): empty CUBIN\n{log}")
    finally:
        nvrtc.destroyProgram(prog)
    return CompileResult(file, arch, lowered, log, time.perf_counter() - start)


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one kernel (bytes, but registers)."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def resources(result: CompileResult) -> dict[str, Resources]:
    """Name expression -> its resources, from a ``ptxas_verbose`` compile's log."""
    by_symbol = {v: k for k, v in result.lowered.items()}
    found: dict[str, dict[str, int]] = {}
    current = None
    for line in result.log.splitlines():
        if m := _ENTRY.search(line):
            current = found.setdefault(m.group(1), {})
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _USED.search(line)):
            current["registers"] = int(m.group(1))
    out = {}
    for symbol, name in by_symbol.items():
        r = found.get(symbol)
        if r is None or len(r) != 4:
            raise NvrtcCompileError(f"{result.file} ({result.arch}): no ptxas report for {name}\n{result.log}")
        out[name] = Resources(**r)
    return out


def resource_table(results: list[CompileResult]) -> dict[str, dict[str, Resources]]:
    """arch -> name expression -> resources, over ``ptxas_verbose`` results."""
    table: dict[str, dict[str, Resources]] = {}
    for r in results:
        table.setdefault(r.arch, {}).update(resources(r))
    return table


def more_spills(table: dict[str, dict[str, Resources]], baseline: dict[str, dict[str, Resources]]) -> list[str]:
    """Every instantiation that spills more than in ``baseline`` (``read_baseline``), or
    that the baseline lacks."""
    problems = []
    for arch, names in table.items():
        base = baseline.get(arch, {})
        for name, r in names.items():
            b = base.get(name)
            if b is None:
                problems.append(f"{arch} {name}: not in {BASELINE.name} (python -m kernels.nvrtc_check "
                                f"--write-baseline, and the table in docs/kernels.md)")
            elif r.spill_stores > b.spill_stores or r.spill_loads > b.spill_loads:
                problems.append(f"{arch} {name}: spills {r.spill_stores} B stored / {r.spill_loads} B loaded, "
                                f"{b.spill_stores} / {b.spill_loads} when the table was made")
    return problems


def read_baseline(path: Path = BASELINE) -> tuple[str, dict[str, dict[str, Resources]]]:
    """The NVRTC version and the table that ``--write-baseline`` recorded."""
    raw = json.loads(path.read_text())
    return raw["nvrtc"], {a: {n: Resources(**r) for n, r in names.items()} for a, names in raw["arches"].items()}


def markdown(table: dict[str, dict[str, Resources]]) -> str:
    """The table of ``docs/kernels.md``: one row per instantiation, per arch registers and
    spills (``stores / loads``, bytes; a stack frame noted)."""
    arches = sorted(table)
    names = list(dict.fromkeys(n for a in arches for n in table[a]))
    head = ["instantiation", *(f"{a} registers" for a in arches), *(f"{a} spills (B)" for a in arches)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        regs = [str(table[a][n].registers) for a in arches]
        spills = []
        for a in arches:
            r = table[a][n]
            cell = "0" if not (r.spill_stores or r.spill_loads) else f"**{r.spill_stores} / {r.spill_loads}**"
            spills.append(cell + (f" (stack {r.stack})" if r.stack else ""))
        lines.append(f"| `{n}` | " + " | ".join(regs + spills) + " |")
    return "\n".join(lines)


def check_all(arches: tuple[str, ...] = ARCHES, *, ptxas_verbose: bool = False,
              workers: int | None = None) -> list[CompileResult]:
    """Compiles every source file for every arch (one process per program, up to the
    CPU count) and returns the results, sources in file order."""
    jobs = [(file, names, arch) for file, names in instantiations().items() for arch in arches]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(compile_program, load_source(file), names, arch, file=file,
                               ptxas_verbose=ptxas_verbose) for file, names, arch in jobs]
        return [f.result() for f in futures]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", help="e.g. sm_90 (repeatable; default sm_80 and sm_90)")
    parser.add_argument("--verbose", action="store_true", help="print ptxas's resource report")
    parser.add_argument("--table", action="store_true",
                        help="print each instantiation's registers and spills (markdown, as docs/kernels.md)")
    parser.add_argument("--write-baseline", action="store_true",
                        help=f"record them in {BASELINE} (the tests fail an instantiation that spills more)")
    args = parser.parse_args(argv)
    arches = tuple(args.arch) if args.arch else ARCHES
    version = ".".join(map(str, nvrtc_version()))
    print(f"NVRTC {version}", file=sys.stderr if args.table else sys.stdout)
    start = time.perf_counter()
    verbose = args.verbose or args.table or args.write_baseline
    try:
        results = check_all(arches, ptxas_verbose=verbose)
        table = resource_table(results) if verbose else {}
    except NvrtcCompileError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.write_baseline:
        BASELINE.write_text(json.dumps({"nvrtc": version, "arches": {
            a: {n: asdict(r) for n, r in names.items()} for a, names in table.items()}}, indent=1) + "\n")
        print(f"wrote {BASELINE}", file=sys.stderr)
    if args.table:
        print(f"(NVRTC {version}, `python -m kernels.nvrtc_check --table`)\n")
        print(markdown(table))
        return 0
    for r in results:
        print(f"{r.file:20s} {r.arch}: {len(r.lowered):3d} instantiations compiled, "
              f"{len(r.lowered)} lowered names, {r.seconds:.1f} s")
        if args.verbose and r.log.strip():
            print(r.log)
    per_arch = {a: sum(len(r.lowered) for r in results if r.arch == a) for a in arches}
    print("total: " + ", ".join(f"{a} {n}" for a, n in per_arch.items())
          + f" instantiations; {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
