"""vLLM instances over a kvservice store, from the outside (DESIGN §15): a local stack of
store workers (K/V only, role ``store``, the block geometry of the model as vLLM lays it
out), the connector's configuration for one of the stack's tenants, and vLLM runs
(``kvservice.integrations.vllm_offline``) in vLLM's own Python, each its own process.
Used by ``kvservice bench-vllm`` and tests/test_vllm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvservice.integrations.vllm_offline import CONNECTOR as CONNECTOR_MODULE
from kvservice.tools.launcher import Stack

__all__ = ["BLOCK_SIZE", "CONNECTOR_MODULE", "DEFAULT_VLLM_PYTHON", "connector_config", "finish_offline",
           "model_folder", "run_offline", "start_offline", "store_stack", "vllm_env"]

MODEL = "smollm2-135m"
#: vLLM's block size on a CPU (its default there): the store pools' too.
BLOCK_SIZE = 128
#: Where ``make vllm`` puts vLLM's Python.
DEFAULT_VLLM_PYTHON = str(Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python")


def model_folder() -> str:
    """SmolLM2's converted folder (the model cache's, converted once), which vLLM loads."""
    return subprocess.run([sys.executable, "-m", "worker.weights", MODEL], check=True, stdout=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True).stdout.strip()


def store_worker_args(folder: str) -> tuple[str, ...]:
    """A store worker's geometry for the model in ``folder``: a block of vLLM's cache (every
    layer's K and V of BLOCK_SIZE tokens, float32) is one block of the store's pool."""
    cfg = json.loads(Path(folder, "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return ("--num-layers", str(cfg["num_hidden_layers"]), "--num-kv-heads", str(cfg["num_key_value_heads"]),
            "--head-dim", str(head_dim), "--dtype", "float32")


def store_stack(folder: str, *, workers: int = 1, kv_memory: str = "512MiB", secure: bool = True) -> Stack:
    """A local stack (not started) whose ``workers`` workers are a store's."""
    return Stack(workers, model="", block_size=BLOCK_SIZE, kv_memory=kv_memory, secure=secure,
                 worker_args=store_worker_args(folder), roles=("store",) * workers)


def connector_config(stack: Stack, identity: str = "engine") -> dict[str, Any]:
    """``kv_connector_extra_config`` for a vLLM instance of the stack's tenant ``identity``."""
    cfg: dict[str, Any] = {"allocator": stack.target}
    if stack.secure:
        c = stack.credentials(identity)
        cfg.update(tls_ca=c.ca, client_cert=c.cert, client_key=c.key)
    return cfg


def vllm_env(kv_gib: int = 1) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "TOKENIZERS_PARALLELISM": "false"}


def start_offline(vllm_python: str, plan: dict[str, Any], workdir: str, name: str) -> tuple[subprocess.Popen, Path]:
    """Starts one vLLM run of ``plan`` (``vllm_offline``); returns it and where its result goes."""
    plan_path, out = Path(workdir, f"{name}.plan.json"), Path(workdir, f"{name}.json")
    plan_path.write_text(json.dumps(plan))
    log = open(Path(workdir, f"{name}.log"), "w")
    proc = subprocess.Popen([vllm_python, "-m", "kvservice.integrations.vllm_offline", str(plan_path), str(out)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=vllm_env())
    return proc, out


def finish_offline(proc: subprocess.Popen, out: Path, timeout: float = 600.0) -> dict[str, Any]:
    """Waits for a run of ``start_offline``; its result (raises with the log's end if it failed)."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    if rc != 0 or not out.exists():
        log = Path(str(out)[:-len(".json")] + ".log")
        raise RuntimeError(f"vLLM run {out.name} failed (exit {rc}): {log.read_text()[-4000:]}")
    return json.loads(out.read_text())


def run_offline(vllm_python: str, plan: dict[str, Any], workdir: str | None = None, name: str = "run",
                timeout: float = 600.0) -> dict[str, Any]:
    """One vLLM run of ``plan``, start to end."""
    workdir = workdir or tempfile.mkdtemp(prefix="kvs-vllm-")
    return finish_offline(*start_offline(vllm_python, plan, workdir, name), timeout=timeout)
