"""Real vLLM (CPU build, ``make vllm``) instances over one kvservice store (DESIGN §15),
from the outside: each instance its own process, its connector a tenant of a secure local
stack (an allocator, two store workers). Run by ``make test-vllm`` (CI: ``.ci/run``), not by
``make test``: the venv it needs is 3.6 GB.

- instance B loads the prefix instance A computed (vLLM's own external-prefix-cache
  counter says so), and answers as B does with the connector off;
- another tenant's instance loads none of it;
- the store's workers killed while B loads: B's requests still succeed, recomputed, the
  answers unchanged, the failure counted;
- vLLM's OpenAI-compatible server with the connector answers the ``openai`` client, and a
  second request with the same long system prompt reports the prefix loaded;
- ``kvservice bench-vllm`` measures both ways and loads what it should.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from kvservice.tools.vllm_store import (BLOCK_SIZE, DEFAULT_VLLM_PYTHON, CONNECTOR_MODULE, connector_config,
                                        finish_offline, model_folder, run_offline, start_offline, store_stack,
                                        vllm_env)

VLLM_PYTHON = os.environ.get("KVSERVICE_VLLM_PYTHON", DEFAULT_VLLM_PYTHON)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.e2e]

_rng = random.Random(32)
PREFIX = [_rng.randrange(100, 40000) for _ in range(1024)]          # 8 of vLLM's blocks
PROMPTS_B = [PREFIX + [_rng.randrange(100, 40000) for _ in range(n)] for n in (50, 77)]
PROMPT_A = PREFIX + [_rng.randrange(100, 40000) for _ in range(40)]


@pytest.fixture(scope="module")
def folder() -> str:
    assert Path(VLLM_PYTHON).exists(), f"{VLLM_PYTHON}: vLLM's Python (make vllm)"
    return model_folder()


@pytest.fixture(scope="module")
def store(folder):
    with store_stack(folder, workers=2) as stack:
        yield stack


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="kvs-vllm-") as d:
        yield d


@pytest.fixture(scope="module")
def reference(folder, workdir):
    """B's answers with the connector off."""
    out = run_offline(VLLM_PYTHON, {"model": folder, "connector": None,
                                    "phases": [{"name": "off", "prompts": PROMPTS_B, "max_tokens": 12}]},
                      workdir, "reference")
    return out["phases"][0]["outputs"]


@pytest.fixture(scope="module")
def stored(folder, store, workdir):
    """Instance A computes PROMPT_A (its full blocks saved to the store)."""
    out = run_offline(VLLM_PYTHON, {"model": folder, "connector": connector_config(store),
                                    "phases": [{"name": "a", "prompts": [PROMPT_A], "max_tokens": 4}]}, workdir, "a")
    phase = out["phases"][0]
    assert phase["connector"]["worker"]["saved_blocks"] == len(PROMPT_A) // BLOCK_SIZE
    assert phase["connector"]["worker"]["save_failures"] == 0
    return out


def test_another_tenants_instance_loads_none_of_the_prefix(folder, store, workdir, stored, reference):
    out = run_offline(VLLM_PYTHON, {"model": folder, "connector": connector_config(store, "api"),
                                    "phases": [{"name": "y", "prompts": PROMPTS_B, "max_tokens": 12}]}, workdir, "y")
    phase = out["phases"][0]
    assert phase["external_hits"] == 0 and phase["connector"]["scheduler"]["hit_tokens"] == 0
    assert phase["connector"]["worker"]["loaded_tokens"] == 0
    assert phase["outputs"] == reference
    assert store.audit().ok


