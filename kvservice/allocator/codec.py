"""The scripts' codec, Python side: msgpack arguments and replies (``cmsgpack`` in the
scripts, ``scripts/lib/codec.lua``), with the project's vocabulary as field names.

One encoder (``encode``) for arguments, one decoder (``decode_reply``) for replies. A
reply is a map; an error reply is ``{error: <gRPC code name>, message, reason?, ...}``,
raised here as the matching ``kvservice.errors`` exception (or as ``ScriptError`` for the
internal codes that the allocator handles itself).
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvservice import errors

#: Internal codes of the step script, handled by the allocator (never seen by a client):
#: the pool's epoch moved on since the allocator read it; the lease is unknown to the pool.
STALE_EPOCH = "STALE_EPOCH"
LEASE_UNKNOWN = "LEASE_UNKNOWN"
#: The step is more than one call's work (the allocator carries it out in parts:
#: ``runs.py``); a run's part needs more blocks than it was admitted and the pool has.
TOO_BIG = "TOO_BIG"
RUN_SHORT = "RUN_SHORT"


class ScriptError(Exception):
    """An internal script code that the caller is expected to handle."""

    def __init__(self, code: str, reply: dict[str, Any]) -> None:
        super().__init__(reply.get("message", code))
        self.code = code
        self.reply = reply


def encode(payload: Any) -> bytes:
    """A script's arguments (``ARGV[1]``), or any value to fingerprint, as msgpack."""
    return msgpack.packb(payload, use_bin_type=True)


def decode(raw: bytes) -> Any:
    """Any msgpack value the scripts store or return."""
    return msgpack.unpackb(raw, raw=False)


def decode_reply(raw: bytes, *, internal: tuple[str, ...] = ()) -> dict[str, Any]:
    """A script's reply; raises the matching domain error for an error reply."""
    reply = decode(raw)
    code = reply.get("error")
    if code is None:
        return reply
    if code in internal:
        raise ScriptError(code, reply)
    message = reply["message"]
    if code == "RESOURCE_EXHAUSTED":
        raise errors.ResourceExhausted(message, needed=int(reply.get("needed", 0)),
                                       available=int(reply.get("available", 0)), reason=reply.get("reason"),
                                       quota=reply.get("quota", ""), limit=int(reply.get("limit", 0)))
    if reply.get("reason") == "ROLLED_BACK":
        raise errors.RolledBack(message, generation=int(reply.get("generation", 0)))
    cls = errors.BY_CODE_NAME.get(code)
    if cls is None:
        raise RuntimeError(f"unexpected script reply: {reply}")
    raise cls(message, reason=reply.get("reason"))
