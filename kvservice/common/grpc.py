"""One way to build a gRPC server (allocator and worker alike), and the port file.

``build_server(address, ...)`` returns the server before it starts and the port it bound,
so tests bind port 0; ``serve()`` functions start it and stop it gracefully on SIGTERM.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

#: Status codes after which a call with a request id may be sent again unchanged.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

#: The largest message of a stream of blocks between workers (Worker.PullBlocks): 16 MiB
#: of data and its framing (worker/transfer.py).
MAX_BLOCK_STREAM_MESSAGE = 17 << 20
#: ``add_XServicer_to_server`` and the servicer it adds.
ServicerAdder = tuple[Callable[[Any, grpc.aio.Server], None], Any]


class HealthServicer(health.aio.HealthServicer):
    """gRPC health (``grpc.health.v1.Health``) with ``List``, which grpcio's servicer
    leaves unimplemented: every service's status, as ``Check`` answers it for each."""

    #: The protocol's bound on the services one List answers (RESOURCE_EXHAUSTED past it).
    MAX_LIST = 100

    async def List(self, request: health_pb2.HealthListRequest, context: Any) -> health_pb2.HealthListResponse:
        statuses = dict(self._server_status)
        if len(statuses) > self.MAX_LIST:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(statuses)} services, more than one List answers ({self.MAX_LIST})")
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()})


async def build_server(address: str, services: Iterable[ServicerAdder], service_names: Iterable[str], *,
                       interceptors: Iterable[grpc.aio.ServerInterceptor] = (), max_message: int = 64 << 20,
                       serving: bool = True, credentials: grpc.ServerCredentials | None = None
                       ) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """A not-yet-started aio server with the given services, gRPC health and reflection.

    Args:
        address: ``host:port`` to bind (port 0: any free port).
        services: ``(add_XServicer_to_server, servicer)`` pairs.
        service_names: the full names of those services (for health and reflection).
        interceptors: server interceptors, outermost first.
        max_message: the largest request (and reply) in bytes.
        serving: the initial health status of every service (and of ``""``).
        credentials: TLS for the port (``kvservice.common.security.ServerTls``); None: plaintext.

    Returns:
        The server, the bound port and the health servicer (``set_serving`` changes it).

    Raises:
        OSError: the address cannot be bound.
    """
    server = grpc.aio.server(interceptors=list(interceptors),
                             options=[("grpc.max_receive_message_length", max_message),
                                      ("grpc.max_send_message_length", max_message),
                                      ("grpc.so_reuseport", 0)])
    names = list(service_names)
    for add, servicer in services:
        add(servicer, server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_serving(health_servicer, serving, names)
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return server, port, health_servicer


async def set_serving(health_servicer: HealthServicer, serving: bool, service_names: Iterable[str]) -> None:
    """Sets the health status of ``service_names`` and of the server as a whole (``""``)."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await health_servicer.set(name, status)


def write_port_file(path: str, port: int, extra: str, metrics_port: int) -> None:
    """Writes ``<port>\\n<extra>\\n<metrics port>\\n`` atomically (what
    ``kvservice.tools.launcher.ServiceProcess`` reads)."""
    with open(path + ".tmp", "w") as f:
        f.write(f"{port}\n{extra}\n{metrics_port}\n")
    os.replace(path + ".tmp", path)