def test_the_openai_server_with_the_connector_reports_the_prefix_loaded(folder, store, workdir):
    openai = pytest.importorskip("openai")
    port = _free_port()
    stats = Path(workdir, "server-stats")
    config = {**CONNECTOR_MODULE, "kv_connector_extra_config": {**connector_config(store), "stats_file": str(stats)}}
    log = open(Path(workdir, "server.log"), "w")
    server = subprocess.Popen(
        [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--served-model-name", "smollm2",
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(port),
         "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(config)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=vllm_env())
    try:
        _wait_healthy(server, port, Path(workdir, "server.log"))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and precisely." for i in range(60))
        answers = []
        for question in ("What is 2 + 2?", "Name a colour."):
            reply = client.chat.completions.create(model="smollm2", max_tokens=8, temperature=0, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}])
            answers.append(reply)
            _wait_saved(Path(f"{stats}.worker"))
        first, second = answers
        assert first.usage.prompt_tokens > 600 and first.choices[0].message.content
        assert (first.usage.prompt_tokens_details.cached_tokens or 0) == 0
        # (vLLM's own prefix cache is off: what the second request did not compute, it loaded)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= (first.usage.prompt_tokens // BLOCK_SIZE - 1) * BLOCK_SIZE and cached % BLOCK_SIZE == 0
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        hits = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("vllm:external_prefix_cache_hits_total")]
        assert hits and hits[0] == cached
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_b_loads_the_prefix_a_computed_and_a_dead_store_worker_costs_a_recompute(folder, store, workdir, stored,
                                                                                reference):
    ready, go = Path(workdir, "b-ready"), Path(workdir, "b-go")
    proc, out = start_offline(VLLM_PYTHON, {"model": folder, "connector": connector_config(store), "phases": [
        {"name": "load", "prompts": PROMPTS_B, "max_tokens": 12, "one_by_one": True},
        {"name": "store-dead", "prompts": PROMPTS_B, "max_tokens": 12, "reset_prefix_cache": True,
         "ready": str(ready), "wait_for": str(go)}]}, workdir, "b")
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, Path(workdir, "b.log").read_text()[-3000:]
            time.sleep(0.2)
        for worker in store.workers:                  # (B's second phase finds the store's workers gone)
            worker.kill()
        go.touch()
        result = finish_offline(proc, out)
    finally:
        if proc.poll() is None:
            proc.kill()
    loaded, dead = result["phases"]
    # the first request loads every block of the prefix (>= 95%: here all of it); the second
    # one finds it in vLLM's own prefix cache by then
    assert loaded["num_cached_tokens"][0] >= 0.95 * len(PREFIX) and loaded["external_hits"] >= 0.95 * len(PREFIX)
    assert loaded["connector"]["worker"]["loaded_tokens"] == len(PREFIX)
    assert loaded["outputs"] == reference
    # the store's worker is gone: the loads fail, vLLM recomputes, the answers are the same
    assert dead["connector"]["worker"]["load_failures"] >= 1
    assert dead["connector"]["worker"]["failed_blocks"] >= len(PREFIX) // BLOCK_SIZE
    assert dead["outputs"] == reference


