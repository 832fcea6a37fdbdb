"""vLLM's KV connector over the kvservice store (DESIGN §15, docs/integrations.md).

vLLM loads it with ``--kv-transfer-config``::

    {"kv_connector": "KVServiceConnector",
     "kv_connector_module_path": "kvservice.integrations.vllm",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"allocator": "127.0.0.1:50051", "tenant": "team-a"}}

Scheduler side: a request's prompt is held in the store (``KVStore.hold``: one Step that
shares the prefix the store caches under the tenant's chained hashes and allocates blocks
for the rest); ``get_num_new_matched_tokens`` answers the cached prefix beyond vLLM's own.
Worker side: ``start_load_kv`` reads those blocks from their store worker into vLLM's paged
cache before the forward (a block that fails to load is reported by
``get_block_ids_with_load_errors``, and vLLM recomputes it); once a prompt's full blocks are
computed, ``wait_for_save`` copies them out of vLLM's cache (one gather per layer) and a
background thread writes them to the store and commits their hashes, off the forward's
path. Blocks are opaque bytes: every layer's block, in layer order, as vLLM lays it out.

``kv_connector_extra_config``:
    allocator: the allocator's ``host:port`` (default ``$KVSERVICE_ALLOCATOR`` or
        ``127.0.0.1:50051``).
    tenant: the lease's tenant (default: the identity of the credentials; a tenant's
        blocks are never loaded by another: its hashes are salted with it).
    token_file, tls_ca, client_cert, client_key: credentials (default: the ``KVSERVICE_*``
        variables, as every kvservice client).
    lease_ttl: seconds after which a dead instance's holdings are let go (default 10).
    stats_file: a JSON file the connector rewrites with its counters (optional).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)

from kvservice.common.security import ClientCredentials
from kvservice.integrations.store import Held, KVStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

_log = logging.getLogger("kvservice.vllm")

DEFAULT_ALLOCATOR = "127.0.0.1:50051"


@dataclasses.dataclass(slots=True)
class Load:
    held: Held
    first: int                       # the first block (of the prompt) to load
    vllm_blocks: list[int]           # where they go in vLLM's cache


@dataclasses.dataclass(slots=True)
class Save:
    held: Held
    first: int                       # the first block to write (past the store's prefix)
    tokens: list[int]                # the prompt's tokens up to the last block written
    vllm_blocks: list[int]           # where they are in vLLM's cache


@dataclasses.dataclass
class KVServiceMetadata(KVConnectorMetadata):
    loads: list[Load] = dataclasses.field(default_factory=list)
    saves: list[Save] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class _Request:
    held: Held | None
    tokens: list[int]                # the prompt
    num_computed: int = 0            # vLLM's own prefix when the store was asked
    load: int = 0                    # blocks to load (past num_computed)
    table: list[int] = dataclasses.field(default_factory=list)   # vLLM's block ids
    saved: bool = False              # a save was handed to the worker side (it lets the sequence go)


def _config(vllm_config: "VllmConfig") -> dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


def _credentials(cfg: dict[str, Any]) -> ClientCredentials:
    env = dict(os.environ)
    for key, var in (("token_file", "TOKEN_FILE"), ("tls_ca", "TLS_CA"), ("client_cert", "CLIENT_CERT"),
                     ("client_key", "CLIENT_KEY")):
        if cfg.get(key):
            env["KVSERVICE_" + var] = str(cfg[key])
    return ClientCredentials.from_env(env)


def _extra_key(vllm_config: "VllmConfig") -> bytes:
    """What two instances must share to share blocks: the model, its dtype, the block size
    and the cache's layout (vLLM's, not kvservice's)."""
    import vllm
    m, c = vllm_config.model_config, vllm_config.cache_config
    # (the CPU backend's block layout depends on the instruction set too)
    text = f"vllm {vllm.__version__}|{m.model}|{m.dtype}|{c.block_size}|{c.cache_dtype}|" \
           f"{torch.backends.cpu.get_cpu_capability()}"
    return b"vllm:" + hashlib.blake2b(text.encode(), digest_size=16).digest()


