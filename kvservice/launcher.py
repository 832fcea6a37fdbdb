"""Starts services as separate processes (for the demo, the benchmark and tests).

``AllocatorProcess`` runs ``python -m kvservice serve``; ``WorkerProcess`` runs
``python -m worker`` (by module name: nothing here imports the worker, torch or CuPy).
Each binds port 0 (or a given port), reports its port through a file, and is stopped with SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class ServiceProcess:
    """A child process that writes ``<port>\\n<extra>\\n`` to ``--port-file`` once serving.

    Args:
        command: the module and its arguments, after ``python -m``.
        env: extra environment variables.
    """

    name = "service"

    def __init__(self, command: list[str], *, env: dict[str, str] | None = None, port: int = 0) -> None:
        self.command = command
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.port = port
        self.extra = ""
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> "ServiceProcess":
        """Spawns the process and (with ``wait``) waits until it serves."""
        self._dir = tempfile.TemporaryDirectory(prefix=f"kvs-{self.name}-")
        log = open(Path(self._dir.name, "log"), "wb")
        cmd = [sys.executable, "-m", *self.command, "--port", str(self.port),
               "--port-file", str(Path(self._dir.name, "port"))]
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
                port, extra = port_file.read_text().split("\n")[:2]
                self.port, self.extra = int(port), extra
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
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
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
        if redis_url:
            command += ["--redis-url", redis_url]
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
