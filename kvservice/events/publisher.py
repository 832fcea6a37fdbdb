"""A KV event publisher in vLLM's protocol (``kvservice.events.wire``): a PUB socket for
the batches and a ROUTER socket that replays the last ``buffer`` batches from a sequence
number, as vLLM's ``ZmqEventPublisher`` does, so that vLLM's subscribers and ours read it.

Sequence numbers are one counter per publisher. ``first_seq`` lets a restarted publisher
go on where the previous one stopped (``kvservice events`` keeps the next one in Redis):
a subscriber never sees a number used twice for two different batches."""

from __future__ import annotations

import collections
import logging
import threading
import time

import zmq

from kvservice.events import wire

_log = logging.getLogger(__name__)


class Publisher:
    """Binds ``endpoint`` (PUB) and ``replay_endpoint`` (ROUTER; "" none) and publishes
    batches from a thread of its own.

    Args:
        endpoint, replay_endpoint: ZMQ endpoints to bind (``tcp://127.0.0.1:0``: a free
            port; ``bound`` and ``replay_bound`` tell which).
        buffer: batches kept for replay.
        first_seq: the first batch's number.
        on_replay: called for each replay request (metrics).
    """

    def __init__(self, endpoint: str, replay_endpoint: str = "", *, buffer: int = 10_000, first_seq: int = 0,
                 on_replay=None) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(endpoint)
        self.bound = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_bound = ""
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_bound = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: collections.deque[tuple[int, bytes, bytes]] = collections.deque(maxlen=buffer)
        self._queue: collections.deque[tuple[bytes, bytes, int | None]] = collections.deque()
        self._lock = threading.Lock()
        self._wake_send, self._wake_recv = self._ctx.socket(zmq.PAIR), self._ctx.socket(zmq.PAIR)
        addr = f"inproc://kvs-events-{id(self)}"
        self._wake_recv.bind(addr)
        self._wake_send.connect(addr)
        self.next_seq = first_seq
        self.published = 0
        self._on_replay = on_replay
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvservice-events-pub", daemon=True)
        self._thread.start()

    def publish(self, topic: str, batch: wire.Batch, *, seq: int | None = None) -> None:
        """Queues ``batch`` under ``topic``: numbered ``seq`` (above every number sent so
        far; ``kvservice events`` takes them from Redis), or the next number."""
        payload = wire.encode(batch)
        with self._lock:
            self._queue.append((topic.encode(), payload, seq))
            if len(self._queue) == 1:       # (one wake-up per batch of the queue, never blocking)
                try:
                    self._wake_send.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass                    # (a wake-up is pending already)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop:
            ready = dict(poller.poll(200))
            if self._wake_recv in ready:
                while self._wake_recv.poll(0):
                    self._wake_recv.recv()
            while True:
                with self._lock:
                    if not self._queue:
                        break
                    topic, payload, given = self._queue.popleft()
                seq = self.next_seq if given is None else given
                self.next_seq = seq + 1
                self._pub.send_multipart((topic, wire.seq_bytes(seq), payload))
                self._buffer.append((seq, topic, payload))
                self.published += 1
            if self._replay is not None and self._replay in ready:
                self._serve_replay()

    def _serve_replay(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                _log.warning("kv events: a replay request of %d frames (3 expected) ignored", len(frames))
                continue
            client, _, start = frames
            first = wire.seq_of(start)
            if self._on_replay is not None:
                self._on_replay()
            for seq, topic, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", topic, wire.seq_bytes(seq), payload))
            self._replay.send_multipart((client, b"", b"", wire.END_SEQ, b""))

    def flush(self, timeout: float = 5.0) -> None:
        """Until every queued batch is sent."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue:
                    return
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self._stop = True
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)
