"""``kvservice drain`` under load (DESIGN §13): the HTTP API serves a steady stream of chat
requests over two SmolLM2 workers; worker-0 is drained meanwhile (the real command, as an
admin). No request fails, every answer equals the one the same request got before the
drain (greedy), the running sequences moved to worker-1, and worker-0 holds nothing, is
unregistered, and its worker stops."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import openai
import pytest

from helpers import wait_for
from kvservice.tools.launcher import Stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
QUESTIONS = [f"In one sentence: what is {thing}?" for thing in
             ("a library card", "a bicycle chain", "a tide", "a glacier", "a violin bow", "a lighthouse",
              "a compass", "a kiln", "a sundial", "a loom", "a windmill", "a canal lock")]
STEPS = 16


def _ask(api, question: str) -> str:
    r = api.chat.completions.create(model=MODEL, temperature=0, max_tokens=STEPS,
                                    messages=[{"role": "user", "content": question}])
    return r.choices[0].message.content


def _stream(api, questions: list[str], width: int = 4) -> tuple[dict[str, str], list[str]]:
    """Every question, ``width`` at a time, as a client would; the answers and the errors."""
    answers: dict[str, str] = {}
    failures: list[str] = []
    todo = list(questions)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                q = todo.pop(0)
            try:
                answers[q] = _ask(api, q)
            except Exception as exc:            # noqa: BLE001 - every failure counts
                failures.append(f"{q}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker) for _ in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, failures


def test_draining_a_worker_under_load_fails_no_request_and_changes_no_answer(smollm2_cache):
    with Stack(2, model=MODEL, block_size=16, num_blocks=256, http_port=0) as stack, \
            openai.OpenAI(base_url=stack.api.url, api_key=stack.api_key, max_retries=0, timeout=120) as api:
        before, failures = _stream(api, QUESTIONS)
        assert not failures, failures
        d = stack.credentials_dir
        env = {**os.environ, "KVSERVICE_TLS_CA": f"{d}/ca.pem", "KVSERVICE_CLIENT_CERT": f"{d}/admin.pem",
               "KVSERVICE_CLIENT_KEY": f"{d}/admin-key.pem"}
        drained: dict[str, subprocess.CompletedProcess] = {}

        def drain() -> None:
            time.sleep(3.0)                      # (requests running on both workers by then)
            drained["run"] = subprocess.run([sys.executable, "-m", "kvservice", "drain", "worker-0", "--target",
                                             stack.target, "--timeout", "120"], env=env, capture_output=True,
                                            text=True, timeout=180)
        t = threading.Thread(target=drain)
        t.start()
        during, failures = _stream(api, QUESTIONS * 2, width=6)
        t.join()
        run = drained["run"]
        print(run.stdout)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "unregistered" in run.stdout
        assert not failures, (failures, [x for x in stack.api.log().splitlines() if "WARNING" in x or "ERROR" in x
                                         or x.startswith(("Traceback", "  ", "kvservice."))][-60:])
        assert during == before
        worker = stack.workers[0]
        assert wait_for(lambda: worker.proc.poll() is not None, timeout=15), "worker-0 did not stop"
        assert worker.proc.returncode == 0 and "was drained" in worker.log()
        with stack.credentials("admin").channel(stack.target) as ch:
            from kvservice.v1 import allocator_pb2 as pb
            from kvservice.v1 import allocator_pb2_grpc as pb_grpc
            pools = pb_grpc.AllocatorStub(ch).ListPools(pb.ListPoolsRequest(), timeout=10).pools
        assert [p.pool_id for p in pools] == ["worker-1"]
        assert stack.audit().ok
        # The API goes on serving on worker-1.
        assert _ask(api, QUESTIONS[0]) == before[QUESTIONS[0]]
