#!/usr/bin/env bash
# GPU check of the CUDA kernels: the GPU tests, compute-sanitizer's memcheck and racecheck
# over a small grid, then the decode benchmark (table last).
#
#   scripts/gpu_check.sh
#
# Installs nothing and needs no network. It assumes a Python that already has a CUDA
# build of torch, CuPy for the machine's CUDA (cupy-cuda12x or cupy-cuda13x: CuPy
# compiles the kernels with its NVRTC at first use) and pytest (pytest-timeout is
# used if present). The Python is, in order: $PYTHON if set; the repository's
# .venv/bin/python if it imports torch and sees a CUDA device; python3 otherwise. The
# repository is put on PYTHONPATH (nothing is pip-installed). The test run skips the
# repository's conftest.py (it starts Redis servers the kernel tests do not use).
#
# Budget: about 6 minutes on an H200 (kernel compilation about a minute, the tests a
# minute or two, the sanitizer runs a minute or two, the benchmark one to two minutes);
# each stage has its own timeout, and a failure in one stage does not stop the next.
# Exit status: non-zero if a stage failed.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY=.venv/bin/python
else
    PY=python3
fi

echo "== environment ($PY)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || echo "nvidia-smi not available"
"$PY" - <<'PYEOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "CUDA", torch.version.cuda,
      "| device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
try:
    import cupy
    print("cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "| driver", cupy.cuda.runtime.driverGetVersion())
except Exception as exc:
    print("cupy unavailable:", exc)
PYEOF

status=0
TIMEOUT_ARGS=""
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then TIMEOUT_ARGS="--timeout=240"; fi

echo "== GPU tests"
timeout 210 "$PY" -m pytest tests/test_kernels_gpu.py -q -rs --noconftest -p no:cacheprovider \
    $TIMEOUT_ARGS --durations=5 || { echo "GPU tests: FAILED (exit $?)"; status=1; }

echo "== compute-sanitizer (memcheck, racecheck) over a small grid"
SANITIZER="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)"
if [ -n "$SANITIZER" ]; then
    for tool in memcheck racecheck; do
        timeout 240 "$SANITIZER" --tool "$tool" --error-exitcode 3 --target-processes all \
            "$PY" -m pytest tests/test_kernels_gpu.py -q --noconftest -p no:cacheprovider -k small_grid_for_the_sanitizer \
            || { echo "compute-sanitizer $tool: FAILED (exit $?)"; status=1; }
    done
else
    echo "compute-sanitizer: not found (it comes with the CUDA toolkit): FAILED"; status=1
fi

echo "== decode benchmark"
timeout 240 "$PY" -m kernels.bench || { echo "benchmark: FAILED (exit $?)"; status=1; }
exit $status
