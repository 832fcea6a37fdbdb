"""vLLM's KV event wire format (``vllm.distributed.kv_events``), written and read with
msgpack, byte for byte what vLLM's msgspec structs encode:

- a ZMQ PUB message is three frames: the topic, the sequence number (8 bytes, big-endian,
  one counter per publisher), the payload;
- the payload is a ``KVEventBatch``: an array ``[ts, [event, ...]]`` (a third element, the
  data-parallel rank, only when set);
- an event is a map tagged by ``"type"``: ``BlockStored`` (``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
  ``lora_name``), ``BlockRemoved`` (``block_hashes``, ``medium``) or ``AllBlocksCleared``;
- the replay socket (ROUTER) takes ``[b"", start seq]`` and answers, for each buffered
  batch from that number on, ``[b"", topic, seq, payload]``, then ``[b"", b"", -1 as 8
  signed bytes, b""]``.

A block hash is bytes or an int (vLLM's ``ExternalBlockHash``). Media: ``GPU``, ``CPU``,
``STORAGE`` (vLLM's names); kvservice's tiers map to them (device, host, disk)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
#: kvservice's tiers as vLLM's media.
TIER_MEDIUM = {"device": MEDIUM_GPU, "host": MEDIUM_CPU, "disk": MEDIUM_STORAGE}
END_SEQ = (-1).to_bytes(8, "big", signed=True)

BlockHash = bytes | int


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = MEDIUM_GPU
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class Batch:
    ts: float
    events: list[Event] = field(default_factory=list)
    data_parallel_rank: int | None = None


def _event_map(e: Event) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(e.block_hashes), "parent_block_hash": e.parent_block_hash,
                "token_ids": list(e.token_ids), "block_size": e.block_size, "lora_id": e.lora_id,
                "medium": e.medium, "lora_name": e.lora_name}
    if isinstance(e, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
    return {"type": "AllBlocksCleared"}


def encode(batch: Batch) -> bytes:
    """A batch's payload, as vLLM's ``msgspec.msgpack.encode(KVEventBatch(...))``."""
    body: list[Any] = [batch.ts, [_event_map(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


class BadPayload(ValueError):
    """A payload that is not a KVEventBatch."""


def _event(m: Any) -> Event | None:
    if not isinstance(m, dict):
        raise BadPayload(f"an event is a map, got {type(m).__name__}")
    kind = m.get("type")
    if kind == "BlockStored":
        return BlockStored(list(m["block_hashes"]), m.get("parent_block_hash"), list(m["token_ids"]),
                           int(m["block_size"]), m.get("medium"), m.get("lora_id"), m.get("lora_name"))
    if kind == "BlockRemoved":
        return BlockRemoved(list(m["block_hashes"]), m.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None                # (an event kind this reader does not know: passed over)


def decode(payload: bytes) -> Batch:
    """A payload as a batch (events of kinds it does not know are passed over)."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        ts, events = body[0], body[1]
        out = Batch(float(ts), [e for e in (_event(m) for m in events) if e is not None])
        if len(body) > 2:
            out.data_parallel_rank = body[2]
        return out
    except BadPayload:
        raise
    except (ValueError, TypeError, KeyError, IndexError, msgpack.exceptions.ExtraData) as exc:
        raise BadPayload(f"not a KVEventBatch: {exc}") from None


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
