"""Starts services as separate processes (for ``kvservice up``, the demo, the benchmark and tests).

``AllocatorProcess`` runs ``python -m kvservice serve``; ``WorkerProcess`` runs
``python -m worker`` (by module name: nothing here imports the worker, torch or CuPy).
Each binds port 0 (or a given port) and a free /metrics port (unless its command names
``--metrics-port``), reports both through a file, and is stopped with SIGTERM. ``Stack``
starts a whole local deployment: an embedded Redis, an allocator and N workers serving a
model, with TLS and authentication on (throwaway credentials), and optionally the
OpenAI-compatible HTTP API (``ApiProcess``, ``python -m kvservice api``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvservice.allocator.embedded import EmbeddedCluster, EmbeddedRedis, terminate
from kvservice.common.security import ClientCredentials

if TYPE_CHECKING:
    from kvservice.v1 import allocator_pb2


class ServiceProcess:
    """A child process that writes ``<port>\\n<extra>\\n<metrics port>\\n`` to ``--port-file``
    once serving.

    Args:
        command: the module and its arguments, after ``python -m``.
        env: extra environment variables.
    """

    name = "service"
    #: Whether the command takes ``--metrics-port`` (the API serves /metrics on its own port).
    metrics_flag = True

    def __init__(self, command: list[str], *, env: dict[str, str] | None = None, port: int = 0) -> None:
        self.command = command
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.port = port
        self.extra = ""
        #: The /metrics port (-1: metrics off).
        self.metrics_port = -1
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """``http://127.0.0.1:<metrics port>/metrics``."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> "ServiceProcess":
        """Spawns the process and (with ``wait``) waits until it serves."""
        self._dir = tempfile.TemporaryDirectory(prefix=f"kvs-{self.name}-")
        log = open(Path(self._dir.name, "log"), "wb")
        cmd = [sys.executable, "-m", *self.command, "--port", str(self.port),
               "--port-file", str(Path(self._dir.name, "port"))]
        if self.metrics_flag and "--metrics-port" not in self.command:
            cmd += ["--metrics-port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **self.env})
        log.close()
        return self.wait_ready(timeout) if wait else self

    def wait_ready(self, timeout: float = 30.0) -> "ServiceProcess":
        """Waits until the process has written its port file."""
        assert self.proc is not None and self._dir is not None, "start() first"
        port_file = Path(self._dir.name, "port")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if port_file.exists():
                port, extra, metrics = (port_file.read_text().split("\n") + [""])[:3]
                self.port, self.extra, self.metrics_port = int(port), extra, int(metrics or -1)
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"{self.name} did not start within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        """The last 4,000 characters of the process's output."""
        if self._dir is None:
            return ""
        try:
            return Path(self._dir.name, "log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc:
            terminate(self.proc)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class AllocatorProcess(ServiceProcess):
    """``python -m kvservice serve`` on a free port.

    Args:
        redis_url: the Redis to use; None starts an embedded one inside the process.
        args: more ``serve`` flags.
        env: extra environment variables.
    """

    name = "allocator"

    def __init__(self, redis_url: str | None = None, *, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, port: int = 0) -> None:
        command = ["kvservice", "serve", *args]
        # (the URL carries the Redis credentials: in the environment, not on the command line)
        env = {**(env or {}), **({"KVSERVICE_REDIS_URL": redis_url} if redis_url else {})}
        super().__init__(command, env=env, port=port)
        self.redis_url = redis_url

    @property
    def url(self) -> str:
        """The Redis URL the allocator uses (its embedded one, or the one given)."""
        return self.extra


class WorkerProcess(ServiceProcess):
    """``python -m worker`` on a free port; ``args`` are its flags (see ``--help``)."""

    name = "worker"

    def __init__(self, *args: str, env: dict[str, str] | None = None, port: int = 0) -> None:
        super().__init__(["worker", *args], env=env, port=port)

    @property
    def pool_id(self) -> str:
        """The pool the worker serves (its port file's second line)."""
        return self.extra


class ApiProcess(ServiceProcess):
    """``python -m kvservice api`` (the OpenAI-compatible HTTP API) on a free port or ``port``;
    ``args`` are its flags. /metrics is on the same port."""

    name = "api"
    metrics_flag = False

    def __init__(self, allocator: str, *args: str, env: dict[str, str] | None = None, port: int = 0) -> None:
        super().__init__(["kvservice", "api", "--allocator", allocator, *args], env=env, port=port)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>/v1``: an OpenAI client's ``base_url``."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model(self) -> str:
        """The model's id (its port file's second line)."""
        return self.extra


def usable_cores() -> int:
    """The cores this process's children may use: ``OMP_NUM_THREADS`` when it is set (the
    convention of every OpenMP program, torch included), else the CPUs of its affinity mask."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return len(os.sched_getaffinity(0)) or 1


class Stack:
    """An embedded Redis, an allocator and ``workers`` model workers, each its own process.

    Workers are named ``worker-0`` … ``worker-<N-1>`` and register with the allocator;
    ``stop()`` (or leaving the ``with`` block) stops them all, workers first.

    With ``secure`` (the default), the stack makes throwaway credentials first, in a
    private directory (``credentials_dir``): a CA, one server certificate, a client
    certificate per worker (role worker), for an ``engine`` tenant and for an ``admin``,
    and an empty tokens file (``kvservice token add NAME --file <dir>/tokens`` issues more
    tenants while it runs). Every server then takes mTLS only; ``credentials(name)`` is
    what a client presents.

    Args:
        workers: number of workers (pools).
        model: the model preset every worker serves (``python -m worker --model``).
        model_seed: the seed of the model's weights.
        block_size: tokens per KV block.
        kv_memory: each worker's KV budget (``2GiB``, ``64MiB``, ...).
        num_blocks: blocks per worker (overrides ``kv_memory`` when > 0).
        worker_args: more ``python -m worker`` flags.
        roles: each worker's role (``--role``: both, prefill, decode; DESIGN §13), in order;
            empty: every worker both.
        allocator_args: more ``kvservice serve`` flags.
        secure: TLS and authentication on every server (see above).
        http_port: also start the OpenAI-compatible HTTP API (``kvservice api``) on this
            port (0: a free one), a client of its own (tenant ``api``); a secure stack
            makes it an API key (``api_key``). None: no API.
        api_args: more ``kvservice api`` flags.
        redis_cluster: with N > 0, a local Redis Cluster of N primaries with a replica each
            (``EmbeddedCluster``) instead of one Redis.
        redis_fsync: one Redis with its append-only file on and this ``appendfsync``
            (``always``, ``everysec``; "": no AOF, the local stack's default).
    """

    #: The client identities a secure stack makes certificates for (name, role).
    IDENTITIES = (("engine", "tenant"), ("api", "tenant"), ("admin", "admin"))

    def __init__(self, workers: int = 2, *, model: str = "smollm2-135m", model_seed: int = 0,
                 block_size: int = 16, kv_memory: str = "64MiB", num_blocks: int = 0,
                 worker_args: tuple[str, ...] = (), allocator_args: tuple[str, ...] = (),
                 secure: bool = True, http_port: int | None = None, api_args: tuple[str, ...] = (),
                 redis_cluster: int = 0, redis_fsync: str = "", roles: tuple[str, ...] = (),
                 api_replicas: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"a stack needs at least one worker, got {workers}")
        if api_replicas < 1:
            raise ValueError(f"api_replicas must be at least 1, got {api_replicas}")
        if roles and len(roles) != workers:
            raise ValueError(f"{len(roles)} roles for {workers} workers")
        self.roles = tuple(roles)
        self.secure = secure
        self._creds_dir: tempfile.TemporaryDirectory | None = None
        self.num_workers, self.model, self.model_seed = workers, model, model_seed
        self.block_size, self.kv_memory, self.num_blocks = block_size, kv_memory, num_blocks
        self.worker_args, self.allocator_args = worker_args, allocator_args
        self.redis: EmbeddedRedis | EmbeddedCluster | None = None
        self.redis_cluster = redis_cluster
        self.redis_fsync = redis_fsync
        self.allocator: AllocatorProcess | None = None
        self.workers: list[WorkerProcess] = []
        self.http_port, self.api_args, self.api_replicas = http_port, api_args, api_replicas
        #: The HTTP API's replicas (``api``: the first), and with more than one the
        #: round-robin front that listens on ``http_port`` (``http_url``).
        self.apis: list[ApiProcess] = []
        self.api: ApiProcess | None = None
        self.front = None
        #: Whether the model is a pretrained preset (known once started).
        self.pretrained = False
        #: Each worker's torch threads: the cores this process may use shared out (threads
        #: of several workers on the same cores slow every step down several times).
        self.torch_threads = max(1, usable_cores() // workers)

    @property
    def http_url(self) -> str:
        """``http://127.0.0.1:<port>/v1`` of the HTTP API: its front with several replicas."""
        if self.front is not None:
            return f"http://127.0.0.1:{self.front.port}/v1"
        assert self.api is not None, "a stack with an HTTP API, started"
        return self.api.url

    @property
    def api_key(self) -> str:
        """The key a client of the stack's HTTP API sends (a secure stack's; else "")."""
        if not self.secure or self._creds_dir is None:
            return ""
        path = Path(self.credentials_dir, "api-key")
        return path.read_text().strip() if path.exists() else ""

    @property
    def target(self) -> str:
        """``host:port`` of the allocator."""
        assert self.allocator is not None, "start() first"
        return self.allocator.target

    @property
    def credentials_dir(self) -> str:
        """Where a secure stack's CA, certificates and tokens file are."""
        assert self._creds_dir is not None, "a secure stack, started"
        return self._creds_dir.name

    def credentials(self, name: str = "engine", token: str = "") -> ClientCredentials:
        """What a client of this stack presents: the CA and ``name``'s client certificate
        (``engine``: a tenant; ``admin``; ``worker-<i>``), and a bearer token if given.
        A stack that is not secure takes none: empty credentials."""
        if not self.secure:
            return ClientCredentials(token=token)
        d = Path(self.credentials_dir)
        return ClientCredentials(token=token, ca=str(d / "ca.pem"), cert=str(d / f"{name}.pem"),
                                 key=str(d / f"{name}-key.pem"))

    def audit(self, pool_id: str = "", timeout: float = 30.0) -> "allocator_pb2.AuditResponse":
        """The allocator's audit (as the stack's admin)."""
        from kvservice.v1 import allocator_pb2, allocator_pb2_grpc

        with self.credentials("admin").channel(self.target) as channel:
            return allocator_pb2_grpc.AllocatorStub(channel).Audit(allocator_pb2.AuditRequest(pool_id=pool_id),
                                                                  timeout=timeout)

    def _make_credentials(self) -> None:
        from kvservice.tools.certs import make_certs

        self._creds_dir = tempfile.TemporaryDirectory(prefix="kvs-credentials-")
        d = self._creds_dir.name
        workers = [(f"worker-{i}", "worker") for i in range(self.num_workers)]
        make_certs(d, clients=[*workers, *self.IDENTITIES])
        fd = os.open(Path(d, "tokens"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
        if self.http_port is not None:
            import secrets

            fd = os.open(Path(d, "api-key"), os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"kvs-{secrets.token_urlsafe(24)}\n")

    def _write_redis_urls(self) -> None:
        for name, url in (("redis-url", self.redis.tcp_url), ("redis-admin-url", self.redis.admin_url)):
            fd = os.open(Path(self.credentials_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(url + "\n")

    def _server_args(self) -> list[str]:
        if not self.secure:
            return []
        d = self.credentials_dir
        return ["--tls-cert", f"{d}/server.pem", "--tls-key", f"{d}/server-key.pem", "--tls-client-ca", f"{d}/ca.pem",
                "--tokens-file", f"{d}/tokens"]

    def _client_env(self, name: str) -> dict[str, str]:
        c = self.credentials(name)
        return {"KVSERVICE_TLS_CA": c.ca, "KVSERVICE_CLIENT_CERT": c.cert, "KVSERVICE_CLIENT_KEY": c.key} \
            if self.secure else {}

    def start(self, timeout: float = 120.0) -> "Stack":
        """Makes the credentials (secure), starts Redis, then the allocator, converts a
        pretrained model if the cache lacks it, then starts every worker (in parallel)
        and the HTTP API if asked; waits until all serve."""
        try:
            if self.secure:
                self._make_credentials()
            self.redis = (EmbeddedCluster(self.redis_cluster, 1, secure=self.secure) if self.redis_cluster
                          else EmbeddedRedis(port=0, secure=self.secure, aof=bool(self.redis_fsync),
                                             fsync=self.redis_fsync or "everysec")).start()
            if self.secure:
                self._write_redis_urls()
            self.allocator = AllocatorProcess(self.redis.url, args=(*self._server_args(),
                                                                    *self.allocator_args)).start(timeout)
            self._convert_model()
            for i in range(self.num_workers):
                args = ["--allocator", self.allocator.target, "--pool-id", f"worker-{i}",
                        "--block-size", str(self.block_size), "--kv-memory", self.kv_memory,
                        "--heartbeat-interval", "1", "--torch-threads", str(self.torch_threads),
                        *self._server_args()]
                if self.model:
                    args += ["--model", self.model, "--model-seed", str(self.model_seed)]
                if self.num_blocks:
                    args += ["--num-blocks", str(self.num_blocks)]
                if self.roles:
                    args += ["--role", self.roles[i]]
                self.workers.append(WorkerProcess(*args, *self.worker_args,
                                                  env=self._client_env(f"worker-{i}")).start(wait=False))
            for w in self.workers:
                w.wait_ready(timeout)
            if self.http_port is not None:
                args = ["--api-key-file", f"{self.credentials_dir}/api-key"] if self.secure else []
                one = self.api_replicas == 1
                self.apis = [ApiProcess(self.target, *args, *self.api_args, env=self._client_env("api"),
                                        port=self.http_port if one else 0).start(wait=False)
                             for _ in range(self.api_replicas)]
                for api in self.apis:
                    api.wait_ready(timeout)
                self.api = self.apis[0]
                if not one:
                    from kvservice.api.front import RoundRobinFront
                    self.front = RoundRobinFront("127.0.0.1", self.http_port,
                                                 [f"127.0.0.1:{a.port}" for a in self.apis]).start()
        except BaseException:
            self.stop()
            raise
        return self

    def _convert_model(self) -> None:
        """A pretrained model is converted into the model cache once, before the workers
        start (by ``python -m worker.weights``, whose progress goes to stderr), so that
        they do not each convert it; a seeded preset needs nothing."""
        if not self.model:
            return
        out = subprocess.run([sys.executable, "-m", "worker.weights", "--if-pretrained", self.model], check=True,
                             stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        self.pretrained = bool(out.stdout.strip())

    def describe(self) -> list[str]:
        """One line per process: what it is and where it listens."""
        lines = [f"redis      {self.redis.where}" if self.redis else "redis      -"]
        if self.allocator:
            lines.append(f"allocator  {self.allocator.target} (pid {self.allocator.proc.pid}, "
                         f"metrics {self.allocator.metrics_url})")
        for w in self.workers:
            model = (f", model {self.model}" + ("" if self.pretrained else f" seed {self.model_seed}")
                     if self.model else "")
            lines.append(f"{w.pool_id or 'worker':<10} {w.target} (pid {w.proc.pid}{model}, metrics {w.metrics_url})")
        for api in self.apis:
            lines.append(f"api        {api.url} (pid {api.proc.pid}, model {api.model}, "
                         f"metrics http://127.0.0.1:{api.port}/metrics)")
        if self.front is not None:
            lines.append(f"front      {self.http_url} (round robin over the {len(self.apis)} API replicas)")
        if self.secure and self._creds_dir is not None:
            d = self.credentials_dir
            if self.api:
                lines.append(f"HTTP API key in {d}/api-key: export OPENAI_API_KEY=$(cat {d}/api-key) "
                             f"OPENAI_BASE_URL={self.http_url}")
            lines.append(f"TLS + auth credentials in {d}: a client presents the CA and a certificate, e.g.")
            lines.append(f"  export KVSERVICE_TLS_CA={d}/ca.pem KVSERVICE_CLIENT_CERT={d}/engine.pem "
                         f"KVSERVICE_CLIENT_KEY={d}/engine-key.pem   (tenant engine; admin.pem: admin)")
            lines.append(f"  more tenants: kvservice token add NAME --file {d}/tokens (then KVSERVICE_TOKEN)")
            lines.append(f"  Redis: the allocator's URL in {d}/redis-url, an admin's in {d}/redis-admin-url")
        return lines

    def stop(self) -> None:
        """Stops the API, the workers, the allocator and Redis (each only if it was started)."""
        if self.front is not None:
            self.front.stop()
            self.front = None
        for api in self.apis:
            api.stop()
        self.apis, self.api = [], None
        for w in self.workers:
            w.stop()
        self.workers = []
        if self.allocator is not None:
            self.allocator.stop()
            self.allocator = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._creds_dir is not None:
            self._creds_dir.cleanup()
            self._creds_dir = None

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
