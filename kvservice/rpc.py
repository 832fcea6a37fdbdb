"""The SDK's side of the RPCs: a failed call as a ``kvservice.errors`` exception (with
its status details), which failures are sent again, request ids, and the lease's fence.
"""

from __future__ import annotations

import uuid

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvservice import errors
from kvservice.v1 import allocator_pb2 as pb


def to_domain_error(exc: grpc.RpcError) -> errors.KvsError:
    """The ``kvservice.errors`` exception for any failed call, with its status details
    (``KvsError`` with the call's ``code`` for a status the service does not send on
    purpose; details that cannot be read are left out, never raised)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    cls = errors.BY_STATUS.get(code, errors.KvsError)
    message = (exc.details() if hasattr(exc, "details") else "") or str(code)
    info = error_details_pb2.ErrorInfo()
    partial = None
    try:
        status = rpc_status.from_call(exc) if hasattr(exc, "trailing_metadata") else None
    except Exception:  # noqa: BLE001 - a malformed or mismatched status: keep code and message
        status = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                detail.Unpack(info)
            elif detail.Is(pb.StepResponse.DESCRIPTOR):
                partial = pb.StepResponse()
                detail.Unpack(partial)
    reason = info.reason or None
    meta = info.metadata
    if reason == "LEASE_EXPIRED":
        cls = errors.LeaseExpired
    if reason == "ROLLED_BACK":
        return errors.RolledBack(message, pool_id=meta.get("pool_id", ""), generation=_int(meta.get("generation")),
                                 partial=partial)
    if cls is errors.ResourceExhausted:
        err: errors.KvsError = errors.ResourceExhausted(
            message, pool_id=meta.get("pool_id", ""), needed=_int(meta.get("needed")),
            available=_int(meta.get("available")), partial=partial, reason=reason, quota=meta.get("quota", ""),
            limit=_int(meta.get("limit")))
    else:
        err = cls(message, partial=partial, reason=reason)
        if cls is errors.KvsError:
            err.code = code
    return err


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0


#: Failures ``Client._call`` sends again (beside the channel policy's UNAVAILABLE).
RESENT = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def fence_seconds(ttl: float) -> float:
    """How long after a keep-alive was sent the lease is surely still alive: the TTL minus
    a margin (a tenth of it, at least 50 ms) for clock drift and the reply's way back."""
    return ttl - max(0.05, ttl / 10)


def new_request_id() -> str:
    """A fresh request id (a retry of the same call reuses its own)."""
    return uuid.uuid4().hex
