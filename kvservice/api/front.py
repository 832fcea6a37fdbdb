"""A round-robin front for several ``kvservice api`` replicas (``kvservice up --api-replicas
N``, ``kvservice front``): one port that hands each new TCP connection to the next replica
in turn and copies bytes both ways, so that HTTP, streamed answers (server-sent events) and
HTTPS pass through unchanged (TLS ends at the replica). A backend is ``host:port``; a host
name is resolved at each connection and each of its addresses is a replica (a compose
service with several replicas behind one network name). A replica that refuses the
connection is skipped for that connection; the client sees an error only when every
replica refuses. It runs on its own thread with its own event loop."""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading

log = logging.getLogger("kvservice.front")

CHUNK = 64 * 1024


class RoundRobinFront:
    """Listens on ``host:port`` (0: a free port, ``port`` once started) and spreads
    connections over ``backends`` (``host:port`` each) in turn."""

    def __init__(self, host: str, port: int, backends: list[str]) -> None:
        if not backends:
            raise ValueError("a front needs at least one backend")
        self.host, self.port = host, port
        self.backends = []
        for b in backends:
            name, _, num = b.rpartition(":")
            if not name or not num.isdigit():
                raise ValueError(f"a backend is host:port, got {b!r}")
            self.backends.append((name, int(num)))
        #: Connections handed to each replica so far, by ``address:port``.
        self.connections: collections.Counter[str] = collections.Counter()
        self._turn = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> "RoundRobinFront":
        self._thread = threading.Thread(target=self._run, name="kvservice-front", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError(f"the front could not listen on {self.host}:{self.port}: {self._error}")
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, self.host, self.port))
            self.port = self._server.sockets[0].getsockname()[1]
        except OSError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    async def _replicas(self) -> list[tuple[str, int]]:
        """Every backend's addresses, resolved now (a name that does not resolve is left out)."""
        loop = asyncio.get_running_loop()
        out: list[tuple[str, int]] = []
        for name, port in self.backends:
            try:
                infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("api replica %s:%d does not resolve (%s)", name, port, exc)
                continue
            for addr in sorted({info[4][0] for info in infos}):
                out.append((addr, port))
        return out

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = None
        replicas = await self._replicas()
        turn, self._turn = self._turn, self._turn + 1
        for k in range(len(replicas)):
            addr, port = replicas[(turn + k) % len(replicas)]
            try:
                upstream = await asyncio.wait_for(asyncio.open_connection(addr, port), 5)
                self.connections[f"{addr}:{port}"] += 1
                break
            except (OSError, asyncio.TimeoutError) as exc:
                log.warning("api replica %s:%d refused a connection (%s); trying the next", addr, port, exc)
        if upstream is None:
            writer.close()
            return
        up_reader, up_writer = upstream
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            writer.close()
            up_writer.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        async def _close() -> None:       # (open connections are cut)
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()
        asyncio.run_coroutine_threadsafe(_close(), loop)
        if self._thread is not None:
            self._thread.join(5)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copies ``src`` into ``dst`` until ``src`` ends, then ends ``dst``'s write side (a
    broken connection closes it: the other direction ends too)."""
    try:
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError):
        dst.close()
