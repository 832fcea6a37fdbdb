"""TLS and credentials for every gRPC server and client of the project (docs/security.md).

Servers: ``ServerTls`` (certificate, key, and the CA of client certificates for mTLS)
gives the port's credentials; ``check_listen`` refuses a plaintext port beyond loopback
unless the operator said ``--insecure``.

Clients: ``ClientCredentials`` (a bearer token, the CA that signed the servers'
certificates, and this client's own certificate for mTLS), read from ``KVSERVICE_*``
variables or given; ``channel`` / ``aio_channel`` open a channel with them. Over TLS the
token travels as gRPC call credentials (``access_token_call_credentials``); over a
plaintext loopback channel an interceptor adds the same ``authorization: Bearer`` entry.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, replace
from typing import Any, Mapping

import grpc

ENV = "KVSERVICE_"
#: The variables a client's credentials come from (every process that calls a server).
CLIENT_ENV = tuple(ENV + n for n in ("TOKEN", "TOKEN_FILE", "TLS_CA", "CLIENT_CERT", "CLIENT_KEY", "TLS_SERVER_NAME"))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or a name) is only reachable from this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_listen(host: str, tls: bool, insecure: bool, what: str) -> None:
    """Refuses plaintext beyond loopback without an explicit ``insecure``.

    Raises:
        ValueError: saying which flags fix it.
    """
    if not tls and not insecure and not is_loopback(host):
        raise ValueError(f"{what} would listen on {host} without TLS: give --tls-cert and --tls-key "
                         f"(see docs/security.md), or --insecure to allow plaintext beyond loopback")


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A server's TLS files (PEM): its certificate chain, its key and, for mTLS, the CA
    whose client certificates it accepts (every client must then present one)."""

    cert: str
    key: str
    client_ca: str = ""

    def credentials(self) -> grpc.ServerCredentials:
        ca = _read(self.client_ca) if self.client_ca else None
        return grpc.ssl_server_credentials([(_read(self.key), _read(self.cert))], root_certificates=ca,
                                           require_client_auth=ca is not None)


def server_tls(cert: str, key: str, client_ca: str) -> ServerTls | None:
    """The server's TLS from its settings (None: plaintext).

    Raises:
        ValueError: a half-given pair, or a client CA without a certificate. (The files
            are read when the server starts.)
    """
    if bool(cert) != bool(key):
        raise ValueError("tls_cert and tls_key go together")
    if client_ca and not cert:
        raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
    if not cert:
        return None
    return ServerTls(cert, key, client_ca)


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    """What a client presents: a bearer token and/or TLS (empty fields: not used).

    Attributes:
        token: the bearer token (``KVSERVICE_TOKEN``, or the first line of the file
            ``KVSERVICE_TOKEN_FILE``).
        ca: PEM file of the CA that signed the servers' certificates; set: TLS.
        cert, key: PEM files of this client's certificate and key (mTLS).
        server_name: the name to check the server's certificate against, when the
            address is not one of its names.
    """

    token: str = ""
    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **given: Any) -> "ClientCredentials":
        """``KVSERVICE_TOKEN`` / ``_TOKEN_FILE``, ``_TLS_CA``, ``_CLIENT_CERT``, ``_CLIENT_KEY``,
        ``_TLS_SERVER_NAME``; then the ``given`` fields that are not None."""
        env = os.environ if env is None else env
        token = env.get(ENV + "TOKEN", "")
        if not token and env.get(ENV + "TOKEN_FILE"):
            token = read_secret(env[ENV + "TOKEN_FILE"])
        out = cls(token, env.get(ENV + "TLS_CA", ""), env.get(ENV + "CLIENT_CERT", ""),
                  env.get(ENV + "CLIENT_KEY", ""), env.get(ENV + "TLS_SERVER_NAME", ""))
        return replace(out, **{k: v for k, v in given.items() if v is not None})

    @property
    def tls(self) -> bool:
        return bool(self.ca)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.tls and self.server_name else []

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate needs its key (KVSERVICE_CLIENT_CERT and KVSERVICE_CLIENT_KEY)")
        creds = grpc.ssl_channel_credentials(_read(self.ca), _read(self.key) if self.key else None,
                                             _read(self.cert) if self.cert else None)
        if self.token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(self.token))
        return creds

    def channel(self, target: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A blocking channel to ``target`` with these credentials."""
        opts = [*(options or []), *self.options()]
        if self.tls:
            return grpc.secure_channel(target, self.channel_credentials(), options=opts)
        channel = grpc.insecure_channel(target, options=opts)
        return grpc.intercept_channel(channel, _Bearer(self.token)) if self.token else channel

    def aio_channel(self, target: str, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
        """An asyncio channel to ``target`` with these credentials."""
        opts = [*(options or []), *self.options()]
        if self.tls:
            return grpc.aio.secure_channel(target, self.channel_credentials(), options=opts)
        interceptors = [_AioBearer(self.token)] if self.token else None
        return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)


def read_secret(path: str, what: str = "token file") -> str:
    """A secret kept in a file (a token, a URL with a password, a key): its first line,
    stripped (a mounted Secret, never a command line).

    Raises:
        ValueError: an empty file; OSError: an unreadable one.
    """
    with open(path, encoding="utf-8") as f:
        secret = f.readline().strip()
    if not secret:
        raise ValueError(f"{what} {path} is empty")
    return secret


class _Details(grpc.ClientCallDetails):
    """A call's details with the bearer token added to its metadata."""

    def __init__(self, base: Any, token: str) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = [*(base.metadata or ()), ("authorization", f"Bearer {token}")]
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _Bearer(grpc.UnaryUnaryClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a plaintext channel."""

    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(_Details(client_call_details, self.token), request)


class _AioBearer(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        metadata = list(client_call_details.metadata or ())
        metadata.append(("authorization", f"Bearer {self.token}"))
        details = grpc.aio.ClientCallDetails(client_call_details.method, client_call_details.timeout, metadata,
                                             client_call_details.credentials, client_call_details.wait_for_ready)
        return await continuation(details, request)