class KVServiceConnector(KVConnectorBase_V1):
    """vLLM's ``KVConnectorBase_V1`` over the kvservice store (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = _config(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.stats_file = cfg.get("stats_file", "")
        self.stats: dict[str, int] = {"queried_tokens": 0, "hit_tokens": 0, "loaded_tokens": 0, "load_failures": 0,
                                      "failed_blocks": 0, "saved_blocks": 0, "save_failures": 0, "holds_refused": 0}
        self._stats_lock = threading.Lock()
        self._pending = 0
        target = cfg.get("allocator") or os.environ.get("KVSERVICE_ALLOCATOR", DEFAULT_ALLOCATOR)
        scheduler = role == KVConnectorRole.SCHEDULER
        self.store = KVStore(target, tenant=cfg.get("tenant", ""), credentials=_credentials(cfg),
                             extra_key=_extra_key(vllm_config), lease=scheduler,
                             lease_ttl=float(cfg.get("lease_ttl", 10.0)))
        if scheduler:
            self._check_store()
        # scheduler side
        self._requests: dict[str, _Request] = {}
        # worker side
        self._layers: list[tuple[str, torch.Tensor]] = []
        self._layer_bytes: list[int] = []
        self._failed: set[int] = set()
        self._saves: queue.Queue[tuple[Save, bytearray] | None] = queue.Queue()
        self._saver: threading.Thread | None = None
        self._idle = threading.Condition()
        _log.info("kvservice connector (%s) on %s, tenant %r, block size %d", role.name, target,
                  cfg.get("tenant", ""), self.block_size)

    # ================================================================ counters

    def _count(self, **more: int) -> None:
        with self._stats_lock:
            for k, v in more.items():
                self.stats[k] += v
            self.stats["pending_saves"] = self._pending
            if self.stats_file:
                tmp = f"{self.stats_file}.{os.getpid()}.{self.role.name}.tmp"
                with open(tmp, "w") as f:
                    json.dump(self.stats, f)
                os.replace(tmp, f"{self.stats_file}.{self.role.name.lower()}")

    # ================================================================ scheduler side

    def _check_store(self) -> None:
        pools = self.store.pools()
        if not pools:
            _log.warning("kvservice connector: no store pool is registered yet (workers with --role store)")
        for p in pools:
            if p.geometry.block_size != self.block_size:
                raise ValueError(f"kvservice connector: store pool {p.pool_id} has blocks of {p.geometry.block_size} "
                                 f"tokens, vLLM's are {self.block_size} (start the store's workers with "
                                 f"--block-size {self.block_size}, or vLLM with --block-size "
                                 f"{p.geometry.block_size})")

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        tokens = list(request.prompt_token_ids or [])
        bs = self.block_size
        full = len(tokens) // bs
        r = self._requests.get(request.request_id)
        if r is None:
            held = None
            if full:
                # (the prompt's full blocks, and one token more when there is one: the store's
                # prefix never covers the token vLLM must compute)
                held = self.store.hold(tokens[:full * bs + 1] if len(tokens) > full * bs else tokens)
                if held is None:
                    self._count(holds_refused=1)
            r = self._requests[request.request_id] = _Request(held, tokens)
            self._count(queried_tokens=len(tokens), hit_tokens=held.num_cached_tokens if held else 0)
        r.num_computed = num_computed_tokens
        hit = r.held.num_cached_tokens if r.held is not None else 0
        more = max(0, hit - num_computed_tokens)
        r.load = more // bs
        return r.load * bs, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        r = self._requests.get(request.request_id)
        if r is not None and num_external_tokens == 0:
            r.load = 0

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVServiceMetadata()
        bs = self.block_size
        progress: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            r = self._requests.get(new.req_id)
            if r is None:
                continue
            r.table = list(new.block_ids[0])
            progress[new.req_id] = new.num_computed_tokens
            if r.load and r.held is not None:
                first = r.num_computed // bs
                meta.loads.append(Load(r.held, first, r.table[first:first + r.load]))
                r.load = 0
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self._requests.get(req_id)
            if r is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.table = list(added[0]) if added else []
                if r.load and r.held is not None:        # (preempted, then resumed: loaded again)
                    first = r.num_computed // bs
                    meta.loads.append(Load(r.held, first, r.table[first:first + r.load]))
                    r.load = 0
            elif added:
                r.table.extend(added[0])
            progress[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in progress.items():
            r = self._requests[req_id]
            held = r.held
            if held is None or r.saved:
                continue
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = held.num_tokens // bs
            first = held.num_committed_blocks
            if full > first and done >= full * bs and len(r.table) >= full:
                # (the prompt's full blocks are computed by the end of this step)
                meta.saves.append(Save(held, first, r.tokens[:full * bs], r.table[first:full]))
                r.saved = True
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        r = self._requests.pop(request.request_id, None)
        if r is not None and r.held is not None and not r.saved:
            try:
                self.store.release(r.held)
            except Exception as exc:           # (the lease's TTL lets it go in the end)
                _log.warning("kvservice connector: releasing %s failed: %s", r.held.sequence_id, exc)
        return False, None

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        self._layers = []
        for name, t in kv_caches.items():
            if num_blocks is not None and t.shape[0] != num_blocks:
                raise ValueError(f"kvservice connector: layer {name}'s cache {tuple(t.shape)} does not have its "
                                 f"{num_blocks} blocks first (this backend's layout is not supported)")
            self._layers.append((name, t.view(t.shape[0], -1).view(torch.uint8)))
        self._layer_bytes = [t.shape[1] for _, t in self._layers]
        _log.info("kvservice connector: %d layers, %d bytes per block", len(self._layers), sum(self._layer_bytes))

    @property
    def bytes_per_block(self) -> int:
        return sum(self._layer_bytes)

    def _gather(self, blocks: list[int]) -> bytearray:
        out = bytearray(len(blocks) * self.bytes_per_block)
        view = torch.frombuffer(out, dtype=torch.uint8).view(len(blocks), -1)
        index = torch.tensor(blocks, dtype=torch.long)
        at = 0
        for (_, t), n in zip(self._layers, self._layer_bytes):
            view[:, at:at + n] = t[index]
            at += n
        return out

    def _scatter(self, data: bytearray, blocks: list[int]) -> None:
        view = torch.frombuffer(data, dtype=torch.uint8).view(len(blocks), -1)
        index = torch.tensor(blocks, dtype=torch.long)
        at = 0
        for (_, t), n in zip(self._layers, self._layer_bytes):
            t[index] = view[:, at:at + n]
            at += n

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVServiceMetadata)
        for load in meta.loads:
            held = load.held
            try:
                data = self.store.read(held, load.first, len(load.vllm_blocks))
                if len(data) != len(load.vllm_blocks) * self.bytes_per_block:
                    raise ValueError(f"the store's blocks hold {len(data) // max(len(load.vllm_blocks), 1)} bytes, "
                                     f"vLLM's {self.bytes_per_block}")
                self._scatter(data, load.vllm_blocks)
                self._count(loaded_tokens=len(load.vllm_blocks) * self.block_size)
            except Exception as exc:
                _log.warning("kvservice connector: loading %d blocks from %s failed (vLLM recomputes them): %s",
                             len(load.vllm_blocks), held.pool_id, exc)
                self._failed.update(load.vllm_blocks)
                self._count(load_failures=1, failed_blocks=len(load.vllm_blocks))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVServiceMetadata)
        for save in meta.saves:
            data = self._gather(save.vllm_blocks)        # (vLLM may reuse its blocks from now on)
            with self._idle:
                self._pending += 1
            self._count()
            if self._saver is None:
                self._saver = threading.Thread(target=self._save_loop, name="kvservice-saver", daemon=True)
                self._saver.start()
            self._saves.put((save, data))

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            if item is None:
                return
            save, data = item
            held = save.held
            done = {}
            try:
                _, bpb = self.store.geometry(held)
                if bpb != self.bytes_per_block:
                    self.store.release(held)
                    raise ValueError(f"store pool {held.pool_id} has blocks of {bpb} bytes, vLLM's hold "
                                     f"{self.bytes_per_block} (its workers need the model's geometry: docs/integrations.md)")
                done["saved_blocks"] = self.store.write(held, save.first, save.tokens, data)
            except Exception as exc:
                _log.warning("kvservice connector: saving %d blocks to %s failed: %s", len(save.vllm_blocks),
                             held.pool_id, exc)
                done["save_failures"] = 1
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
                self._count(**done)

    def wait_until_saved(self, timeout: float = 30.0) -> bool:
        """Blocks until every save handed to the background thread is done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        if self._saver is not None:
            self.wait_until_saved()
            self._saves.put(None)
        self.store.close()
