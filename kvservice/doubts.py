"""Steps in doubt: a Step whose answer never came may have been applied.

``Client._call`` sends a call with a request id again, unchanged, for as long as the retry
budget lasts (gRPC's retry policy for UNAVAILABLE, the client for a deadline that ran
out). A Step that fails all the same (``Unavailable``, ``DeadlineExceeded``) is *in
doubt*: the allocator may have applied it, and answers a resend under its request id with
that first outcome (or applies it then, once). So the client keeps it, keyed by what it
asks (every field but the request id):

- the caller's next step, when it is the same step (the same sequences at the same
  lengths, the same tokens, forks, frees and prompts: the caller retrying), is sent under
  the same request id: it returns what the first attempt made, and nothing is done twice;
- any other call first *settles* it: it is sent again under its request id (so that a
  late delivery of the first attempt can no longer apply it), the sequences its creates
  made are freed, and the pools of its updates are resynchronised, which makes the
  allocator's view of them the client's again (the client never applied it);
- the keep-alive thread settles a step that only creates once it has been in doubt for
  the retry budget (its sequences would be orphans until the lease ends).

``Doubts`` is the part of ``kvservice.client.Client`` that does it (its state: the
client's ``_doubts`` and ``_doubt_lock``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from kvservice import errors
from kvservice.rpc import new_request_id, to_domain_error
from kvservice.v1 import allocator_pb2 as pb


@dataclass(slots=True)
class Doubt:
    """A Step sent without an answer (its ``sync`` left out: a Sync settles on its own)."""

    request: pb.StepRequest
    since: float

    @property
    def creates_only(self) -> bool:
        return not self.request.updates


def step_key(request: pb.StepRequest) -> bytes:
    """What a Step asks, whatever its request id and the Sync it carries."""
    probe = pb.StepRequest()
    probe.CopyFrom(request)
    probe.request_id = ""
    probe.ClearField("sync")
    return probe.SerializeToString(deterministic=True)


class Doubts:
    """Steps in doubt, retried or settled (mixed into ``Client``)."""

    def _request_id_for(self, key: bytes) -> str:
        """The request id for a Step that asks ``key``: the one it was sent under before if
        it is in doubt (the caller retries it), else a new one. Every other step in doubt
        is settled first."""
        with self._doubt_lock:
            doubt = self._doubts.pop(key, None)
            others = bool(self._doubts)
        if others:
            self._settle_doubts()
        return doubt.request.request_id if doubt is not None else new_request_id()

    def _doubt(self, key: bytes, request: pb.StepRequest) -> None:
        """A Step that failed without an answer: in doubt until retried or settled."""
        kept = pb.StepRequest()
        kept.CopyFrom(request)
        kept.ClearField("sync")
        with self._doubt_lock:
            self._doubts[key] = Doubt(kept, time.monotonic())

    def _settle_doubts(self, *, background: bool = False) -> None:
        """Settles the steps in doubt (``background``: only those that create, and nothing
        else, in doubt for the retry budget). Raises Unavailable when one still gets no
        answer (it stays in doubt; no change is made meanwhile)."""
        now = time.monotonic()
        with self._doubt_lock:
            taken = {k: d for k, d in self._doubts.items()
                     if not background or (d.creates_only and now - d.since >= self.retry_budget)}
            for k in taken:
                del self._doubts[k]
        unsettled = {}
        for key, doubt in taken.items():
            try:
                self._settle(doubt.request)
            except (errors.Unavailable, errors.DeadlineExceeded):
                unsettled[key] = doubt
        if unsettled:
            with self._doubt_lock:
                for key, doubt in unsettled.items():
                    self._doubts.setdefault(key, doubt)
            if not background:
                raise errors.Unavailable(f"{len(unsettled)} step(s) sent without an answer could not be settled "
                                         "(the allocator is unreachable); nothing else is changed until they are")

    def _settle(self, request: pb.StepRequest) -> None:
        """One step in doubt: sent again under its request id (one attempt: an answer, a
        refusal, or Unavailable / DeadlineExceeded raised), what its creates made freed,
        the pools of its updates resynchronised."""
        try:
            reply = self.stub.Step(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            err = to_domain_error(exc)
            if isinstance(err, (errors.Unavailable, errors.DeadlineExceeded)):
                raise err from None
            reply = err.partial        # (refused: only a step over several pools made anything)
            if reply is None:
                if request.updates and isinstance(err, errors.RolledBack):
                    self._resync_pools({u.sequence_id.split("/", 1)[0] for u in request.updates})
                return
        pools = {u.sequence_id.split("/", 1)[0] for u in request.updates}
        if pools:
            self._resync_pools(pools)      # (what it made there, creates too, is dropped)
        made = [c.sequence_id for c in reply.created if c.sequence_id and c.pool_id not in pools]
        if made:
            try:
                self.stub.FreeSequences(pb.FreeSequencesRequest(lease_id=self.lease_id, request_id=new_request_id(),
                                                                sequence_ids=made), timeout=self.timeout)
            except grpc.RpcError:
                pass     # (the lease's end frees them)