def _wait_saved(stats: Path, timeout: float = 60.0) -> None:
    """Until the connector's worker side has saved something and has no save under way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stats.exists():
            s = json.loads(stats.read_text())
            if s["saved_blocks"] and not s["pending_saves"]:
                return
        time.sleep(0.1)
    raise AssertionError(f"the connector saved nothing in {timeout:.0f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, port: int, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, f"vLLM's server exited: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"vLLM's server not up in {timeout:.0f} s: {log.read_text()[-3000:]}"
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.5)


def test_bench_vllm_measures_vllm_with_and_without_the_connector(folder):
    out = subprocess.run([sys.executable, "-m", "kvservice", "bench-vllm", "--prefix-tokens", "512", "--samples", "1",
                          "--vllm-python", VLLM_PYTHON, "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    fig = json.loads(out.stdout)
    assert fig["prompt_tokens"] == 552 and fig["loaded_tokens"] == 512 and fig["load_failures"] == 0
    assert fig["ttft_ms_off"] > 0 and fig["ttft_ms_on"] > 0


# ---------------------------------------------------------------- KV events and routing


def test_vllms_own_decoder_reads_every_kind_of_event_kvservice_publishes(workdir):
    from kvservice.events import wire
    batches = [wire.Batch(1.5, [wire.BlockStored([b"\x01" * 32, 7], None, list(range(256)), 128, wire.MEDIUM_CPU),
                                wire.BlockStored([9], 7, list(range(128)), 128, wire.MEDIUM_STORAGE, lora_name="a")]),
               wire.Batch(2.0, [wire.BlockRemoved([b"\x01" * 32], wire.MEDIUM_GPU), wire.AllBlocksCleared()], 3)]
    path = Path(workdir, "events.bin")
    path.write_bytes(b"".join(len(p).to_bytes(4, "big") + p for p in map(wire.encode, batches)))
    code = ("import sys, msgspec\n"
            "from vllm.distributed.kv_events import KVEventBatch\n"
            "data, out, i = open(sys.argv[1], 'rb').read(), [], 0\n"
            "while i < len(data):\n"
            "    n = int.from_bytes(data[i:i + 4], 'big'); i += 4\n"
            "    b = msgspec.msgpack.Decoder(type=KVEventBatch).decode(data[i:i + n]); i += n\n"
            "    out.append([b.ts, b.data_parallel_rank, [[type(e).__name__, msgspec.structs.asdict(e)] for e in b.events]])\n"
            "print(repr(out))\n")
    got = subprocess.run([VLLM_PYTHON, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    decoded = eval(got.stdout.strip().splitlines()[-1])         # (reprs of bytes, ints, strings and None)
    assert [(ts, rank, [kind for kind, _ in events]) for ts, rank, events in decoded] == [
        (1.5, None, ["BlockStored", "BlockStored"]), (2.0, 3, ["BlockRemoved", "AllBlocksCleared"])]
    first, second = decoded[0][2][0][1], decoded[0][2][1][1]
    assert (first["block_hashes"], first["parent_block_hash"], first["token_ids"], first["block_size"],
            first["medium"]) == ([b"\x01" * 32, 7], None, list(range(256)), 128, "CPU")
    assert (second["parent_block_hash"], second["lora_name"], second["medium"]) == (7, "a", "STORAGE")
    assert decoded[1][2][0][1]["block_hashes"] == [b"\x01" * 32]


def _vllm_server(folder: str, port: int, events: int, log: Path) -> subprocess.Popen:
    # (an endpoint with a wildcard is bound by vLLM; another one it connects to)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
              "replay_endpoint": f"tcp://*:{events + 1}", "topic": "kv"}
    return subprocess.Popen(
        [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--served-model-name", "smollm2",
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
         "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(config)],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=vllm_env(),
        start_new_session=True)          # (its engine core is a child: killed with it, as a group)


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait()


def _complete(port: int, prompt: list[int]) -> int:
    """One completion of a token-id prompt; the prompt tokens vLLM served from its cache."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(
        {"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as reply:
        usage = json.loads(reply.read())["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _route(url: str, prompt: list[int]) -> dict:
    req = urllib.request.Request(f"{url}/route", json.dumps({"token_ids": prompt}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as reply:
        return json.loads(reply.read())


def test_routing_by_kv_events_serves_shared_prefixes_from_vllms_caches(folder, workdir):
    from kvservice.allocator.embedded import EmbeddedRedis

    ports = [_free_port() for _ in range(2)]
    events = [_free_port_pair() for _ in range(2)]
    servers = [_vllm_server(folder, ports[i], events[i], Path(workdir, f"vllm-{i}.log")) for i in range(2)]
    router = None
    try:
        with EmbeddedRedis(port=0) as redis:
            for i in range(2):
                _wait_healthy(servers[i], ports[i], Path(workdir, f"vllm-{i}.log"))
            router = subprocess.Popen(
                [sys.executable, "-m", "kvservice", "router", "--redis", redis.tcp_url, "--port", "0", "--http-port",
                 "0", *[a for i in range(2) for a in ("--instance", f"vllm-{i}=tcp://127.0.0.1:{events[i]},"
                                                                    f"tcp://127.0.0.1:{events[i] + 1}")]],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            line = router.stdout.readline()
            assert "HTTP on" in line, line + router.stdout.read()[-2000:]
            url = "http://" + line.split("HTTP on ")[1].split(",")[0]
            time.sleep(1.0)                                   # (the router's SUB sockets connect)
            rng = random.Random(33)
            block = BLOCK_SIZE
            prefixes = [[rng.randrange(100, 40000) for _ in range(4 * block)] for _ in range(8)]

            def workload(sets: list[list[int]]) -> list[list[int]]:
                """10 requests per shared prefix, in a random order."""
                out = [p + [rng.randrange(100, 40000) for _ in range(20)] for _ in range(10) for p in sets]
                rng.shuffle(out)
                return out

            routed_prompts, rr_prompts = workload(prefixes[:4]), workload(prefixes[4:])
            best = (len(routed_prompts) - 4) * 4 * block    # (each prefix computed once, then always cached)
            routed, chosen, reasons = 0, [], []
            for prompt in routed_prompts:
                answer = _route(url, prompt)
                chosen.append(int(answer["instance"][-1]))
                reasons.append(answer["reason"])
                routed += _complete(ports[chosen[-1]], prompt)
            rr = sum(_complete(ports[k % 2], prompt) for k, prompt in enumerate(rr_prompts))
            print(f"routed by kvservice: {routed} of {best} prompt tokens cached ({routed / best:.1%}); "
                  f"round-robin: {rr} ({rr / best:.1%}); instances {chosen}")
            assert routed >= 0.9 * best and routed > rr
            assert reasons.count("cache") >= len(routed_prompts) - 4
            # each shared prefix stays where it was first computed
            where = {}
            for prompt, c in zip(routed_prompts, chosen):
                where.setdefault(tuple(prompt[:4 * block]), set()).add(c)
            assert all(len(s) == 1 for s in where.values()), where

            # an instance restarted mid-run: its entries go, and no cache-based traffic goes
            # to it until its new events arrive
            mine = next(p for p, c in zip(routed_prompts, chosen) if c == 0)
            assert _route(url, mine)["instance"] == "vllm-0"
            _kill_group(servers[0])
            deadline = time.monotonic() + 30
            while True:
                cand = {c["instance"]: c for c in _route(url, mine)["candidates"]}
                if cand["vllm-0"]["cached_blocks"] == 0:
                    break
                assert time.monotonic() < deadline, "the dead instance's blocks are still used"
                time.sleep(0.5)
            servers[0] = _vllm_server(folder, ports[0], events[0], Path(workdir, "vllm-0b.log"))
            _wait_healthy(servers[0], ports[0], Path(workdir, "vllm-0b.log"))
            assert {c["instance"]: c for c in _route(url, mine)["candidates"]}["vllm-0"]["cached_blocks"] == 0
            fresh = [rng.randrange(100, 40000) for _ in range(3 * block)]
            _complete(ports[0], fresh)                        # (its first events since the restart)
            deadline = time.monotonic() + 30
            while _route(url, fresh + [5])["candidates"][0]["instance"] != "vllm-0":
                assert time.monotonic() < deadline, "the restarted instance's new blocks are not indexed"
                time.sleep(0.5)
            cand = {c["instance"]: c for c in _route(url, mine)["candidates"]}
            assert cand["vllm-0"]["cached_blocks"] == 0       # (its old blocks are gone from the index)
            metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
            assert 'kvservice_events_restarts_total{instance="vllm-0"} 1.0' in metrics
    finally:
        for s in servers:
            _kill_group(s, signal.SIGTERM)
        if router is not None:
            router.terminate()
            router.wait(30)


def _free_port_pair() -> int:
    """A port whose successor is free too (a publisher and its replay socket)."""
    while True:
        port = _free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
