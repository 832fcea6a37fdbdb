"""``kvservice`` command line: serve, up, api, token, certs, audit, health, bench, bench-serving, bench-tiers,
bench-transfer, bench-vllm, bench-index, router, route, events, limits,
shards, many-pools, demo, simulate."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from typing import Any

from kvservice.allocator.config import Settings


def _serve(args: argparse.Namespace) -> int:
    from kvservice.allocator.server import serve

    try:
        settings = Settings.from_args(args)
    except ValueError as exc:
        print(f"kvservice serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(settings, port_file=args.port_file))
    except (OSError, ValueError) as exc:
        print(f"kvservice serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _token(args: argparse.Namespace) -> int:
    from kvservice.common.auth import add_token, revoke_tokens

    try:
        if args.action == "add":
            token = add_token(args.file, args.name, args.role)
            print(token)
            print(f"kvservice token: issued a {args.role} token for {args.name} (its hash is in {args.file}; "
                  f"the token itself is printed only here)", file=sys.stderr)
        else:
            n = revoke_tokens(args.file, args.name)
            print(f"kvservice token: revoked {n} token(s) of {args.name} in {args.file}", file=sys.stderr)
            if not n:
                return 1
    except (OSError, ValueError) as exc:
        print(f"kvservice token: {exc}", file=sys.stderr)
        return 2
    return 0


def _certs(args: argparse.Namespace) -> int:
    from kvservice.tools.certs import make_certs, make_redis_users, parse_client

    try:
        written = make_certs(args.directory, args.host, [parse_client(c) for c in args.client], keep=args.keep)
        if written and args.redis:
            written += make_redis_users(args.directory, args.redis)
    except (OSError, ValueError) as exc:
        print(f"kvservice certs: {exc}", file=sys.stderr)
        return 2
    if written:
        print(f"kvservice certs: wrote {', '.join(written)} in {args.directory}")
    else:
        print(f"kvservice certs: {args.directory} holds a CA already; nothing written (--keep)")
    return 0


def _limits(args: argparse.Namespace) -> int:
    from kvservice.tools.limits import main as limits_main

    try:
        settings = Settings.from_args(args)
    except ValueError as exc:
        print(f"kvservice limits: {exc}", file=sys.stderr)
        return 2
    if args.long_tokens < 2:
        print("kvservice limits: --long-tokens must be at least 2", file=sys.stderr)
        return 2
    return limits_main(settings, args.long_tokens)


def _audit(args: argparse.Namespace) -> int:
    from kvservice.allocator.core import Allocator
    from kvservice.allocator.audit import run_audit
    from kvservice.allocator.store import Store, connect

    url = args.redis_url or os.environ.get("KVSERVICE_REDIS_URL", "")
    if not url:
        print("kvservice audit: give --redis-url (or KVSERVICE_REDIS_URL)", file=sys.stderr)
        return 2

    holdings: list = []

    async def run() -> tuple[list[str], list]:
        store = Store(connect(url))
        try:
            return await run_audit(Allocator(store), args.pool, holdings=holdings)
        finally:
            await store.close()

    try:
        problems, infos = asyncio.run(run())
    except Exception as exc:  # noqa: BLE001 - report, do not trace
        print(f"kvservice audit: cannot audit {url}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"ok": not problems, "problems": problems,
                          "pools": [{"pool_id": i.pool_id, "epoch": i.epoch, **i.stats} for i in infos],
                          "leases": [dataclasses.asdict(h) for h in holdings]}))
    else:
        for i in infos:
            s = i.stats
            print(f"pool {i.pool_id} (epoch {i.epoch}): {s['num_blocks']} blocks = "
                  f"{s['num_free_blocks']} free + {s['num_evictable_blocks']} evictable + "
                  f"{s['num_used_blocks']} used + {s['num_reserved_blocks']} reserved; {s['num_sequences']} "
                  f"sequences, {s['num_leases']} leases")
            for h in holdings:
                if h.pool_id == i.pool_id:
                    staged = f", {h.num_staged_blocks} staged blocks (runs under way)" if h.num_staged_blocks else ""
                    print(f"  lease {h.lease_id}: {h.num_sequences} sequences, {h.num_reserved_blocks} reserved "
                          f"blocks{staged}, journal applied up to entry {h.applied_entries}")
        if problems:
            print(f"AUDIT FAILED: {len(problems)} problem(s)")
            for p in problems:
                print(f"  - {p}")
        else:
            print(f"audit ok: {len(infos)} pool(s), every invariant holds")
    return 1 if problems else 0


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvservice.common.security import ClientCredentials

    try:
        with ClientCredentials.from_env().channel(args.target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"kvservice health: {args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target} {args.service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _drain(args: argparse.Namespace) -> int:
    from kvservice.tools.drain import main as drain_main

    return drain_main(args)


def _bench(args: argparse.Namespace) -> int:
    from kvservice.tools.bench import main as bench_main

    return bench_main(args)


def _shards(args: argparse.Namespace) -> int:
    from kvservice.tools.shards import main as shards_main

    return shards_main(args)


def _demo(args: argparse.Namespace) -> int:
    from kvservice.engine.demo import main as demo_main

    return demo_main(args)


def _api(args: argparse.Namespace) -> int:
    from kvservice.api.server import main as api_main

    return api_main(args)


def _simulate(args: argparse.Namespace) -> int:
    from kvservice.simulate.cli import main as simulate_main

    return simulate_main(args)


def _up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvservice.tools.launcher import Stack

    roles = tuple(args.roles.split(",")) if args.roles else ()
    if roles and (len(roles) != args.workers or not set(roles) <= {"both", "prefill", "decode"}):
        print(f"kvservice up: --roles needs one of both, prefill, decode per worker ({args.workers}), got "
              f"{args.roles!r}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.api_replicas < 1 or (args.api_replicas > 1 and args.http is None):
        print(f"kvservice up: --api-replicas needs --http and at least 1, got {args.api_replicas}", file=sys.stderr)
        return 2
    stack = Stack(args.workers, model=args.model, model_seed=args.model_seed, block_size=args.block_size,
                  kv_memory=args.kv_memory, num_blocks=args.num_blocks, http_port=args.http,
                  redis_cluster=args.redis_cluster, worker_args=tier_worker_args(args), roles=roles,
                  api_replicas=args.api_replicas)
    replicas = f" ({args.api_replicas} replicas behind a round-robin front)" if args.api_replicas > 1 else ""
    print(f"starting Redis, an allocator and {args.workers} worker(s) serving {args.model}"
          + (f", and the HTTP API on port {args.http}{replicas}" if args.http is not None else "") + " ...",
          flush=True)
    try:
        stack.start()
        for line in stack.describe():
            print(f"  {line}", flush=True)
        print(f"ready: point clients and engines at {stack.target}"
              + (f", OpenAI clients at {stack.http_url}" if stack.api else "")
              + "; Ctrl-C or SIGTERM stops everything", flush=True)
        while not stop.wait(0.5):
            dead = [w.pool_id for w in stack.workers if w.proc.poll() is not None]
            dead += [f"api-{i}" for i, a in enumerate(stack.apis) if a.proc.poll() is not None]
            if stack.allocator.proc.poll() is not None or dead:
                print(f"kvservice up: a process exited ({', '.join(dead) or 'allocator'}); stopping",
                      file=sys.stderr)
                return 1
        return 0
    except (RuntimeError, TimeoutError, ValueError) as exc:
        print(f"kvservice up: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        print("stopped.", flush=True)


def _front(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvservice.api.front import RoundRobinFront

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        front = RoundRobinFront(args.host, args.port, args.backend).start()
    except (ValueError, RuntimeError) as exc:
        print(f"kvservice front: {exc}", file=sys.stderr)
        return 2
    print(f"front on {args.host}:{front.port}: round robin over {', '.join(args.backend)}", flush=True)
    stop.wait()
    front.stop()
    return 0


def tier_arguments(p: argparse.ArgumentParser) -> None:
    """The workers' lower tiers (DESIGN §12), as ``python -m worker`` takes them."""
    p.add_argument("--host-tier-gb", type=float, default=0.0,
                   help="each worker's host tier in GB: blocks evicted from the device are kept there and loaded "
                        "back on a prefix hit (default 0: none)")
    p.add_argument("--disk-tier-dir", default="",
                   help="a directory for each worker's disk tier (<pool id>.kvtier): blocks evicted from the host "
                        "tier, kept across restarts (needs --host-tier-gb)")
    p.add_argument("--disk-tier-gb", type=float, default=1.0, help="each worker's disk tier in GB (default 1)")


