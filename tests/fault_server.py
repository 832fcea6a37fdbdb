"""A real allocator server with faults injected around its handlers, per lease: replies
dropped after the call was applied, and partitions (for the local-mode state machine).
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from kvservice.allocator.server import SERVICE_NAME
from kvservice.v1 import allocator_pb2 as pb

from helpers import TEST_SETTINGS, ServerThread


class Faults(grpc.aio.ServerInterceptor):
    """Test faults around the allocator's handlers, per lease: ``drop(method, lease, n)``
    lets the next ``n`` calls of ``method`` run and then answers UNAVAILABLE instead of
    their replies; ``partition(lease)`` refuses every call of the lease (UNAVAILABLE)
    before its handler until ``heal(lease)``; ``fail(method, lease, n, code)`` answers the
    next ``n`` calls of ``method`` with ``code`` without running them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drops: dict[tuple[str, str], int] = {}
        self._cut: set[str] = set()
        self._fails: dict[tuple[str, str], tuple[int, grpc.StatusCode]] = {}
        self.dropped = 0

    def reset(self) -> None:
        with self._lock:
            self._drops.clear()
            self._cut.clear()
            self._fails.clear()

    def drop(self, method: str, lease: str, n: int) -> None:
        with self._lock:
            self._drops[(method, lease)] = n

    def pending_drops(self, method: str, lease: str) -> int:
        with self._lock:
            return self._drops.get((method, lease), 0)

    def fail(self, method: str, lease: str, n: int, code: grpc.StatusCode) -> None:
        with self._lock:
            self._fails[(method, lease)] = (n, code)

    def pending_fails(self, method: str, lease: str) -> int:
        with self._lock:
            return self._fails.get((method, lease), (0, None))[0]

    def partition(self, lease: str) -> None:
        with self._lock:
            self._cut.add(lease)

    def heal(self, lease: str) -> None:
        with self._lock:
            self._cut.discard(lease)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        inner = handler.unary_unary
        message = getattr(pb, f"{method}Request", None)   # (the error interceptor decodes the bytes)

        async def faulty(request, context):
            lease = _lease_of(message, request)
            with self._lock:
                cut = lease in self._cut
                left, code = self._fails.get((method, lease), (0, None))
                if left:
                    self._fails[(method, lease)] = (left - 1, code)
            if cut:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "partitioned (test)")
            if left:
                await context.abort(code, "an unexpected failure (test)")
            reply = await inner(request, context)
            with self._lock:
                n = self._drops.get((method, lease), 0)
                if n:
                    self._drops[(method, lease)] = n - 1
                    self.dropped += 1
            if n:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the reply was lost (test)")
            return reply

        return grpc.unary_unary_rpc_method_handler(faulty, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def _lease_of(message, request) -> str:
    """The lease id of a request (raw bytes, or a decoded message), or ''."""
    if isinstance(request, bytes) and message is not None:
        try:
            request = message.FromString(request)
        except Exception:  # noqa: BLE001 - undecodable: the error interceptor answers it
            return ""
    return getattr(request, "lease_id", "")


class FaultyServer(ServerThread):
    """``ServerThread`` (reaper on) with ``Faults`` outside the error interceptor."""

    def __init__(self, redis_url: str, settings) -> None:
        faults = Faults()
        super().__init__(redis_url, settings, interceptors=(faults,))
        self.faults = faults


class DropReply(grpc.aio.ServerInterceptor):
    """Lets ``method``'s handler run, then loses its reply once ``armed`` (every time while
    armed, with ``every``): answers UNAVAILABLE instead, or with ``hang`` seconds, holds the
    reply until the caller's deadline has passed (DEADLINE_EXCEEDED on its side). Counts the
    calls that reached the handler."""

    def __init__(self, method: str, *, every: bool = False, hang: float = 0.0) -> None:
        self.method = f"/{SERVICE_NAME}/{method}"
        self.every = every
        self.hang = hang
        self.armed = False
        self.dropped = 0
        self.handled = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != self.method:
            return handler
        inner = handler.unary_unary

        async def run_then_drop(request, context):
            reply = await inner(request, context)
            self.handled += 1
            if self.armed:
                self.armed = self.every
                self.dropped += 1
                if self.hang:
                    await asyncio.sleep(self.hang)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the reply was lost (test)")
            return reply

        return grpc.unary_unary_rpc_method_handler(run_then_drop, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


class DroppingServer(ServerThread):
    """An allocator server with ``DropReply`` outside its error interceptor (no reaper)."""

    def __init__(self, redis_url: str, dropper: DropReply) -> None:
        super().__init__(redis_url, TEST_SETTINGS.replace(reserve_min_blocks=4), reap=False, interceptors=(dropper,))
        self.dropper = dropper
