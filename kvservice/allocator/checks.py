"""The allocator's request checks and record conversions: what ``core.Allocator`` runs on
every request before (and after) a script call, kept out of its methods.

Each check raises ``kvservice.errors.InvalidArgument`` naming the offending field.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from kvservice import errors
from kvservice.allocator import codec
from kvservice.allocator.domain import LEASE_ID, REQUEST_ID, Create, LeaseInfo, SeqState, format_sequence_id
from kvservice.common import hashing
from kvservice.common.auth import caller
from kvservice.common.geometry import Geometry
from kvservice.common.settings import check_pool_id, echo

MAX_INT = 2**31 - 1


def commit_payload(payload: dict[str, Any], what: str, parent: bytes, commits: Any, block_size: int) -> None:
    """Sets ``parent_hash``, ``num_committed_blocks`` and ``commits`` (the hashes, hex) of a
    step update's payload from its parent hash and ``BlockCommit``s."""
    if len(parent) != hashing.HASH_BYTES:
        raise errors.InvalidArgument(f"{what}: parent_hash must be {hashing.HASH_BYTES} bytes")
    payload["parent_hash"] = parent.hex()
    first = commits[0].index
    if first < 0:
        raise errors.InvalidArgument(f"{what}: commit starts at block {first}; block indexes start at 0")
    hashes = payload["commits"]
    index = first
    for c in commits:
        if c.index != index:
            raise errors.InvalidArgument(f"{what}: commits must be consecutive blocks")
        tokens = c.token_ids
        if len(tokens) != block_size:
            raise errors.InvalidArgument(
                f"{what}: block {index} has {len(tokens)} tokens, a full block has {block_size}")
        parent = hashing.block_hash_checked(parent, tokens, what)
        hashes.append(parent.hex())
        index += 1
    payload["num_committed_blocks"] = first


def seq_state(pool_id: str, epoch: int, rec: dict[str, Any], lease_id: str, block_size: int) -> SeqState:
    """A sequence record (a script's reply record, or a stored one: ``store.parse_record``)."""
    cow = rec.get("cow")
    lease_id = rec.get("lease_id", lease_id)
    return SeqState(format_sequence_id(pool_id, epoch, rec["sequence"], lease_id), pool_id, epoch, lease_id, rec["block_table"], rec["num_tokens"], rec["num_cached_tokens"],
                    rec["num_committed_blocks"], bytes.fromhex(rec["last_hash"]), tuple(cow) if cow else None,
                    block_size)


def geometry_of(meta: dict[str, str]) -> Geometry:
    return Geometry(int(meta["num_blocks"]), int(meta["block_size"]), int(meta["num_layers"]),
                    int(meta["num_kv_heads"]), int(meta["head_dim"]), meta["dtype"])


def lease_info(reply: dict[str, Any]) -> LeaseInfo:
    return LeaseInfo(reply["lease_id"], reply["tenant"], reply["ttl_ms"] / 1000, reply["deadline_ms"])


def fingerprint(kind: str, request: Any) -> str:
    """The identity of a request for retries under one request id: SHA-256 (64 hex digits)
    over the msgpack form of everything the request says."""
    return hashlib.sha256(codec.encode([kind, request])).hexdigest()


def epoch_error(sequence_id: str, pool_id: str, epoch: int, current: int) -> errors.KvsError:
    """A sequence id of an epoch that is not the pool's: stale (FAILED_PRECONDITION), or
    one that the pool has not reached, so the sequence never existed (NOT_FOUND)."""
    if epoch > current:
        return errors.NotFound(f"sequence {sequence_id} not found: pool {pool_id} is at epoch {current}")
    return errors.FailedPrecondition(f"sequence {sequence_id} belongs to epoch {epoch} but pool {pool_id} "
                                     f"was re-registered (epoch {current})", reason="EPOCH_CHANGED")


def check_pool_arg(pool_id: str) -> None:
    try:
        check_pool_id(pool_id)
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc)) from None


def check_lease_id(lease_id: str) -> None:
    if not LEASE_ID.fullmatch(lease_id or ""):
        raise errors.InvalidArgument(f"malformed lease_id {echo(lease_id)}")


def check_request_id(request_id: str) -> None:
    if request_id and not REQUEST_ID.fullmatch(request_id):
        raise errors.InvalidArgument(f"malformed request_id {echo(request_id)} (1..128 of A-Z a-z 0-9 _ . : -)")


def check_create(c: Create, max_sequence_tokens: int) -> bytes:
    """Checks a create; returns its prompt as the bytes the block hashes take."""
    if not c.token_ids:
        raise errors.InvalidArgument("a create needs a non-empty prompt (token_ids)")
    if len(c.token_ids) > max_sequence_tokens:
        raise errors.InvalidArgument(f"prompt of {len(c.token_ids)} tokens, a sequence holds at most "
                                     f"{max_sequence_tokens} (max_sequence_tokens)")
    data = hashing.token_bytes_checked(c.token_ids, "prompt")
    if c.pool_id:
        check_pool_arg(c.pool_id)
    if len(c.extra_key) > 1024:
        raise errors.InvalidArgument("extra_key is longer than 1024 bytes")
    if c.pool_role not in ("", "store"):
        raise errors.InvalidArgument(f"pool_role must be empty or \"store\", got {echo(c.pool_role)}")
    return data


def tag_fits(tag: str, lease_id: str, pool_id: str, epoch: int, n: int) -> bool:
    """Whether a sequence id's tag is the one ``lease_id`` gives it; a missing tag fits for
    an admin and when nobody is authenticated."""
    if not tag:
        ident = caller()
        return ident is None or ident.role == "admin"
    return hmac.compare_digest(tag, hashing.sequence_tag(lease_id, pool_id, epoch, n))
