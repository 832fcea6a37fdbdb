"""The layers' boundaries (DESIGN §1): which package may import which.

Two checks: every ``import`` statement of the source (static, so an import inside a
function counts too), and what importing the SDK or the whole ``kvservice`` package
really loads (in a fresh interpreter).
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvservice

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent

#: (files, forbidden module prefixes, why)
RULES = [
    (["kvservice/client.py", "kvservice/local.py", "kvservice/sequence.py", "kvservice/rpc.py",
      "kvservice/errors.py", "kvservice/journal.py", "kvservice/batches.py"],
     ("kvservice.allocator", "kvservice.engine", "kvservice.tools", "kvservice.simulate"),
     "the SDK is all an engine imports: it never imports the allocator service"),
    (["kvservice/common/*.py"], ("kvservice.allocator", "kvservice.engine", "kvservice.tools", "kvservice.simulate",
                                 "kvservice.client"),
     "common/ is shared by the SDK, the allocator and the workers"),
    (["kvservice/**/*.py", "!kvservice/integrations/*.py"], ("torch", "numpy", "cupy", "worker", "kernels"),
     "nothing in kvservice imports torch, numpy, CuPy, the worker or the kernels (the allocator's and the API's "
     "images install the package's own dependencies only)"),
    (["kvservice/integrations/*.py"], ("cupy", "kernels", "kvservice.allocator", "kvservice.engine", "kvservice.tools",
                                       "kvservice.simulate"),
     "an integration runs in another engine's process (DESIGN §15): the SDK, the worker's store client and that "
     "engine's own packages (torch, vllm)"),
    (["worker/*.py"], ("kvservice.allocator", "kvservice.engine", "kvservice.tools", "kvservice.simulate",
                       "kvservice.client"),
     "a worker imports only kvservice.common, kvservice.errors and the generated API"),
    (["kernels/*.py"], ("kvservice", "worker"), "the kernels depend on nothing of the service"),
]


def imported_modules(path: Path, root: Path = ROOT) -> list[str]:
    """Every module an ``import`` or ``from ... import`` of the file names, absolute."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            out.append(module)
            out.extend(f"{module}.{alias.name}" for alias in node.names)
    return out


def _violations(patterns: list[str], forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    files = sorted({f for pattern in patterns if not pattern.startswith("!") for f in root.glob(pattern)
                    if "v1" not in f.parts}
                   - {f for pattern in patterns if pattern.startswith("!") for f in root.glob(pattern[1:])})
    assert files, patterns
    bad = []
    for f in files:
        for module in imported_modules(f, root):
            if any(module == p or module.startswith(p + ".") for p in forbidden):
                bad.append(f"{f.relative_to(root)} imports {module}")
    return bad


@pytest.mark.parametrize("patterns, forbidden, why", RULES, ids=[r[2].split(":")[0] for r in RULES])
def test_imports_respect_the_layers(patterns, forbidden, why):
    assert _violations(patterns, forbidden) == [], why


def test_the_boundary_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    common = tmp_path / "kvservice" / "common"
    common.mkdir(parents=True)
    (common / "probe.py").write_text("def f():\n    from kvservice.allocator.store import Store\n")
    (common / "rel.py").write_text("from ..allocator import keys\n")
    assert _violations(["kvservice/common/*.py"], ("kvservice.allocator",), tmp_path) == [
        "kvservice/common/probe.py imports kvservice.allocator.store",
        "kvservice/common/probe.py imports kvservice.allocator.store.Store",
        "kvservice/common/rel.py imports kvservice.allocator",
        "kvservice/common/rel.py imports kvservice.allocator.keys"]


def _loaded_by(modules: list[str]) -> list[str]:
    code = f"import sys; import {', '.join(modules)}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_importing_the_sdk_loads_no_allocator_engine_or_tools():
    loaded = _loaded_by(["kvservice.client"])
    assert "kvservice.client" in loaded
    assert [m for m in loaded if m.split(".")[:2] in (["kvservice", "allocator"], ["kvservice", "engine"],
                                                      ["kvservice", "tools"])] == []


def test_importing_every_kvservice_module_loads_no_torch_cupy_worker_or_kernels():
    # (the integrations run in other engines' processes: test_imports_respect_the_layers)
    modules = [m.name for m in pkgutil.walk_packages(kvservice.__path__, "kvservice.")
               if not m.name.endswith("__main__") and not m.name.startswith("kvservice.integrations")]
    assert {"kvservice.client", "kvservice.allocator.server", "kvservice.engine.engine",
            "kvservice.tools.bench", "kvservice.common.grpc"} <= set(modules)
    loaded = _loaded_by(modules)
    assert [m for m in loaded if m.split(".")[0] in ("torch", "cupy", "worker", "kernels")] == []
