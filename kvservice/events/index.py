"""An index of which instance caches which block, in Redis, fed by KV events
(``kvservice.events.wire``), and the lookup that routing asks of it.

Blocks are keyed by kvservice's own chained hash of their tokens (BLAKE2b-128 from a root
of the LoRA name, ``kvservice.common.hashing``), not by the instance's hash: vLLM's hashes
are seeded per process unless ``PYTHONHASHSEED`` is set, so two instances name one
prefix differently, and a router could not compute them from a prompt. A ``BlockStored``
event carries the tokens and the parent's (instance) hash: the index maps each instance
hash to its own, so that a child's chain goes on from its parent's.

Keys (one Redis, or a Redis Cluster: no call touches two keys):

- ``kvs:idx:instances``: set of instance names;
- ``kvs:idx:i:<instance>``: hash: ``last_seq`` (the last batch applied), ``block_size``,
  ``suspect`` (1: its connection dropped and no batch came since: not used for routing);
- ``kvs:idx:v:<instance>``: hash: the instance's block hash (bytes, or ``i<int>``) -> ours;
- ``kvs:idx:b:<our hash>``: hash: ``<instance>|<medium>`` -> 1, for each instance and medium
  (GPU, CPU, STORAGE) that holds the block.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterable

from kvservice.common import hashing
from kvservice.events import wire

PREFIX = "kvs:idx:"
INSTANCES = PREFIX + "instances"
#: What a block held in a medium is worth, in a device block (Dynamo's weights' spirit:
#: the device 1.0, host memory less, storage less still).
MEDIUM_WEIGHT = {wire.MEDIUM_GPU: 1.0, wire.MEDIUM_CPU: 0.5, wire.MEDIUM_STORAGE: 0.25}
#: Blocks looked up per round trip.
LOOKUP_CHUNK = 64
#: Instance hashes remembered per instance (``Index._remember``).
RECENT = 65_536


def _info_key(instance: str) -> str:
    return f"{PREFIX}i:{instance}"


def _map_key(instance: str) -> str:
    return f"{PREFIX}v:{instance}"


def _block_key(h: bytes) -> bytes:
    return PREFIX.encode() + b"b:" + h


def _vkey(h: wire.BlockHash) -> bytes:
    return h if isinstance(h, bytes) else b"i%d" % h


def chain_root(lora_name: str | None) -> bytes:
    return hashing.root_hash("vllm-events", (lora_name or "").encode())


@dataclasses.dataclass(slots=True)
class Applied:
    """What one batch did to the index."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unchained: int = 0           # stored blocks whose parent the index does not know (passed over)


@dataclasses.dataclass(slots=True)
class Match:
    """An instance's cached prefix of a prompt."""

    instance: str
    blocks: int                  # the prefix's blocks, in any medium
    weighted_tokens: float       # its tokens weighted by medium (MEDIUM_WEIGHT)
    by_medium: dict[str, int]


