"""The allocator gRPC server: ``create_server`` for tests (port 0), ``serve`` for the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass

import grpc

from kvservice.allocator.access import ROLES
from kvservice.allocator.config import Settings
from kvservice.allocator.core import Allocator
from kvservice.allocator.embedded import EmbeddedRedis
from kvservice.allocator.metrics import AllocatorMetrics
from kvservice.allocator.servicer import AllocatorServicer, outcome_to_pb
from kvservice.allocator.store import Store, connect, redacted
from kvservice.common.auth import AuthInterceptor, TokenFile
from kvservice.common.grpc import build_server, write_port_file
from kvservice.common.interceptor import ErrorInterceptor
from kvservice.common.metrics import MetricsServer
from kvservice.common.security import ServerTls, read_secret, server_tls
from kvservice.v1 import allocator_pb2, allocator_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = allocator_pb2.DESCRIPTOR.services_by_name["Allocator"].full_name


async def create_server(allocator: Allocator, address: str, metrics: AllocatorMetrics | None = None,
                        outer: tuple[grpc.aio.ServerInterceptor, ...] = (),
                        tokens: TokenFile | None = None, tls: ServerTls | None = None,
                        max_message: int = 16 << 20) -> tuple[grpc.aio.Server, int]:
    """A not-yet-started server with the allocator, health and reflection services.

    Returns the server and the bound port (``address`` may end in ``:0``). With
    ``metrics``, every call is timed into its RPC histogram. ``outer``: interceptors that
    run before the others (tests use them to lose replies). With ``tokens``, or ``tls``
    with a client CA (whose certificates then prove identities), every Allocator call is
    authenticated and checked against the role table (``access.ROLES``).
    """
    interceptors: list[grpc.aio.ServerInterceptor] = [*outer, ErrorInterceptor(outcome_to_pb)]
    certificates = tls is not None and bool(tls.client_ca)
    if tokens is not None or certificates:
        interceptors.insert(len(outer), AuthInterceptor(ROLES, tokens, certificates))
    if metrics is not None:
        interceptors.insert(0, metrics.interceptor)
    server, port, _ = await build_server(
        address, [(allocator_pb2_grpc.add_AllocatorServicer_to_server, AllocatorServicer(allocator))],
        [SERVICE_NAME], interceptors=interceptors, credentials=tls.credentials() if tls else None,
        max_message=max_message)
    return server, port


async def reaper(allocator: Allocator, interval: float) -> None:
    """Sweeps expired leases every ``interval`` seconds until cancelled."""
    while True:
        try:
            done = await allocator.reap()
            if done["leases"] or done["sequences"]:
                log.info("reaped %d expired leases, %d sequences", done["leases"], done["sequences"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - keep sweeping through Redis hiccups
            log.warning("reaper: %s", exc)
        await asyncio.sleep(interval)


@dataclass(slots=True)
class Running:
    """What ``running`` started: the gRPC port, the Redis URL and the metrics port (-1: off)."""

    port: int
    url: str
    metrics_port: int


@contextlib.asynccontextmanager
async def running(settings: Settings):
    """Runs an allocator server (and an embedded Redis if no URL is set) with its
    /metrics endpoint (unless ``metrics_port`` is -1); yields a ``Running``."""
    # Credentials first: a missing file stops the server before anything starts.
    tokens = TokenFile(settings.tokens_file) if settings.tokens_file else None
    tls = server_tls(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    if tls is not None:
        tls.credentials()
    if settings.prefix_cache_secret_file:
        read_secret(settings.prefix_cache_secret_file, "prefix_cache_secret_file")
    embedded = None
    url = read_secret(settings.redis_url_file, "redis_url_file") if settings.redis_url_file else settings.redis_url
    if not url:
        embedded = EmbeddedRedis(secure=True).start()
        url = embedded.url
        log.info("embedded Redis %s at %s", embedded.version(), embedded.where)
    cluster = {"on": True, "off": False}.get(settings.redis_cluster)     # (auto: None, connect detects it)
    store = Store(connect(url, settings.redis_max_connections, settings.redis_pool_timeout, cluster=cluster),
                  wait_replicas=settings.redis_wait_replicas, wait_timeout_ms=settings.redis_wait_timeout_ms)
    if store.cluster:
        log.info("Redis Cluster at %s", redacted(url))
    if settings.redis_wait_replicas:
        log.info("scripts that hand out or free blocks wait for %d replica(s), %d ms at most",
                 settings.redis_wait_replicas, settings.redis_wait_timeout_ms)
    allocator = Allocator(store, settings)
    metrics = http = None
    if settings.metrics_port >= 0:
        metrics = AllocatorMetrics(allocator, asyncio.get_running_loop(), settings.metrics_exporter_ttl)
        store.observe = metrics.observe_script
    server, port = await create_server(allocator, f"{settings.host}:{settings.port}", metrics, tokens=tokens,
                                       tls=tls, max_message=settings.max_message_mb << 20)
    await server.start()
    if metrics is not None:
        http = MetricsServer(metrics.registry, settings.host, settings.metrics_port)
    sweeper = asyncio.create_task(reaper(allocator, settings.reap_interval))
    try:
        yield Running(port, url, http.port if http else -1)
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        if http is not None:
            http.stop()
            with contextlib.suppress(Exception):
                await metrics.collector.release()
        await server.stop(grace=2)
        await store.close()
        if embedded is not None:
            embedded.stop()


async def serve(settings: Settings, port_file: str | None = None) -> None:
    """Serves until SIGINT / SIGTERM, then stops gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running(settings) as r:
        log.info("kvservice allocator listening on %s:%d (Redis %s)", settings.host, r.port, redacted(r.url))
        print(f"kvservice allocator listening on {settings.host}:{r.port}", flush=True)
        if r.metrics_port >= 0:
            print(f"metrics on http://{settings.host}:{r.metrics_port}/metrics", flush=True)
        if port_file:
            write_port_file(port_file, r.port, r.url, r.metrics_port)
        await stop.wait()
        log.info("stopping")

