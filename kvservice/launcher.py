"""Starts an allocator as a separate process (for the demo, the benchmark and tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class AllocatorProcess:
    """``python -m kvservice serve`` on a free port, stopped with SIGTERM on exit.

    Args:
        redis_url: the Redis to use; None starts an embedded one inside the process.
        args: more ``serve`` flags.
        env: extra environment variables.
    """

    def __init__(self, redis_url: str | None = None, *, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.redis_url = redis_url
        self.args = args
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.url = ""
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "AllocatorProcess":
        self._dir = tempfile.TemporaryDirectory(prefix="kvs-alloc-")
        port_file = Path(self._dir.name, "port")
        log = open(Path(self._dir.name, "log"), "wb")
        cmd = [sys.executable, "-m", "kvservice", "serve", "--port", "0", "--port-file", str(port_file),
               *self.args]
        if self.redis_url:
            cmd += ["--redis-url", self.redis_url]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **self.env})
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"allocator exited with {self.proc.returncode}:\n{self.log()}")
            if port_file.exists():
                port, url = port_file.read_text().split("\n")[:2]
                self.port, self.url = int(port), url
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"allocator did not start within {timeout}s:\n{self.log()}")

    def log(self) -> str:
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

    def __enter__(self) -> "AllocatorProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
