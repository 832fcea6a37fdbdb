"""Runs vLLM (offline ``LLM``) over token-id prompts, with or without the kvservice
connector, phase after phase, and writes what happened as JSON: the end-to-end check of
the connector (tests/test_vllm.py) and ``kvservice bench-vllm`` run it in vLLM's own
Python (``make vllm``), as separate processes, as two vLLM instances would be.

Usage::

    python -m kvservice.integrations.vllm_offline PLAN.json OUT.json

PLAN: ``{"model": folder, "max_model_len": 4096, "connector": extra config or null,
"phases": [{"name", "prompts": [[token ids]], "max_tokens": 8, "one_by_one": false,
"reset_prefix_cache": false, "wait_for": path (optional: wait until it exists first),
"ready": path (optional: created once the phase before is done)}]}``. OUT: per phase, each
request's output token ids, ``num_cached_tokens`` (vLLM's: its own prefix cache and the
connector's), seconds (with ``one_by_one``: each prompt alone, so with max_tokens 1 its time
to first token), and the connector's counters after it (both sides), plus vLLM's
``external_prefix_cache_hits`` counter.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

CONNECTOR = {"kv_connector": "KVServiceConnector", "kv_connector_module_path": "kvservice.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def _stats(stats_file: str, settle: float = 60.0) -> dict[str, Any]:
    """The connector's counters, once its worker side has no save under way."""
    out: dict[str, Any] = {}
    deadline = time.monotonic() + settle
    while True:
        for side in ("scheduler", "worker"):
            path = Path(f"{stats_file}.{side}")
            if path.exists():
                out[side] = json.loads(path.read_text())
        if not out.get("worker", {}).get("pending_saves") or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def _external_hits(llm: Any) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")


def main(argv: list[str]) -> int:
    plan_path, out_path = argv
    plan = json.loads(Path(plan_path).read_text())
    from vllm import LLM, SamplingParams, TokensPrompt

    kwargs: dict[str, Any] = {}
    stats_file = ""
    if plan.get("connector") is not None:
        extra = dict(plan["connector"])
        stats_file = extra.setdefault("stats_file", f"{out_path}.stats")
        kwargs["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": extra}
    started = time.monotonic()
    llm = LLM(model=plan["model"], dtype="float32", enforce_eager=True, max_model_len=plan.get("max_model_len", 4096),
              seed=0, disable_log_stats=False, enable_prefix_caching=plan.get("prefix_caching", True), **kwargs)
    result: dict[str, Any] = {"start_seconds": time.monotonic() - started, "phases": []}
    for phase in plan["phases"]:
        if phase.get("ready"):
            Path(phase["ready"]).touch()
        if phase.get("wait_for"):
            while not Path(phase["wait_for"]).exists():
                time.sleep(0.1)
        if phase.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 8), ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]]
        hits_before = _external_hits(llm)
        outputs, seconds = [], []
        batches = [[p] for p in prompts] if phase.get("one_by_one") else [prompts]
        for batch in batches:
            t0 = time.perf_counter()
            outputs += llm.generate(batch, params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
        result["phases"].append({
            "name": phase.get("name", ""), "seconds": seconds,
            "outputs": [list(o.outputs[0].token_ids) for o in outputs],
            "num_cached_tokens": [o.num_cached_tokens for o in outputs],
            "external_hits": _external_hits(llm) - hits_before,
            "connector": _stats(stats_file) if stats_file else {}})
        print(f"vllm_offline: phase {phase.get('name', '')} done in {sum(seconds):.2f} s", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
