"""Subscribes to KV event publishers (vLLM instances, or kvservice's own) and keeps the
index (``kvservice.events.index``) from their batches.

Per instance: a SUB socket on its endpoint, its replay endpoint for gaps, and a monitor of
the connection. A batch numbered:

- ``last + 1``: applied;
- beyond ``last + 1`` (batches were dropped on the way, this ingester was down, or it
  joins a publisher that has published already: from 0): the missed ones are asked of the
  replay socket first; if it no longer has them all, the
  instance's entries are dropped (what they lack is unknown) and the batch applied;
- ``last`` or less: the publisher restarted (its numbers began again): the instance's
  entries are dropped, then the batch applied.

A dropped connection marks the instance suspect: lookups count none of its blocks until a
batch comes again (a restarted instance's cache is empty; one that only lost its
connection is trusted again when its next batch follows its last one)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvservice.events import wire
from kvservice.events.index import Applied, Index

_log = logging.getLogger(__name__)

REPLAY_TIMEOUT_MS = 2000


@dataclasses.dataclass(slots=True)
class Source:
    """One publisher: its name in the index, its PUB endpoint and its replay endpoint."""

    name: str
    endpoint: str
    replay_endpoint: str = ""

    @classmethod
    def parse(cls, text: str) -> "Source":
        """``NAME=tcp://host:port[,tcp://host:replay_port]``."""
        name, sep, rest = text.partition("=")
        endpoints = rest.split(",")
        if not sep or not name or not endpoints[0] or len(endpoints) > 2:
            raise ValueError(f"an instance is NAME=ENDPOINT[,REPLAY_ENDPOINT], got {text!r}")
        return cls(name, endpoints[0], endpoints[1] if len(endpoints) > 1 else "")


@dataclasses.dataclass(slots=True)
class Counters:
    batches: int = 0
    events: int = 0
    dropped: int = 0             # batches missed that the replay socket no longer had
    replays: int = 0             # replay requests sent
    restarts: int = 0            # publishers seen starting their numbers again
    bad: int = 0                 # payloads that were not KV event batches


class Ingester:
    """Keeps ``index`` from ``sources`` on a thread of its own (``start``/``stop``)."""

    def __init__(self, index: Index, sources: list[Source], *, on_batch: Callable[[str, Applied], None] | None = None
                 ) -> None:
        self.index = index
        self.sources = {s.name: s for s in sources}
        self.counters = {s.name: Counters() for s in sources}
        self._on_batch = on_batch
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: dict[str, int] = {}
        self._suspect: set[str] = set()

    def start(self) -> "Ingester":
        for s in self.sources.values():
            info = self.index.info(s.name)
            self._last[s.name] = info.get("last_seq", -1) if info else -1
            self.index.set_info(s.name, last_seq=self._last[s.name], suspect=int(bool(info.get("suspect", 0))))
        self._thread = threading.Thread(target=self._run, name="kvservice-ingest", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        subs: dict[zmq.Socket, str] = {}
        monitors: dict[zmq.Socket, str] = {}
        for s in self.sources.values():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 100_000)
            mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(s.endpoint)
            subs[sub] = s.name
            monitors[mon] = s.name
            poller.register(sub, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(200):
                if sock in monitors:
                    self._connection(monitors[sock], recv_monitor_message(sock))
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    self.counters[subs[sock]].bad += 1
                    continue
                self._batch(subs[sock], wire.seq_of(frames[1]), frames[2])
        for sock in [*subs, *monitors]:
            sock.close(linger=0)

    def _connection(self, name: str, event: dict) -> None:
        if event["event"] == zmq.EVENT_DISCONNECTED and name not in self._suspect:
            _log.info("kv events: %s disconnected: its blocks are not used until its next batch", name)
            self._suspect.add(name)
            self.index.set_info(name, suspect=1)

    def _batch(self, name: str, seq: int, payload: bytes) -> None:
        try:
            batch = wire.decode(payload)
        except wire.BadPayload as exc:
            self.counters[name].bad += 1
            _log.warning("kv events: %s sent a bad payload: %s", name, exc)
            return
        last = self._last[name]
        if last >= 0 and seq <= last:
            _log.info("kv events: %s numbers its batches from %d again (last %d): a restart; its blocks are dropped",
                      name, seq, last)
            self.counters[name].restarts += 1
            self.index.clear(name)
        elif seq > last + 1:            # (missed batches; or this ingester joined late: from 0)
            self._catch_up(name, last, seq)
        self._apply(name, seq, batch)

    def _catch_up(self, name: str, last: int, seq: int) -> None:
        """Batches last + 1 .. seq - 1 from the replay socket; the instance's entries
        dropped if it cannot give them all."""
        got: list[tuple[int, wire.Batch]] = []
        source = self.sources[name]
        if source.replay_endpoint:
            self.counters[name].replays += 1
            got = self._replay(name, source.replay_endpoint, last + 1, seq)
        if [s for s, _ in got] != list(range(last + 1, seq)):
            self.counters[name].dropped += seq - last - 1
            _log.warning("kv events: %s: batches %d..%d missed and not replayed: its blocks are dropped", name,
                         last + 1, seq - 1)
            self.index.clear(name)
            return
        for s, b in got:
            self._apply(name, s, b)

    def _replay(self, name: str, endpoint: str, first: int, stop: int) -> list[tuple[int, wire.Batch]]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        out = []
        try:
            sock.send_multipart((b"", wire.seq_bytes(first)))
            while sock.poll(REPLAY_TIMEOUT_MS):
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    break
                _, _, seq_frame, payload = frames
                s = wire.seq_of(seq_frame)
                if s < 0:
                    break
                if first <= s < stop:
                    try:
                        out.append((s, wire.decode(payload)))
                    except wire.BadPayload:
                        self.counters[name].bad += 1
        finally:
            sock.close()
        return out

    def _apply(self, name: str, seq: int, batch: wire.Batch) -> None:
        applied = self.index.apply(name, batch)
        block_size = next((e.block_size for e in batch.events if isinstance(e, wire.BlockStored)), 0)
        fields = {"last_seq": seq, "suspect": 0, "updated_ms": int(time.time() * 1000)}
        if block_size:
            fields["block_size"] = block_size
        self.index.set_info(name, **fields)
        self._last[name] = seq
        self._suspect.discard(name)
        self.counters[name].batches += 1
        self.counters[name].events += len(batch.events)
        if self._on_batch is not None:
            self._on_batch(name, applied)
