"""The one place where domain errors become gRPC statuses.

Servicers never build status codes: they raise ``kvservice.errors`` exceptions (or let
redis-py's connection errors through) and this interceptor aborts the call with the
matching code, a message that says what was wrong, and ``google.rpc.Status`` details:
``ErrorInfo`` always (its ``reason`` is the error's, UPPER_SNAKE_CASE), ``QuotaFailure``
for RESOURCE_EXHAUSTED, and the partial ``StepResponse`` of a step whose pools did not
all succeed.

It also decodes the request itself: a body that is not the method's message answers
INVALID_ARGUMENT with a one-line warning at most every few seconds (gRPC's own decoder
logs a traceback per call and answers UNKNOWN).
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvservice import errors
from kvservice.common.redis_errors import REDIS_DOWN

log = logging.getLogger(__name__)
DOMAIN = "kvservice"


#: Turns an error's ``partial`` (a domain StepOutcome) into a proto message; set by the servicer.
PartialEncoder = Callable[[Any], Any]


def status_of(exc: errors.KvsError, encode_partial: PartialEncoder | None = None) -> status_pb2.Status:
    code = exc.code.value[0]
    info = error_details_pb2.ErrorInfo(reason=exc.reason, domain=DOMAIN)
    details = []
    if isinstance(exc, errors.ResourceExhausted):
        info.metadata.update({"pool_id": exc.pool_id, "needed": str(exc.needed),
                              "available": str(exc.available)})
        if exc.quota:
            info.metadata.update({"quota": exc.quota, "limit": str(exc.limit)})
        subject = f"quota/{exc.quota}" if exc.quota else f"pool/{exc.pool_id}"
        quota = error_details_pb2.QuotaFailure(violations=[error_details_pb2.QuotaFailure.Violation(
            subject=subject, description=exc.message)])
        details.append(quota)
    elif isinstance(exc, errors.RolledBack):
        info.metadata.update({"pool_id": exc.pool_id, "generation": str(exc.generation)})
    details.insert(0, info)
    if exc.partial is not None and encode_partial is not None:
        details.append(encode_partial(exc.partial))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    return status_pb2.Status(code=code, message=exc.message, details=packed)


class RateLimitedLog:
    """Logs at most one line per ``interval`` seconds; says how many were held back."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last = -float("inf")
        self._held = 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more like it in the last {now - self._last:.0f} s)"
        self._last, self._held = now, 0
        self.logger.warning(message, *args)


class UnaryInterceptor(grpc.aio.ServerInterceptor):
    """Base of the server's interceptors: ``wrap(inner, method)`` wraps every unary handler
    and every client-streaming one (``inner(request_iterator, context)`` is awaited for the
    one reply just the same), ``wrap_stream(inner, method)`` every server-streaming one
    (unwrapped unless a subclass says otherwise); bidirectional streams pass as they are."""

    def wrap(self, inner: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
        raise NotImplementedError

    def wrap_stream(self, inner: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
        return inner

    def handler(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            self.wrap(handler.unary_unary, method),
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    def client_stream_handler(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return grpc.stream_unary_rpc_method_handler(
            self.wrap(handler.stream_unary, method),
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self.wrap_stream(handler.unary_stream, handler_call_details.method),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.stream_unary is not None:
            return self.client_stream_handler(handler, handler_call_details.method)
        if handler.unary_unary is None:
            return handler
        return self.handler(handler, handler_call_details.method)


class ErrorInterceptor(UnaryInterceptor):
    """Maps ``KvsError``, undecodable requests and Redis connection failures onto gRPC
    statuses. It must be the innermost interceptor (last in the server's list): it takes
    the request's bytes and decodes them itself."""

    def __init__(self, encode_partial: PartialEncoder | None = None) -> None:
        self.encode_partial = encode_partial
        self.undecodable = RateLimitedLog(log)

    def handler(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        guarded = self.wrap(handler.unary_unary, method)
        decode = self._decoder(handler.request_deserializer, method)

        async def decoded(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                request = decode(raw)
            except errors.InvalidArgument as exc:
                await abort(context, exc)
            return await guarded(request, context)

        return grpc.unary_unary_rpc_method_handler(decoded, request_deserializer=None,
                                                   response_serializer=handler.response_serializer)

    def client_stream_handler(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        guarded = self.wrap(handler.stream_unary, method)
        decode = self._decoder(handler.request_deserializer, method)

        async def decoded(raws: AsyncIterator[bytes]) -> AsyncIterator[Any]:
            async for raw in raws:
                yield decode(raw)       # (an undecodable message: InvalidArgument, raised to the servicer)

        async def call(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            return await guarded(decoded(raws), context)

        return grpc.stream_unary_rpc_method_handler(call, request_deserializer=None,
                                                    response_serializer=handler.response_serializer)

    def _decoder(self, deserialize: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any]:
        """The method's request decoder: raises InvalidArgument (logged, rate-limited) for a
        body that is not its message."""
        undecodable = self.undecodable

        def decode(raw: bytes) -> Any:
            try:
                return deserialize(raw) if deserialize is not None else raw
            except Exception as exc:  # noqa: BLE001 - any decoding failure is the caller's
                undecodable.warning("%s: undecodable request of %d bytes: %s", method, len(raw),
                                    str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
                raise errors.InvalidArgument(f"the request body is not a valid {method.rsplit('/', 1)[-1]} "
                                             f"request message ({len(raw)} bytes)") from None

        return decode

    def wrap(self, inner: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
        encode = self.encode_partial

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await inner(request, context)
            except errors.KvsError as exc:
                await abort(context, exc, encode)
            except REDIS_DOWN as exc:
                log.warning("%s: Redis unreachable: %s", method, exc)
                await abort(context, errors.Unavailable(f"the allocator's Redis is unreachable: {exc}"))

        return guarded

    def wrap_stream(self, inner: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for message in inner(request, context):
                    yield message
            except errors.KvsError as exc:
                await abort(context, exc)

        return guarded


async def abort(context: grpc.aio.ServicerContext, exc: errors.KvsError,
                 encode_partial: PartialEncoder | None = None) -> None:
    status = rpc_status.to_status(status_of(exc, encode_partial))
    await context.abort(status.code, status.details, status.trailing_metadata)
