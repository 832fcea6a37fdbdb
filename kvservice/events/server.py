"""``kvservice router``: ingests KV events of instances into the index (Redis) and answers
"which instance should take this prompt", over gRPC (``kvservice.v1.Router``) and HTTP
(``POST /route``), with its metrics on ``/metrics`` of the HTTP port.

HTTP: ``POST /route`` with ``{"token_ids": [...]}`` or ``{"text": "..."}`` (and optionally
``"lora_name"``) answers ``{"instance", "reason", "num_prompt_tokens", "candidates": [...]}``
(the gRPC reply's fields); a bad body: 400 with ``{"error": ...}``; ``GET /health``: 200;
``GET /metrics``: Prometheus."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvservice import errors
from kvservice.common import hashing
from kvservice.common.metrics import family, histogram
from kvservice.events.index import Index
from kvservice.events.ingest import Ingester, Source
from kvservice.events.router import Ranked, Router
from kvservice.v1 import router_pb2 as pb, router_pb2_grpc as pb_grpc

_log = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 1 << 20
LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def _redis(url: str) -> Any:
    import redis

    from kvservice.allocator.store import is_cluster
    if is_cluster(url):
        return redis.RedisCluster.from_url(url)
    return redis.Redis.from_url(url)


class RouterService:
    """The index, its ingester, the router and their metrics, over one Redis."""

    def __init__(self, redis_url: str, sources: list[Source], *, tokenizer: str = "", load_tokens: float = 16.0,
                 load_window: float = 5.0) -> None:
        self.index = Index(_redis(redis_url))
        self.router = Router(self.index, load_tokens=load_tokens, load_window=load_window)
        self.ingester = Ingester(self.index, sources)
        self.tokenizer = None
        if tokenizer:
            from tokenizers import Tokenizer
            self.tokenizer = Tokenizer.from_file(tokenizer)
        self.registry = CollectorRegistry(auto_describe=True)
        self.lookup_seconds = histogram("route_lookup_seconds", self.registry, LOOKUP_BUCKETS)
        self.routed: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self.registry.register(_Collector(self))

    def start(self) -> "RouterService":
        self.ingester.start()
        return self

    def stop(self) -> None:
        self.ingester.stop()

    def route(self, token_ids: list[int] | None, text: str = "", lora_name: str = "") -> dict[str, Any]:
        """The ranking for a prompt (token ids, or text with the tokenizer)."""
        if token_ids:
            if not isinstance(token_ids, list):
                raise errors.InvalidArgument("token_ids is a list of token ids")
            if len(token_ids) > MAX_PROMPT_TOKENS:
                raise errors.InvalidArgument(f"a prompt of {len(token_ids)} tokens, at most {MAX_PROMPT_TOKENS}")
            hashing.token_bytes_checked(token_ids, "token_ids")
            tokens = list(token_ids)
        elif text:
            if self.tokenizer is None:
                raise errors.InvalidArgument("this router has no tokenizer (--tokenizer): send token_ids")
            tokens = self.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            raise errors.InvalidArgument("a prompt needs token_ids or text")
        t0 = time.perf_counter()
        ranked, reason = self.router.route(tokens, lora_name=lora_name or None)
        self.lookup_seconds.observe(time.perf_counter() - t0)
        if not ranked:
            raise errors.FailedPrecondition("no instance is known: start the router with --instance NAME=ENDPOINT")
        with self._lock:
            key = (ranked[0].instance, reason)
            self.routed[key] = self.routed.get(key, 0) + 1
        return {"instance": ranked[0].instance, "reason": reason, "num_prompt_tokens": len(tokens),
                "candidates": [_candidate(r) for r in ranked]}


def _candidate(r: Ranked) -> dict[str, Any]:
    return {"instance": r.instance, "cost": r.cost, "cached_tokens": r.cached_tokens,
            "cached_blocks": r.cached_blocks, "blocks_by_medium": r.by_medium, "load": r.load}


class _Collector:
    def __init__(self, service: RouterService) -> None:
        self.s = service

    def collect(self):
        names = ("events_ingested_total", "events_dropped_batches_total", "events_replay_requests_total",
                 "events_restarts_total")
        fams = {n: family(n) for n in names}
        for inst, c in self.s.ingester.counters.items():
            for n, v in zip(names, (c.events, c.dropped, c.replays, c.restarts)):
                fams[n].add_metric([inst], v)
        yield from fams.values()
        blocks = family("index_blocks")
        for inst in self.s.ingester.sources:
            try:
                blocks.add_metric([inst], self.s.index.num_blocks(inst))
            except Exception:          # (Redis away: the series is left out this time)
                pass
        yield blocks
        routed = family("routed_requests_total")
        with self.s._lock:
            for (inst, reason), v in self.s.routed.items():
                routed.add_metric([inst, reason], v)
        yield routed


class _Servicer(pb_grpc.RouterServicer):
    def __init__(self, service: RouterService) -> None:
        self.s = service

    def Route(self, request: pb.RouteRequest, context: grpc.ServicerContext) -> pb.RouteResponse:
        try:
            out = self.s.route(list(request.token_ids), request.text, request.lora_name)
        except errors.KvsError as exc:
            context.abort(exc.code, str(exc))
        return pb.RouteResponse(instance=out["instance"], reason=out["reason"],
                                num_prompt_tokens=out["num_prompt_tokens"],
                                candidates=[pb.Candidate(**c) for c in out["candidates"]])


def grpc_server(service: RouterService, host: str, port: int) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_RouterServicer_to_server(_Servicer(service), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound


def http_server(service: RouterService, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:      # (quiet)
            return

        def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b'{"status": "ok"}')
            elif self.path == "/metrics":
                self._send(200, generate_latest(service.registry), "text/plain; version=0.0.4")
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            if self.path != "/route":
                self._send(404, b'{"error": "not found"}')
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not isinstance(body, dict):
                    raise errors.InvalidArgument("the body is a JSON object")
                out = service.route(body.get("token_ids"), body.get("text", ""), body.get("lora_name", ""))
            except (json.JSONDecodeError, UnicodeDecodeError):
                self._send(400, b'{"error": "the body is not JSON"}')
                return
            except errors.KvsError as exc:
                status = 400 if isinstance(exc, errors.InvalidArgument) else 503
                self._send(status, json.dumps({"error": str(exc)}).encode())
                return
            self._send(200, json.dumps(out).encode())

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="kvservice-router-http", daemon=True).start()
    return server
