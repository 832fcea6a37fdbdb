"""Domain exceptions shared by the allocator service and the client SDK.

Domain code raises these; one server interceptor turns them into gRPC status codes
(``kvservice.common.interceptor``), and the SDK turns every status code back into one of
them (``KvsError`` for codes the service never sends on purpose), so a caller catches
``kvservice.errors.ResourceExhausted`` whichever side it is on.

Each error carries a ``reason``: the ``google.rpc.ErrorInfo`` reason (UPPER_SNAKE_CASE,
domain ``kvservice``) that the status details carry, finer than the status code:

=====================  ===================  =================================================
reason                 status               meaning
=====================  ===================  =================================================
NOT_FOUND              NOT_FOUND            unknown pool, lease or sequence
SEQUENCE_LOST          NOT_FOUND            (SDK) a sequence lost in a resync (recompute it)
INVALID_ARGUMENT       INVALID_ARGUMENT     malformed input; nothing changed
FAILED_PRECONDITION    FAILED_PRECONDITION  a call out of order (e.g. an append into a
                                            shared block without a step)
LEASE_EXPIRED          FAILED_PRECONDITION  the lease expired or was revoked
EPOCH_CHANGED          FAILED_PRECONDITION  the pool was re-registered since (new epoch)
ROLLED_BACK            FAILED_PRECONDITION  the pool's generation is not the caller's: its
                                            state may have rolled back (resync first)
PERMISSION_DENIED      PERMISSION_DENIED    a sequence of another lease; a lease of another
                                            tenant; a call the caller's role may not make
UNAUTHENTICATED        UNAUTHENTICATED      no credentials, or credentials the server does not
                                            know
BLOCKS_EXHAUSTED       RESOURCE_EXHAUSTED   not enough free + evictable blocks in a pool
QUOTA_EXCEEDED         RESOURCE_EXHAUSTED   the call would take the tenant past a quota
                                            (docs/security.md)
UNAVAILABLE            UNAVAILABLE          the allocator (or its Redis) cannot be reached
DEADLINE_EXCEEDED      DEADLINE_EXCEEDED    the call's deadline passed
INTERNAL               any other code       a failure the service did not report on purpose
=====================  ===================  =================================================
"""

from __future__ import annotations

import grpc


class KvsError(Exception):
    """Base class: every error the allocator reports on purpose (and, in the SDK, any
    failed call: ``code`` says which status it had)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "INTERNAL"

    def __init__(self, message: str, *, partial: object | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason:
            self.reason = reason
        #: For a step over several pools: the results of the pools that were applied
        #: before this one failed (a ``StepResponse``), else None.
        self.partial = partial
        #: Set by ``Client.step`` when ``partial`` is: the ``StepResult`` of the applied
        #: pools (copy-on-write pairs to apply, children and created sequences to keep).
        self.result: object | None = None


class NotFound(KvsError):
    """An unknown pool, lease or sequence."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class SequenceLost(NotFound):
    """(SDK) A sequence the allocator could not keep when it resynchronised with this
    client after losing writes: its blocks may be another lease's now. Recompute it, as
    after a preemption (``Client.lost_sequences()`` lists them)."""

    reason = "SEQUENCE_LOST"


class InvalidArgument(KvsError):
    """Malformed input; nothing was changed."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class FailedPrecondition(KvsError):
    """A stale pool epoch (reason EPOCH_CHANGED), an expired or revoked lease (reason
    LEASE_EXPIRED), or a step out of order."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class LeaseExpired(FailedPrecondition):
    """The lease expired or was revoked; its sequences are gone. The SDK also raises it,
    before any change (local ones included), once its lease may have expired: no
    successful keep-alive for the TTL minus a margin, on its own monotonic clock."""

    reason = "LEASE_EXPIRED"


class RolledBack(FailedPrecondition):
    """The pool's generation is not the one the caller sent: the Redis serving it restarted
    or failed over since, so its state may have rolled back. Nothing was changed; the
    caller resynchronises its state in the pool first (the SDK does it by itself).

    Attributes:
        pool_id: the pool ("" when unknown).
        generation: the pool's generation now (0 when unknown).
    """

    reason = "ROLLED_BACK"

    def __init__(self, message: str, *, pool_id: str = "", generation: int = 0, partial: object | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message, partial=partial, reason=reason)
        self.pool_id = pool_id
        self.generation = generation


class PermissionDenied(KvsError):
    """A sequence named under a lease that does not own it, a lease of another tenant, or
    a call that the caller's role may not make (docs/security.md)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class Unauthenticated(KvsError):
    """The call carried no credentials, or credentials that the server does not know (an
    unknown or revoked token, a client certificate it does not trust)."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class Unavailable(KvsError):
    """The allocator or its Redis cannot be reached (retry with the same request id)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"


class DeadlineExceeded(KvsError):
    """The call's deadline passed before the allocator answered."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"


class ResourceExhausted(KvsError):
    """Not enough free + evictable blocks in a pool, or a tenant's quota reached (reason
    QUOTA_EXCEEDED); nothing was changed.

    Attributes:
        pool_id: the pool that ran short ("" for the lease quota).
        needed: blocks (or sequences, leases) the request needed.
        available: blocks that were free or evictable (or what the quota had left).
        quota: the quota reached ("blocks", "sequences", "leases"), or "".
        limit: that quota's limit.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "BLOCKS_EXHAUSTED"

    def __init__(self, message: str, *, pool_id: str = "", needed: int = 0, available: int = 0,
                 partial: object | None = None, reason: str | None = None, quota: str = "",
                 limit: int = 0) -> None:
        super().__init__(message, partial=partial, reason=reason or ("QUOTA_EXCEEDED" if quota else None))
        self.pool_id = pool_id
        self.needed = needed
        self.available = available
        self.quota = quota
        self.limit = limit


BY_CODE_NAME: dict[str, type[KvsError]] = {
    "NOT_FOUND": NotFound,
    "INVALID_ARGUMENT": InvalidArgument,
    "FAILED_PRECONDITION": FailedPrecondition,
    "PERMISSION_DENIED": PermissionDenied,
    "UNAUTHENTICATED": Unauthenticated,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
}

BY_STATUS: dict[grpc.StatusCode, type[KvsError]] = {cls.code: cls for cls in BY_CODE_NAME.values()}

#: Every ErrorInfo reason the service sends (documented in docs/allocator.md).
REASONS = ("NOT_FOUND", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "LEASE_EXPIRED", "EPOCH_CHANGED", "ROLLED_BACK",
           "PERMISSION_DENIED", "UNAUTHENTICATED", "BLOCKS_EXHAUSTED", "QUOTA_EXCEEDED", "RESYNC_IN_PROGRESS", "RESYNC_SUPERSEDED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL")
