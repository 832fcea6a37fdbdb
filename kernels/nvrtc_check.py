"""Compiles every kernel instantiation through NVRTC, with no GPU and no driver.

One NVRTC program per source file and architecture, with every name expression of
``kernels.cuda_backend.instantiations()`` added, compiled to machine code for the
architecture (``-arch=sm_80``, ``-arch=sm_90``). CuPy's ``RawModule`` cannot do this
without a driver; NVRTC itself can (``cupy_backends.cuda.libs.nvrtc``, with the NVRTC
library from the ``nvidia-cuda-nvrtc-cu12`` wheel or a CUDA toolkit). The sources include
no CUDA header, so no include path is needed.

    python -m kernels.nvrtc_check [--arch sm_80 --arch sm_90] [--verbose]

prints one line per file and architecture (instantiations, lowered names, seconds) and,
with ``--verbose``, ptxas's register and spill report.
"""

from __future__ import annotations

import argparse
import sys
import time
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from kernels.cuda_backend import COMPILE_OPTIONS, instantiations, load_source

ARCHES = ("sm_80", "sm_90")


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
    args = parser.parse_args(argv)
    arches = tuple(args.arch) if args.arch else ARCHES
    print(f"NVRTC {'.'.join(map(str, nvrtc_version()))}")
    start = time.perf_counter()
    try:
        results = check_all(arches, ptxas_verbose=args.verbose)
    except NvrtcCompileError as exc:
        print(exc, file=sys.stderr)
        return 1
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
