"""The SDK's channel to the allocator: every replica behind one gRPC channel.

Failover is gRPC's own (docs/allocator.md, "Failover and fencing"): the channel's target
names every replica (``ipv4:10.0.0.1:50051,10.0.0.2:50051``), the ``round_robin`` policy
keeps a connection to each and sends every call to one that is up, and the service
config's ``retryPolicy`` resends a call that failed with UNAVAILABLE (its replica died
under it, or none was up) to whichever replica is up, unchanged: the same bytes, so the
same ``request_id``, which the allocator answers from the first outcome if that call was
applied after all. No loop here sends anything.

Example::

    channel = open_channel("10.0.0.1:50051,10.0.0.2:50051", retry_budget=5.0)
"""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Iterable

import grpc

from kvservice.common.security import ClientCredentials
from kvservice.v1 import allocator_pb2

SERVICE_NAME = allocator_pb2.DESCRIPTOR.services_by_name["Allocator"].full_name

#: gRPC's limit: a retry policy makes at most 5 attempts (more are clamped to 5).
MAX_ATTEMPTS = 5
#: Each backoff is this factor times the one before (4 backoffs: 1 + 3 + 9 + 27 = 40 units).
BACKOFF_MULTIPLIER = 3
#: Target schemes that gRPC resolves itself: such a target is used as it is.
SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds", "google-c2p")
#: The largest message, both ways (a Sync of a big journal, an Audit of a big pool).
MAX_MESSAGE = 64 << 20


def parse_targets(target: str | Iterable[str]) -> list[str]:
    """The addresses in ``target``: ``"h1:p1,h2:p2"``, a list of ``host:port``, or one
    gRPC target (``dns:///name:port``, ``ipv4:...``, ``unix:...``).

    Raises:
        ValueError: no address at all.
    """
    parts = target.split(",") if isinstance(target, str) else list(target)
    addresses = [a.strip() for a in parts if a and a.strip()]
    if not addresses:
        raise ValueError(f"no allocator address in {target!r}")
    return addresses


def channel_target(addresses: list[str]) -> str:
    """One gRPC target for ``addresses``: a single address as it is, several as one
    ``ipv4:``/``ipv6:`` list (host names resolved now, once).

    Raises:
        ValueError: an address is not ``host:port``, a host name does not resolve, or
            IPv4 and IPv6 addresses are mixed (gRPC's static resolvers take one family).
    """
    if len(addresses) == 1:
        return addresses[0]
    for a in addresses:
        if a.split(":", 1)[0] in SCHEMES:
            raise ValueError(f"{a!r}: a list of replicas takes host:port addresses, not gRPC targets")
    resolved = dict.fromkeys(ip for a in addresses for ip in _resolve(a))
    families = {ipaddress.ip_address(host).version for host, _ in resolved}
    if len(families) > 1:
        raise ValueError(f"the replicas {addresses} mix IPv4 and IPv6 addresses: give one family")
    if families == {6}:
        return "ipv6:" + ",".join(f"[{host}]:{port}" for host, port in resolved)
    return "ipv4:" + ",".join(f"{host}:{port}" for host, port in resolved)


def service_config(retry_budget: float) -> str:
    """The channel's service config (JSON): ``round_robin`` over the replicas, and a retry
    policy for every Allocator method whose backoffs add up to ``retry_budget`` seconds
    (±20%: gRPC's jitter), so that a call outlives an outage that short.

    NOTE: gRPC caps maxAttempts at 5, so the backoffs grow (budget / 40, x3 each time):
    the first retry, the one that fails a call over to another replica, comes soon
    (125 ms for 5 s); the last ones wait for a restarting replica. The call's deadline
    bounds all attempts.
    """
    if not retry_budget > 0:
        raise ValueError(f"retry_budget must be > 0 seconds, got {retry_budget!r}")
    units = sum(BACKOFF_MULTIPLIER ** i for i in range(MAX_ATTEMPTS - 1))
    initial = retry_budget / units
    policy = {"maxAttempts": MAX_ATTEMPTS,
              "initialBackoff": _duration(initial),
              "maxBackoff": _duration(initial * BACKOFF_MULTIPLIER ** (MAX_ATTEMPTS - 2)),
              "backoffMultiplier": BACKOFF_MULTIPLIER,
              "retryableStatusCodes": ["UNAVAILABLE"]}
    return json.dumps({"loadBalancingConfig": [{"round_robin": {}}],
                       "methodConfig": [{"name": [{"service": SERVICE_NAME}], "retryPolicy": policy}]})


def channel_options(retry_budget: float) -> list[tuple[str, int | str]]:
    """The channel arguments: retries on, the service config, and reconnects to a
    restarted replica within ``retry_budget / 20`` seconds (50 to 250 ms; gRPC's default
    backoff would wait 1 s, then 1.6 s, 2.6 s... and miss a short outage)."""
    reconnect_ms = max(50, min(250, int(retry_budget * 1000 / 20)))
    return [("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", service_config(retry_budget)),
            # A call is only resent if its request fits the retry buffer (256 KiB by default).
            ("grpc.per_rpc_retry_buffer_size", MAX_MESSAGE),
            ("grpc.initial_reconnect_backoff_ms", reconnect_ms),
            ("grpc.max_reconnect_backoff_ms", reconnect_ms)]


def open_channel(target: str | Iterable[str], retry_budget: float,
                 credentials: ClientCredentials | None = None) -> grpc.Channel:
    """A channel to every replica in ``target`` (see ``parse_targets``), with
    ``credentials`` (a bearer token, TLS; default: none, plaintext)."""
    creds = credentials or ClientCredentials()
    return creds.channel(channel_target(parse_targets(target)), channel_options(retry_budget))


def _resolve(address: str) -> list[tuple[str, int]]:
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    host, port = host.strip("[]"), int(port_text)
    try:
        return [(str(ipaddress.ip_address(host)), port)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"{address!r}: {host} does not resolve ({exc})") from None
    v4 = [(info[4][0], port) for info in infos if info[0] == socket.AF_INET]
    return v4 or [(info[4][0], port) for info in infos if info[0] == socket.AF_INET6]


def _duration(seconds: float) -> str:
    return f"{max(seconds, 0.001):.3f}s"
