"""The one place where domain errors become gRPC statuses.

Servicers never build status codes: they raise ``kvservice.errors`` exceptions (or let
redis-py's connection errors through) and this interceptor aborts the call with the
matching code, a message that says what was wrong, and ``google.rpc.Status`` details:
``ErrorInfo`` always, ``QuotaFailure`` for RESOURCE_EXHAUSTED, and the partial
``StepResponse`` of a step whose pools did not all succeed.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvservice import errors

log = logging.getLogger(__name__)
DOMAIN = "kvservice"
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionError)

#: Turns an error's ``partial`` (a domain StepOutcome) into a proto message; set by the servicer.
PartialEncoder = Callable[[Any], Any]


def status_of(exc: errors.KvsError, encode_partial: PartialEncoder | None = None) -> status_pb2.Status:
    code = exc.code.value[0]
    info = error_details_pb2.ErrorInfo(reason=type(exc).__name__.upper(), domain=DOMAIN)
    details = []
    if isinstance(exc, errors.ResourceExhausted):
        info.reason = "BLOCKS_EXHAUSTED"
        info.metadata.update({"pool_id": exc.pool_id, "needed": str(exc.needed),
                              "available": str(exc.available)})
        quota = error_details_pb2.QuotaFailure(violations=[error_details_pb2.QuotaFailure.Violation(
            subject=f"pool/{exc.pool_id}", description=exc.message)])
        details.append(quota)
    details.insert(0, info)
    if exc.partial is not None and encode_partial is not None:
        details.append(encode_partial(exc.partial))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    return status_pb2.Status(code=code, message=exc.message, details=packed)


class UnaryInterceptor(grpc.aio.ServerInterceptor):
    """Base of the server's interceptors: ``wrap(inner, method)`` wraps every unary handler."""

    def wrap(self, inner: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
        raise NotImplementedError

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self.wrap(handler.unary_unary, handler_call_details.method),
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class ErrorInterceptor(UnaryInterceptor):
    """Maps ``KvsError`` and Redis connection failures onto gRPC statuses."""

    def __init__(self, encode_partial: PartialEncoder | None = None) -> None:
        self.encode_partial = encode_partial

    def wrap(self, inner: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
        encode = self.encode_partial

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await inner(request, context)
            except errors.KvsError as exc:
                status = rpc_status.to_status(status_of(exc, encode))
                await context.abort(status.code, status.details, status.trailing_metadata)
            except REDIS_DOWN as exc:
                log.warning("%s: Redis unreachable: %s", method, exc)
                status = rpc_status.to_status(status_pb2.Status(
                    code=code_pb2.UNAVAILABLE, message=f"the allocator's Redis is unreachable: {exc}"))
                await context.abort(status.code, status.details, status.trailing_metadata)

        return guarded
