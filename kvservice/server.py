"""The allocator gRPC server: ``create_server`` for tests (port 0), ``serve`` for the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvservice.allocator import Allocator
from kvservice.config import Settings
from kvservice.embedded import EmbeddedRedis
from kvservice.interceptor import ErrorInterceptor
from kvservice.launcher import write_port_file
from kvservice.metrics import AllocatorMetrics, MetricsServer
from kvservice.servicer import AllocatorServicer, outcome_to_pb
from kvservice.store import Store, connect
from kvservice.v1 import allocator_pb2, allocator_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = allocator_pb2.DESCRIPTOR.services_by_name["Allocator"].full_name


async def create_server(allocator: Allocator, address: str,
                        metrics: AllocatorMetrics | None = None) -> tuple[grpc.aio.Server, int]:
    """A started-on-demand aio server with the allocator, health and reflection services.

    Returns the server (not yet started) and the bound port (``address`` may end in ``:0``).
    With ``metrics``, every call is timed into its RPC histogram.
    """
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor(outcome_to_pb)]
    if metrics is not None:
        interceptors.insert(0, metrics.interceptor)
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.so_reuseport", 0)])
    allocator_pb2_grpc.add_AllocatorServicer_to_server(AllocatorServicer(allocator), server)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return server, port


async def reaper(allocator: Allocator, interval: float) -> None:
    """Sweeps expired leases every ``interval`` seconds until cancelled."""
    while True:
        try:
            done = await allocator.reap()
            if done["leases"] or done["seqs"]:
                log.info("reaped %d expired leases, %d sequences", done["leases"], done["seqs"])
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
    embedded = None
    url = settings.redis_url
    if not url:
        embedded = EmbeddedRedis().start()
        url = embedded.url
        log.info("embedded Redis %s at %s", embedded.version(), url)
    store = Store(connect(url))
    allocator = Allocator(store, settings)
    metrics = http = None
    if settings.metrics_port >= 0:
        metrics = AllocatorMetrics(allocator, asyncio.get_running_loop(), settings.metrics_exporter_ttl)
        store.observe = metrics.observe_script
    server, port = await create_server(allocator, f"{settings.host}:{settings.port}", metrics)
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
        log.info("kvservice allocator listening on %s:%d (Redis %s)", settings.host, r.port, r.url)
        print(f"kvservice allocator listening on {settings.host}:{r.port}", flush=True)
        if r.metrics_port >= 0:
            print(f"metrics on http://{settings.host}:{r.metrics_port}/metrics", flush=True)
        if port_file:
            write_port_file(port_file, r.port, r.url, r.metrics_port)
        await stop.wait()
        log.info("stopping")

