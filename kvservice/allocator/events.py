"""The token ids behind a pool's KV events (DESIGN §15, docs/integrations.md).

The scripts record a pool's cache changes in its stream by hash (``EVENTS`` in
``scripts/lib/pool.lua``); a ``BlockStored`` event in vLLM's format also carries the block's
tokens and its parent's hash, which only the allocator's Python side sees (it computes the
hashes from the tokens). With ``kv_events`` on, each step, create and journal that registers
hashes writes, before its script runs, ``kvs:tok:<hash hex>`` = the parent's hash (16 bytes)
and the block's token ids (little-endian uint32), and ``kvs:tok:<root hex>`` = ``ROOT`` for
each chain root (a first block's parent, which vLLM's events name None), for
``TOKENS_TTL`` seconds: what ``kvservice events`` reads when it publishes the hash."""

from __future__ import annotations

from typing import Any, Iterable

from kvservice.common import hashing

TOKENS_TTL = 3600
TOKENS_PREFIX = "kvs:tok:"
ROOT = b"R"


def tokens_key(hash_hex: str) -> str:
    return TOKENS_PREFIX + hash_hex


def chain_records(parent_hex: str, hashes_hex: Iterable[str], data: bytes, block_size: int) -> dict[str, bytes]:
    """``kvs:tok`` records of a chain: ``hashes_hex`` from ``parent_hex`` on, their tokens
    ``data`` (bytes from ``hashing.token_bytes_checked``), one block after the other."""
    out = {}
    width = 4 * block_size
    parent = bytes.fromhex(parent_hex)
    for i, h in enumerate(hashes_hex):
        out[tokens_key(h)] = parent + data[i * width:(i + 1) * width]
        parent = bytes.fromhex(h)
    return out


def journal_records(payload: dict[str, Any], commit_tokens: Any, block_size: int) -> dict[str, bytes]:
    """The records of a journal's commits (``journal.journal_payload``'s reply)."""
    if not payload or not payload.get("commits"):
        return {}
    data = hashing.token_bytes_checked(commit_tokens, "journal")
    out: dict[str, bytes] = {}
    at, k = 0, 0
    for n in payload["num_commits"]:
        if not n:
            continue
        hashes = payload["commits"][at:at + n]
        out.update(chain_records(payload["parents"][k], hashes, data[at * 4 * block_size:], block_size))
        at += n
        k += 1
    return out


async def note_tokens(redis: Any, records: dict[str, bytes]) -> None:
    """Writes ``records`` (one round trip; over a Redis Cluster, one per node)."""
    if not records:
        return
    async with redis.pipeline(transaction=False) as pipe:
        for key, value in records.items():
            pipe.set(key, value, ex=TOKENS_TTL)
        await pipe.execute()
