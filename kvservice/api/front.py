"""A round-robin front for several ``kvservice api`` replicas (``kvservice up --api-replicas
N``): one port that hands each new TCP connection to the next replica in turn and copies
bytes both ways, so that HTTP, streamed answers (server-sent events) and HTTPS pass
through unchanged (TLS ends at the replica). A replica that refuses the connection is
skipped for that connection; the client sees an error only when every replica refuses.
It runs on its own thread with its own event loop."""

from __future__ import annotations

import asyncio
import itertools
import logging
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
        self.backends = [(b.rsplit(":", 1)[0], int(b.rsplit(":", 1)[1])) for b in backends]
        self.connections = [0] * len(self.backends)      # handed to each backend so far
        self._turn = itertools.cycle(range(len(self.backends)))
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

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = None
        for _ in range(len(self.backends)):
            i = next(self._turn)
            try:
                upstream = await asyncio.wait_for(asyncio.open_connection(*self.backends[i]), 5)
                self.connections[i] += 1
                break
            except (OSError, asyncio.TimeoutError) as exc:
                log.warning("api replica %s:%d refused a connection (%s); trying the next", *self.backends[i], exc)
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
