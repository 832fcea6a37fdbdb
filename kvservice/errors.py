"""Domain exceptions shared by the allocator service and the client SDK.

Domain code raises these; one server interceptor turns them into gRPC status codes
(`kvservice.common.interceptor`), and the SDK turns status codes back into them, so a caller
catches `kvservice.errors.ResourceExhausted` whichever side it is on.
"""

from __future__ import annotations

import grpc


class KvsError(Exception):
    """Base class: every error the allocator reports on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, partial: object | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: For a step over several pools: the results of the pools that were applied
        #: before this one failed (a ``StepResponse``), else None.
        self.partial = partial
        #: Set by ``Client.step`` when ``partial`` is: the ``StepResult`` of the applied
        #: pools (copy-on-write pairs to apply, children and created sequences to keep).
        self.result: object | None = None


class NotFound(KvsError):
    """An unknown pool, lease or sequence."""

    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(KvsError):
    """Malformed input; nothing was changed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(KvsError):
    """A stale pool epoch, an expired or revoked lease, or a step out of order."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(KvsError):
    """A sequence named under a lease that does not own it."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(KvsError):
    """The allocator or its Redis cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(KvsError):
    """Not enough free + evictable blocks in a pool; nothing was changed.

    Attributes:
        pool_id: the pool that ran short.
        needed: blocks the request needed.
        available: blocks that were free or evictable.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, pool_id: str = "", needed: int = 0,
                 available: int = 0, partial: object | None = None) -> None:
        super().__init__(message, partial=partial)
        self.pool_id = pool_id
        self.needed = needed
        self.available = available



BY_CODE_NAME: dict[str, type[KvsError]] = {
    "NOT_FOUND": NotFound,
    "INVALID_ARGUMENT": InvalidArgument,
    "FAILED_PRECONDITION": FailedPrecondition,
    "PERMISSION_DENIED": PermissionDenied,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "UNAVAILABLE": Unavailable,
}

BY_STATUS: dict[grpc.StatusCode, type[KvsError]] = {cls.code: cls for cls in BY_CODE_NAME.values()}
