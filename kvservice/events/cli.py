"""``kvservice router`` (the KV event router: ingest, index, route) and ``kvservice route``
(ask it, from the command line)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import urllib.error
import urllib.request

from kvservice.common.security import check_listen


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", required=True, metavar="URL",
                   help="the Redis (or one node of a Redis Cluster) that keeps the index")
    p.add_argument("--instance", action="append", default=[], metavar="NAME=ENDPOINT[,REPLAY]",
                   help="a KV event publisher to ingest (a vLLM instance's --kv-events-config endpoint and "
                        "replay_endpoint, e.g. vllm-0=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558); repeat per instance")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50071, help="gRPC port (kvservice.v1.Router; default 50071)")
    p.add_argument("--http-port", type=int, default=8100, help="HTTP port: POST /route, /health, /metrics "
                                                               "(default 8100)")
    p.add_argument("--tokenizer", default="", metavar="FILE",
                   help="a tokenizer.json: routes text prompts too (default: token ids only)")
    p.add_argument("--load-tokens", type=float, default=16.0,
                   help="prompt tokens one request routed within the load window weighs (default 16)")
    p.add_argument("--load-window", type=float, default=5.0,
                   help="seconds a routed request counts as load (default 5)")
    p.add_argument("--insecure", action="store_true",
                   help="listen beyond loopback (the router has no TLS: keep it on a private network)")


def router_main(args: argparse.Namespace) -> int:
    from kvservice.events.ingest import Source
    from kvservice.events.server import RouterService, grpc_server, http_server

    try:
        sources = [Source.parse(s) for s in args.instance]
        check_listen(args.host, False, args.insecure, "the router")
    except ValueError as exc:
        print(f"kvservice router: {exc}", file=sys.stderr)
        return 2
    if not sources:
        print("kvservice router: name at least one --instance NAME=ENDPOINT[,REPLAY]", file=sys.stderr)
        return 2
    import redis

    try:
        service = RouterService(args.redis, sources, tokenizer=args.tokenizer, load_tokens=args.load_tokens,
                                load_window=args.load_window).start()
    except redis.exceptions.RedisError as exc:
        print(f"kvservice router: cannot reach Redis at {args.redis}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:               # (a tokenizer file that does not load)
        print(f"kvservice router: {exc}", file=sys.stderr)
        return 2
    server, port = grpc_server(service, args.host, args.port)
    web = http_server(service, args.host, args.http_port)
    print(f"kvservice router: gRPC on {args.host}:{port}, HTTP on {args.host}:{web.server_address[1]}, "
          f"{len(sources)} instance(s)", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    web.shutdown()
    server.stop(2)
    service.stop()
    return 0


def add_route_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default="http://127.0.0.1:8100", help="the router's HTTP address "
                                                                     "(default http://127.0.0.1:8100)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokens", help="the prompt's token ids, comma-separated")
    g.add_argument("--text", help="the prompt's text (the router needs --tokenizer)")
    p.add_argument("--json", action="store_true", help="print the router's whole answer as JSON")


def route_main(args: argparse.Namespace) -> int:
    try:
        body = {"token_ids": [int(t) for t in args.tokens.split(",")]} if args.tokens else {"text": args.text}
    except ValueError:
        print("kvservice route: --tokens is comma-separated integers", file=sys.stderr)
        return 2
    request = urllib.request.Request(f"{args.router.rstrip('/')}/route", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            out = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        print(f"kvservice route: {exc.code}: {json.loads(exc.read()).get('error', '')}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvservice route: cannot reach {args.router}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['instance']} ({out['reason']}), prompt of {out['num_prompt_tokens']} tokens")
    for c in out["candidates"]:
        media = ", ".join(f"{k} {v}" for k, v in sorted(c["blocks_by_medium"].items())) or "none"
        print(f"  {c['instance']:<20} cost {c['cost']:>10.1f}  cached {c['cached_tokens']:>8.1f} tokens "
              f"({media})  load {c['load']}")
    return 0