def tier_worker_args(args: argparse.Namespace) -> tuple[str, ...]:
    out: tuple[str, ...] = ()
    if args.host_tier_gb:
        out += ("--host-tier-gb", str(args.host_tier_gb))
    if args.disk_tier_dir:
        out += ("--disk-tier-dir", args.disk_tier_dir, "--disk-tier-gb", str(args.disk_tier_gb))
    return out


def _tool(sub: Any, name: str, module: Any, help_: str) -> None:
    """A measuring tool's subcommand: its module's docstring as the description, its
    ``add_arguments`` and ``main``."""
    p = sub.add_parser(name, help=help_, description=module.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    p.set_defaults(func=module.main)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvservice", description=(
        "A distributed manager for the paged KV cache of LLM inference: a block allocator "
        "over Redis with a gRPC API, model workers that hold the KV pools (python -m worker), "
        "and a continuous-batching engine."))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run an allocator replica (embedded Redis unless --redis-url)")
    Settings.add_arguments(p)
    p.add_argument("--port-file", help="write the bound port and the Redis URL to this file once serving")
    p.set_defaults(func=_serve)

    p = sub.add_parser("token", help="issue or revoke a bearer token in a tokens file (docs/security.md)")
    p.add_argument("action", choices=("add", "revoke"), help="add: issue a token (printed once); "
                                                            "revoke: remove every token of NAME")
    p.add_argument("name", help="the identity: a tenant name, a worker's pool id, or an admin's name")
    p.add_argument("role", nargs="?", default="tenant", choices=("tenant", "worker", "admin"),
                   help="the identity's role (add only; default tenant)")
    p.add_argument("--file", required=True, help="the tokens file (the allocator's --tokens-file)")
    p.set_defaults(func=_token)

    p = sub.add_parser("certs", help="make a development CA, a server certificate and client certificates "
                                     "(throwaway TLS credentials; docs/security.md)")
    p.add_argument("directory", help="where to write them (made if missing)")
    p.add_argument("--host", action="append", default=[],
                   help="another name or address of the servers (repeatable; localhost and loopback always)")
    p.add_argument("--client", action="append", default=[], metavar="NAME:ROLE",
                   help="a client certificate for this identity (repeatable), e.g. acme:tenant, pool-0:worker")
    p.add_argument("--keep", action="store_true", help="write nothing if DIR holds a CA already")
    p.add_argument("--redis", default="", metavar="HOST:PORT",
                   help="also write a Redis ACL file (users.acl) and its users' URLs for a Redis at HOST:PORT")
    p.set_defaults(func=_certs)

    p = sub.add_parser("limits", help="run the worst call each per-call limit allows against a private Redis, and "
                                      "operations on a long prompt in bounded calls; print how long each script "
                                      "held Redis")
    p.add_argument("--long-tokens", type=int, default=1 << 20,
                   help="the long prompt's tokens (default 1048576: 65,536 blocks of 16)")
    Settings.add_arguments(p)
    p.set_defaults(func=_limits)

    p = sub.add_parser("audit", help="check the allocator's invariants on a live Redis; exit 1 if broken")
    p.add_argument("--redis-url", default="", help="Redis URL (default $KVSERVICE_REDIS_URL)")
    p.add_argument("--pool", default="", help="audit one pool (default: every pool)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a report")
    p.set_defaults(func=_audit)

    from kvservice.tools import drain
    p = sub.add_parser("drain", help="move every sequence off a pool and unregister it, so that its worker can "
                                     "restart with no request lost", description=drain.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    drain.add_arguments(p)
    p.set_defaults(func=_drain)

    p = sub.add_parser("health", help="ask a server (allocator or worker) for its gRPC health; exit 0 if SERVING "
                                      "(TLS from KVSERVICE_TLS_CA, _CLIENT_CERT, _CLIENT_KEY)")
    p.add_argument("--target", default="127.0.0.1:50051", help="host:port (default 127.0.0.1:50051)")
    p.add_argument("--service", default="", help="service name to check (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    p.set_defaults(func=_health)

    p = sub.add_parser("bench", help="measure the allocator: floor, decode steps, create/fork/free")
    p.add_argument("--redis-url", default="", help="use this Redis (default: an embedded one)")
    p.add_argument("--target", default="", help="use a running allocator at host:port (needs --redis-url)")
    p.add_argument("--sequences", type=int, default=256, help="concurrent sequences (default 256)")
    p.add_argument("--steps", type=int, default=512, help="decode steps (default 512)")
    p.add_argument("--block-size", type=int, default=16, help="block size (default 16)")
    p.add_argument("--repeat", type=int, default=200, help="samples per latency figure (default 200)")
    p.add_argument("--remote", action="store_true",
                   help="measure the SDK without local ownership (every change through a Step RPC) instead of "
                        "the default journaled SDK")
    p.add_argument("--forward-ms", type=float, default=0.0,
                   help="after each timed decode step, wait this long (untimed, the GIL released), as an engine "
                        "waits for its forward pass; default 0: steps back to back, the targets' trace")
    p.add_argument("--long", action="store_true",
                   help="measure long sequences instead: appends at ~1k and ~128k tokens (per token, both SDK "
                        "modes), a create of a 1,048,576-token prompt and of the same prompt cached, its fork and "
                        "free (keys append_us_per_token_1k, append_us_per_token_128k, create_1m_ms, "
                        "create_cached_1m_ms)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(func=_bench)

    from kvservice.tools import bench_index, bench_serving, bench_tiers, bench_transfer, bench_vllm, manypools

    _tool(sub, "bench-serving", bench_serving, "drive the HTTP API of a local stack with concurrent streaming chats "
          "(the openai client), and vLLM's server beside it with --vllm-python; print tokens/s and time to first "
          "token")

    _tool(sub, "bench-tiers", bench_tiers, "a multi-turn chat workload over SmolLM2 workers with small device "
          "pools, with the lower tiers off, a host tier, and a host and a disk tier; print the prompt tokens "
          "recomputed and the time to first token")
    _tool(sub, "bench-transfer", bench_transfer, "blocks moved from one SmolLM2 worker to another on one machine "
          "(FetchBlocks over PullBlocks: through shared memory, and in the stream as between machines), beside raw "
          "gRPC streaming of the same bytes and a memory copy")
    _tool(sub, "bench-index", bench_index, "the KV event index at scale on a private Redis: events ingested per "
          "second over ZMQ, and the lookup latency of a long prompt over a million indexed blocks")
    _tool(sub, "bench-vllm", bench_vllm, "vLLM's time to first token on a long shared prefix with the kvservice "
          "connector (loading what another instance computed) and without it (make vllm)")

    from kvservice.tools.shards import DESCRIPTION as shards_description, add_arguments as shards_arguments

    p = sub.add_parser("shards", help="measure on a local Redis Cluster what scales: each shard's share of the "
                                      "load over many pools, one shard's step-script ceiling, the capacity at 3, "
                                      "6 and 12 shards", description=shards_description)
    shards_arguments(p)
    p.set_defaults(func=_shards)

    _tool(sub, "many-pools", manypools, "measure what many registered pools cost on a private Redis: ListPools and "
          "the audit at three sizes, an idle replica's CPU, the longest script call")

    p = sub.add_parser("up", help="start an embedded Redis, an allocator, N model workers and, with --http, the "
                                  "OpenAI-compatible HTTP API; run until Ctrl-C")
    p.add_argument("--workers", type=int, default=2, help="workers (pools) to start (default 2)")
    p.add_argument("--model", default="smollm2-135m",
                   help="model preset every worker serves (default smollm2-135m, SmolLM2-135M-Instruct, converted "
                        "into the model cache on first use; tiny-llama, small-llama, tiny-llama-long (a 128k position range): "
                        "random weights from --model-seed)")
    p.add_argument("--model-seed", type=int, default=0, help="seed of a seeded preset's weights (default 0)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--kv-memory", default="64MiB", help="KV memory per worker (default 64MiB)")
    p.add_argument("--num-blocks", type=int, default=0, help="KV blocks per worker (overrides --kv-memory)")
    tier_arguments(p)
    p.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                   help="a local Redis Cluster of N primaries, each with a replica (node timeout 2 s), instead of "
                        "one Redis")
    p.add_argument("--http", type=int, default=None, metavar="PORT",
                   help="also serve the OpenAI-compatible HTTP API on this port (kvservice api; 0: a free port), "
                        "with an API key it prints")
    p.add_argument("--api-replicas", type=int, default=1, metavar="N",
                   help="with --http: N kvservice api processes (N engines, one lease each, sharing the prefix "
                        "cache) behind a round-robin front on the --http port (default 1)")
    p.add_argument("--roles", default="", metavar="R,R,...",
                   help="each worker's role, comma-separated: both, prefill, decode (disaggregated prefill / "
                        "decode; default: every worker both)")
    p.set_defaults(func=_up)

    from kvservice.api.server import add_arguments as api_arguments

    p = sub.add_parser("api", help="serve the OpenAI-compatible HTTP API (/v1/models, /v1/completions, "
                                   "/v1/chat/completions, /health, /metrics) over an allocator and its workers")
    api_arguments(p)
    p.set_defaults(func=_api)

    p = sub.add_parser("front", help="a round-robin TCP front for several kvservice api replicas: each new "
                                     "connection goes to the next replica (a name with several addresses is "
                                     "several replicas); HTTP, streams and HTTPS pass through")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--backend", action="append", required=True, metavar="HOST:PORT",
                   help="an API replica, or a name whose every address is one (repeatable)")
    p.set_defaults(func=_front)

    from kvservice.events.cli import add_route_arguments, add_router_arguments, route_main, router_main

    p = sub.add_parser("router", help="ingest the KV events of vLLM instances into an index (Redis) and route "
                                      "prompts by it: gRPC kvservice.v1.Router, HTTP POST /route, /metrics")
    add_router_arguments(p)
    p.set_defaults(func=router_main)
    from kvservice.events import pools as pool_events

    p = sub.add_parser("events", help="publish the cache changes of kvservice's pools as vLLM KV events (ZMQ PUB "
                                      "and replay sockets; an allocator started with --kv-events)",
                       description=pool_events.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pool_events.add_arguments(p)
    p.set_defaults(func=pool_events.main)
    p = sub.add_parser("route", help="ask a router which instance should take a prompt (token ids or text)")
    add_route_arguments(p)
    p.set_defaults(func=route_main)

    from kvservice.engine.demo import add_arguments as demo_arguments

    p = sub.add_parser("demo", help="start a local stack and run a batch of requests through the engine "
                                    "(shared prompts, parallel sampling); print a report")
    demo_arguments(p)
    p.set_defaults(func=_demo)

    from kvservice.simulate.cli import add_arguments as simulate_arguments

    p = sub.add_parser("simulate", help="simulate a serving engine's KV memory under contiguous and paged "
                                        "policies (a trace-driven study); print where the memory goes")
    simulate_arguments(p)
    p.set_defaults(func=_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