class Index:
    """The index over a sync redis-py client (``redis.Redis`` or ``RedisCluster``)."""

    def __init__(self, redis: Any) -> None:
        self.r = redis
        #: Per instance, its latest instance hash -> ours (a child's parent is most often the
        #: block stored just before it: no round trip for it).
        self._recent: dict[str, collections.OrderedDict[bytes, bytes]] = {}

    def _remember(self, instance: str, pairs: Iterable[tuple[bytes, bytes]]) -> None:
        recent = self._recent.setdefault(instance, collections.OrderedDict())
        for k, v in pairs:
            recent[k] = v
            recent.move_to_end(k)
        while len(recent) > RECENT:
            recent.popitem(last=False)

    # ------------------------------------------------------------ instances

    def instances(self) -> list[str]:
        return sorted(m.decode() for m in self.r.smembers(INSTANCES))

    def info(self, instance: str) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(_info_key(instance)).items()}

    def set_info(self, instance: str, **fields: int) -> None:
        with self.r.pipeline(transaction=False) as p:
            p.sadd(INSTANCES, instance)
            p.hset(_info_key(instance), mapping=fields)
            p.execute()

    def num_blocks(self, instance: str) -> int:
        """Blocks the index knows the instance has stored (in any medium)."""
        return int(self.r.hlen(_map_key(instance)))

    def clear(self, instance: str) -> int:
        """Drops every block of ``instance`` (AllBlocksCleared, a restart); returns how many."""
        key, cursor, n = _map_key(instance), 0, 0
        fields = [f"{instance}|{m}".encode() for m in MEDIUM_WEIGHT]
        while True:
            cursor, part = self.r.hscan(key, cursor, count=1000)
            if part:
                with self.r.pipeline(transaction=False) as p:
                    for ours in set(part.values()):
                        p.hdel(_block_key(ours), *fields)
                    p.execute()
                n += len(part)
            if cursor == 0:
                break
        self.r.delete(key)
        self._recent.pop(instance, None)
        return n

    def forget(self, instance: str) -> None:
        self.clear(instance)
        self.r.delete(_info_key(instance))
        self.r.srem(INSTANCES, instance)

    # ------------------------------------------------------------ events

    def apply(self, instance: str, batch: wire.Batch) -> Applied:
        """Applies one batch of ``instance``'s events, in order."""
        out = Applied()
        for event in batch.events:
            if isinstance(event, wire.AllBlocksCleared):
                out.cleared += self.clear(instance)
            elif isinstance(event, wire.BlockStored):
                self._stored(instance, event, out)
            else:
                self._removed(instance, event, out)
        return out

    def _stored(self, instance: str, e: wire.BlockStored, out: Applied) -> None:
        bs = e.block_size
        if bs <= 0 or len(e.token_ids) < bs * len(e.block_hashes):
            out.unchained += len(e.block_hashes)
            return
        if e.parent_block_hash is None:
            parent = chain_root(e.lora_name)
        else:
            pk = _vkey(e.parent_block_hash)
            parent = self._recent.get(instance, {}).get(pk) or self.r.hget(_map_key(instance), pk)
            if parent is None:
                out.unchained += len(e.block_hashes)
                return
        ours = hashing.chain_hashes(parent, e.token_ids[:bs * len(e.block_hashes)], bs, len(e.block_hashes))
        field = f"{instance}|{e.medium or wire.MEDIUM_GPU}"
        pairs = [(_vkey(h), o) for h, o in zip(e.block_hashes, ours)]
        self._remember(instance, pairs)
        with self.r.pipeline(transaction=False) as p:
            p.hset(_map_key(instance), mapping=dict(pairs))
            for o in ours:
                p.hset(_block_key(o), field, 1)
            p.execute()
        out.stored += len(ours)

    def _removed(self, instance: str, e: wire.BlockRemoved, out: Applied) -> None:
        keys = [_vkey(h) for h in e.block_hashes]
        ours = self.r.hmget(_map_key(instance), keys)
        field = f"{instance}|{e.medium or wire.MEDIUM_GPU}"
        known = [(k, o) for k, o in zip(keys, ours) if o is not None]
        if not known:
            return
        with self.r.pipeline(transaction=False) as p:
            for _, o in known:
                p.hdel(_block_key(o), field)
                p.hgetall(_block_key(o))
            left = p.execute()[1::2]
        # (an instance hash no medium of the instance holds any more is forgotten)
        gone = [k for (k, _), rest in zip(known, left)
                if not any(f.decode().startswith(instance + "|") for f in rest)]
        if gone:
            self.r.hdel(_map_key(instance), *gone)
            recent = self._recent.get(instance, {})
            for k in gone:
                recent.pop(k, None)
        out.removed += len(known)

    # ------------------------------------------------------------ lookup

    def lookup(self, token_ids: list[int], instances: Iterable[str] | None = None,
               lora_name: str | None = None) -> dict[str, Match]:
        """Each instance's cached prefix of ``token_ids`` (instances marked suspect count
        none), by its block size."""
        names = list(instances) if instances is not None else self.instances()
        infos = {n: self.info(n) for n in names}
        out = {n: Match(n, 0, 0.0, {}) for n in names}
        by_size: dict[int, list[str]] = {}
        for n, info in infos.items():
            if info.get("block_size") and not info.get("suspect"):
                by_size.setdefault(info["block_size"], []).append(n)
        root = chain_root(lora_name)
        for bs, group in by_size.items():
            hashes = hashing.chain_hashes(root, token_ids, bs, len(token_ids) // bs)
            alive = set(group)
            for start in range(0, len(hashes), LOOKUP_CHUNK):
                with self.r.pipeline(transaction=False) as p:
                    for h in hashes[start:start + LOOKUP_CHUNK]:
                        p.hkeys(_block_key(h))
                    held = p.execute()
                for fields in held:
                    media: dict[str, list[str]] = {}
                    for f in fields:
                        name, _, medium = f.decode().rpartition("|")
                        if name in alive:
                            media.setdefault(name, []).append(medium)
                    alive = set(media)
                    for name, ms in media.items():
                        m = out[name]
                        best = max(ms, key=lambda x: MEDIUM_WEIGHT.get(x, 0.0))
                        m.blocks += 1
                        m.weighted_tokens += bs * MEDIUM_WEIGHT.get(best, 0.0)
                        m.by_medium[best] = m.by_medium.get(best, 0) + 1
                    if not alive:
                        break
                if not alive:
                    break
        return out

