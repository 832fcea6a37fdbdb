"""The Worker gRPC servicer: translates proto <-> pool (and model) and checks the epoch."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator

from kvservice import errors
from kvservice.common.auth import caller
from kvservice.common.settings import echo
from kvservice.v1 import worker_pb2 as pb, worker_pb2_grpc as pb_grpc
from worker import tensors
from worker.fence import LeaseFence
from worker.pool import KVPool
from worker.tiers import Tiers
from worker import store, transfer

if TYPE_CHECKING:
    from worker.model import ModelRunner


class WorkerServicer(pb_grpc.WorkerServicer):
    """The ``kvservice.v1.Worker`` service over one pool.

    Args:
        pool: the KV pool.
        pool_id: its id.
        allocator: the allocator it registered with ("" when standalone).
        runner: the model served by ``Forward`` (None: K/V only).
        fence: the dead leases whose writes are refused (``worker/fence.py``).
        tiers: the pool's lower tiers (``MoveBlocks``; None: none).
        sources: where other pools' workers are (``FetchBlocks``; None: fetches refused).

    Attributes:
        store: the blocks written and read for store clients (``WriteBlocks``, ``ReadBlocks``).
    """

    def __init__(self, pool: KVPool, pool_id: str, allocator: str = "", runner: ModelRunner | None = None,
                 fence: LeaseFence | None = None, tiers: Tiers | None = None,
                 sources: transfer.Sources | None = None) -> None:
        self.pool = pool
        self.tiers = tiers
        self.sources = sources
        self.pool_id = pool_id
        self.allocator = allocator
        self.runner = runner
        self.fence = fence if fence is not None else LeaseFence()
        self.store = store.StoreCounts()

    def _staging_dir(self) -> str:
        """Where staging files of workers of this machine are opened ("": none is)."""
        staging = self.sources.staging if self.sources is not None else None
        return staging.directory if staging is not None else ""

    def _check_epoch(self, epoch: int) -> None:
        current = self.pool.epoch
        if current <= 0:
            raise errors.Unavailable(f"pool {self.pool_id} is not registered with the allocator yet")
        if epoch != current:
            raise errors.FailedPrecondition(
                f"request for epoch {epoch}, but pool {self.pool_id} is at epoch {current} "
                f"(the worker restarted or re-registered; its sequences are gone)", reason="EPOCH_CHANGED")

    def _admit(self, grants, lease_id: str, what: str, write=(), read=()) -> list[int]:
        """Admits the call's grants into the pool's table and checks the call's blocks
        against it (``worker/rights.py``); returns the blocks to zero before the call runs
        (given to another tenant than their last writer's)."""
        rights = self.fence.rights
        if rights is None:
            return []
        ident = caller()
        tenant = ident.name if ident is not None and ident.role == "tenant" else None
        zero = rights.admit(grants, tenant, self.fence.generation, what) if grants else []
        rights.check(lease_id, write, read, what)
        return zero

    def _slot_blocks(self, slots) -> set[int]:
        bs = self.pool.shape.block_size
        return {s // bs for s in slots if s >= 0}

    def _tensor(self, t: pb.Tensor, name: str):
        return tensors.decode(t, name, self.pool.shape.dtype, self.pool.device)

    async def Describe(self, request: pb.DescribeWorkerRequest, context: Any) -> pb.WorkerInfo:
        s = self.pool.shape
        info = pb.WorkerInfo(pool_id=self.pool_id, epoch=max(self.pool.epoch, 0), geometry=s.geometry.to_pb(),
                             device=str(self.pool.device), backend=self.pool.backend.name,
                             bytes_per_block=s.bytes_per_block, pool_bytes=self.pool.pool_bytes,
                             allocator=self.allocator)
        if self.runner is not None:
            r, cfg = self.runner, self.runner.model.config
            info.model.CopyFrom(pb.ModelInfo(
                name=r.name, seed=0 if r.source else r.seed, vocab_size=cfg.vocab_size,
                num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads, head_dim=r.head_dim, hidden_size=cfg.hidden_size,
                dtype=tensors.NAMES[r.model.dtype], source=r.source, num_parameters=r.num_parameters,
                max_position_embeddings=r.max_position_embeddings))
            t = r.tokenizer
            if request.include_tokenizer and t is not None:
                info.model.tokenizer.CopyFrom(pb.TokenizerInfo(
                    tokenizer_json=t.tokenizer_json, chat_template=t.chat_template,
                    eos_token_ids=t.eos_token_ids, bos_token=t.bos_token, eos_token=t.eos_token))
        return info

    async def WriteKV(self, request: pb.WriteKVRequest, context: Any) -> pb.WriteKVResponse:
        self._check_epoch(request.epoch)
        self.fence.check(request.lease_id, "WriteKV")
        await self.fence.check_generation(request.generation, "WriteKV")
        self.pool.zero(self._admit(request.grants, request.lease_id, "WriteKV",
                                   write=self._slot_blocks(request.slot_mapping)))
        n = self.pool.write(request.layer, list(request.slot_mapping), self._tensor(request.key, "key"),
                            self._tensor(request.value, "value"))
        return pb.WriteKVResponse(num_written=n)

    async def ReadKV(self, request: pb.ReadKVRequest, context: Any) -> pb.ReadKVResponse:
        self._check_epoch(request.epoch)
        self.pool.zero(self._admit(request.grants, request.lease_id, "ReadKV", read=self._slot_blocks(request.slots)))
        k, v = self.pool.read(request.layer, list(request.slots))
        return pb.ReadKVResponse(key=tensors.encode(k), value=tensors.encode(v))

    async def Attention(self, request: pb.AttentionRequest, context: Any) -> pb.AttentionResponse:
        self._check_epoch(request.epoch)
        self.pool.zero(self._admit(request.grants, request.lease_id, "Attention",
                                   read=[b for t in request.block_tables for b in t.block_ids]))
        out = self.pool.attention(request.layer, self._tensor(request.query, "query"),
                                  [list(t.block_ids) for t in request.block_tables], list(request.context_lens),
                                  list(request.query_lens), request.scale, request.num_splits)
        return pb.AttentionResponse(output=tensors.encode(out))

    async def CopyBlocks(self, request: pb.CopyBlocksRequest, context: Any) -> pb.CopyBlocksResponse:
        self._check_epoch(request.epoch)
        self.fence.check(request.lease_id, "CopyBlocks")
        await self.fence.check_generation(request.generation, "CopyBlocks")
        self.pool.zero(self._admit(request.grants, request.lease_id, "CopyBlocks",
                                   write=[p.dst for p in request.pairs], read=[p.src for p in request.pairs]))
        return pb.CopyBlocksResponse(num_copied=self.pool.copy([(p.src, p.dst) for p in request.pairs]))

    async def MoveBlocks(self, request: pb.MoveBlocksRequest, context: Any) -> pb.MoveBlocksResponse:
        self._check_epoch(request.epoch)
        self.fence.check(request.lease_id, "MoveBlocks")
        await self.fence.check_generation(request.generation, "MoveBlocks")
        if len(request.moves) > MAX_MOVES:
            raise errors.InvalidArgument(f"at most {MAX_MOVES} moves per call, got {len(request.moves)}")
        for i, m in enumerate(request.moves):
            if not (0 <= m.src_tier <= 2 and 0 <= m.dst_tier <= 2):
                raise errors.InvalidArgument(f"moves[{i}]: tiers are 0 (device), 1 (host), 2 (disk); got "
                                             f"{m.src_tier} -> {m.dst_tier}")
            if len(m.block_hash) > 16:
                raise errors.InvalidArgument(f"moves[{i}].block_hash has {len(m.block_hash)} bytes, at most 16")
        if self.tiers is None:
            raise errors.FailedPrecondition("this worker has no lower tier (start it with --host-tier-gb)")
        rights = self.fence.rights
        stale: dict[int, str] = {}
        if rights is not None:
            refusal = rights.move_refusal(request.moves)
            if refusal:
                raise errors.PermissionDenied(f"MoveBlocks: {refusal}")
            stale = rights.stale_copies(request.moves)     # (before this call's writes count)
        zero = set(self._admit(request.grants, request.lease_id, "MoveBlocks",
                               write=[m.dst for m in request.moves if m.dst_tier == 0],
                               read=[m.src for m in request.moves if m.src_tier == 0]))
        # (a block that changed tenant is zeroed after the copies down that read its old
        # content, before an order that writes it)
        orders = [(m.src_tier, m.src, m.dst_tier, m.dst, m.block_hash) for m in request.moves]
        done: list[str] = []
        batch: list[tuple] = []                 # (run together: one stream sync on a GPU)
        for i, order in enumerate(orders):
            if (order[2] == 0 and order[3] in zero) or i in stale:
                done.extend(self.tiers.run(batch) if batch else ())
                batch = []
            if order[2] == 0 and order[3] in zero:
                self.pool.zero(sorted(zero & {o[3] for o in orders[i:] if o[2] == 0}))
                zero -= {o[3] for o in orders[i:] if o[2] == 0}
            if i in stale:
                done.append(stale[i])
            else:
                batch.append(order)
        done.extend(self.tiers.run(batch) if batch else ())
        self.pool.zero(sorted(zero))
        moved = sum(1 for e in done if not e)
        return pb.MoveBlocksResponse(results=[pb.MoveResult(ok=not e, error=e) for e in done],
                                     bytes_moved=moved * self.pool.shape.bytes_per_block)

    async def FetchBlocks(self, request: pb.FetchBlocksRequest, context: Any) -> pb.FetchBlocksResponse:
        self._check_epoch(request.epoch)
        self.fence.check(request.lease_id, "FetchBlocks")
        await self.fence.check_generation(request.generation, "FetchBlocks")
        n = len(request.fetches)
        if n > transfer.MAX_BLOCKS:
            raise errors.InvalidArgument(f"at most {transfer.MAX_BLOCKS} fetches per call, got {n}")
        if not request.source_pool_id:
            raise errors.InvalidArgument("source_pool_id is empty")
        if request.source_pool_id == self.pool_id:
            raise errors.InvalidArgument(f"pool {self.pool_id} is this worker's own: a block of it is copied "
                                         f"(CopyBlocks) or loaded (MoveBlocks), not fetched")
        chunk = transfer.check_chunk_bytes(request.chunk_bytes)
        for i, f in enumerate(request.fetches):
            if not 0 <= f.src_tier <= 2:
                raise errors.InvalidArgument(f"fetches[{i}].src_tier: 0 (device), 1 (host), 2 (disk); got "
                                             f"{f.src_tier}")
            if len(f.block_hash) > 16:
                raise errors.InvalidArgument(f"fetches[{i}].block_hash has {len(f.block_hash)} bytes, at most 16")
            if not 0 <= f.dst < self.pool.shape.num_blocks:
                raise errors.InvalidArgument(f"fetches[{i}].dst: block {f.dst} is out of range "
                                             f"0..{self.pool.shape.num_blocks - 1}")
        self.pool.zero(self._admit(request.grants, request.lease_id, "FetchBlocks",
                                   write=[f.dst for f in request.fetches]))
        if self.sources is None:
            raise errors.FailedPrecondition("this worker fetches from no other worker (it has no allocator)")
        try:
            address = await self.sources.locate(request.source_pool_id, request.source_epoch)
        except errors.KvsError as exc:       # (no such pool, another epoch: every block fails)
            self.sources.count(0, n, 0)
            why = f"{type(exc).__name__}: {exc}"
            return pb.FetchBlocksResponse(results=[pb.MoveResult(ok=False, error=why)] * n)
        pull = pb.PullBlocksRequest(pool_id=request.source_pool_id, epoch=request.source_epoch, chunk_bytes=chunk,
                                    dst_pool_id=self.pool_id,
                                    blocks=[pb.BlockRef(tier=f.src_tier, index=f.src, block_hash=f.block_hash,
                                                        order_mac=f.order_mac, pull_serial=f.pull_serial)
                                            for f in request.fetches])
        done = await transfer.fetch(self.sources.transport, address, pull, self.pool,
                                    [f.dst for f in request.fetches], self.sources.staging)
        moved = sum(1 for e in done if not e)
        self.sources.count(moved, n - moved, moved * self.pool.shape.bytes_per_block)
        return pb.FetchBlocksResponse(results=[pb.MoveResult(ok=not e, error=e) for e in done],
                                      bytes_moved=moved * self.pool.shape.bytes_per_block)

    async def PullBlocks(self, request: pb.PullBlocksRequest, context: Any):
        if request.pool_id != self.pool_id:
            raise errors.NotFound(f"this worker serves pool {self.pool_id}, not {request.pool_id!r}")
        self._check_epoch(request.epoch)
        if len(request.blocks) > transfer.MAX_BLOCKS:
            raise errors.InvalidArgument(f"at most {transfer.MAX_BLOCKS} blocks per call, got {len(request.blocks)}")
        chunk = transfer.check_chunk_bytes(request.chunk_bytes)
        self._check_pull(request)
        blocks = [(b.tier, b.index, b.block_hash) for b in request.blocks]
        sent = 0
        pool = self.pool if self.pool.epoch > 0 else None     # (unregistered: every block fails in _read)
        staging = None
        if request.staging:
            staging = transfer.open_staging(self._staging_dir(), request.staging,
                                            len(blocks) * self.pool.shape.bytes_per_block, request.staging_token)
        bpb = self.pool.shape.bytes_per_block
        async for message in transfer.serve(blocks, self._read, chunk, pool, staging):   # (serialized: serialize_chunk)
            yield message
            # (the blocks' bytes sent: a staged block's went through the staging file)
            sent += len(message) if staging is None else bpb * sum(p.staged for p in transfer.decode(message))
        if self.sources is not None:
            self.sources.served(len(blocks), sent)

    def _check_pull(self, request: pb.PullBlocksRequest) -> None:
        """A pull serves only blocks the allocator ordered to the caller's pool: each block
        carries the fetch order's MAC under this pool's grant key (``grants.pull_fields``),
        the order names the pool the caller authenticates as (a worker's identity is its
        pool), and a device block granted to a writer after the order's serial is not served
        (it may hold another lease's bytes by then).

        Raises:
            PermissionDenied: a caller other than a worker, another pool's worker than the
                order's, or a block without a valid order (the first one is named).
        """
        rights = self.fence.rights
        if rights is None or not rights.enforced:
            return                      # (a worker with no allocator: nothing to check against)
        ident = caller()
        dst = request.dst_pool_id
        if ident is not None and (ident.role != "worker" or ident.name != dst):
            who = f"{ident.role} {echo(ident.name)}"
            raise errors.PermissionDenied(f"PullBlocks: {who} may not pull blocks of pool {self.pool_id} for pool "
                                          f"{echo(dst) or '(none)'}: a pull is made by the worker of the pool that a "
                                          f"fetch order of the allocator names")
        denied = rights.pull_refusal(dst, request.epoch, request.blocks)
        if denied:
            raise errors.PermissionDenied(f"PullBlocks: {denied}")

    async def WriteBlocks(self, requests: AsyncIterator[pb.WriteBlocksRequest], context: Any) -> pb.WriteBlocksResponse:
        first = await anext(requests, None)
        if first is None:
            raise errors.InvalidArgument("WriteBlocks: an empty stream (the first message names the blocks)")

        async def check() -> None:      # (before each message's blocks: a lease may die mid-stream)
            self._check_epoch(first.epoch)
            self.fence.check(first.lease_id, "WriteBlocks")
            await self.fence.check_generation(first.generation, "WriteBlocks")

        await check()
        block_ids = store.check_block_ids(first.block_ids, self.pool.shape.num_blocks, distinct=True)
        self.pool.zero(self._admit(first.grants, first.lease_id, "WriteBlocks", write=block_ids))

        async def chunks() -> AsyncIterator[list[transfer.Piece]]:
            yield transfer.from_message(first.chunk)
            i = 0
            async for request in requests:
                i += 1
                extra = [f.name for f, _ in request.ListFields() if f.name != "chunk"]
                if extra:
                    raise errors.InvalidArgument(f"WriteBlocks message {i} sets {', '.join(extra)}: only the first "
                                                 f"message names epoch, lease_id, generation and block_ids")
                await check()
                yield transfer.from_message(request.chunk)

        return pb.WriteBlocksResponse(num_written=await store.receive(self.pool, block_ids, chunks(), self.store))

    async def ReadBlocks(self, request: pb.ReadBlocksRequest, context: Any):
        self._check_epoch(request.epoch)
        block_ids = store.check_block_ids(request.block_ids, self.pool.shape.num_blocks, distinct=False)
        chunk = transfer.check_chunk_bytes(request.chunk_bytes)
        self.pool.zero(self._admit(request.grants, request.lease_id, "ReadBlocks", read=block_ids))
        async for message in transfer.serve(store.device_refs(block_ids), self._read, chunk, self.pool):
            yield message                # (serialized: serialize_chunk)
        self.store.read_blocks += len(block_ids)

    def _read(self, tier: int, index: int, tag: bytes):
        if self.pool.epoch <= 0:
            raise transfer.LoadFailed(f"pool {self.pool_id} is not registered")
        return transfer.read_block(self.pool, self.tiers, tier, index, tag)

    async def Forward(self, request: pb.ForwardRequest, context: Any) -> pb.ForwardResponse:
        self._check_epoch(request.epoch)
        self.fence.check(request.lease_id, "Forward")
        await self.fence.check_generation(request.generation, "Forward")
        if self.runner is None:
            raise errors.FailedPrecondition("this worker serves no model (start it with --model)")
        read = [p.src for p in request.copies]
        for q in request.sequences:
            read.extend(q.block_table)
        self.pool.zero(self._admit(request.grants, request.lease_id, "Forward", read=read,
                                   write=[p.dst for p in request.copies] + [b for q in request.sequences
                                                                             for b in self._slot_blocks(q.slot_mapping)]))
        from worker.model import StepSequence

        sequences = [StepSequence(list(q.token_ids), q.start_position, list(q.block_table), list(q.slot_mapping),
                                  q.sampling.temperature, q.sampling.seed, q.sampling.top_p or 1.0,
                                  q.sampling.top_k) for q in request.sequences]
        extras = _extra_samples(request, sequences)       # checked before anything changes
        result = self.runner.step([(p.src, p.dst) for p in request.copies], sequences)
        reply = pb.ForwardResponse(next_tokens=result.next_tokens)
        for i, draws in extras:
            reply.extra_tokens.extend(self.runner.sample(result.logits[i:i + 1].expand(len(draws), -1), draws))
        if request.return_logits:
            reply.logits.CopyFrom(tensors.encode(result.logits))
        return reply


MAX_EXTRA_SAMPLES = 256
#: Orders in one MoveBlocks call at most.
MAX_MOVES = 65_536


def _extra_samples(request: pb.ForwardRequest, sequences: list) -> list[tuple[int, list]]:
    """Each sequence's extra draws from its last position, as steps that differ only in
    their sampling (same context length, hence the same seeding rule)."""
    from worker.model import check_sampling

    out = []
    for i, (q, seq) in enumerate(zip(request.sequences, sequences)):
        if not q.extra_samples:
            continue
        if len(q.extra_samples) > MAX_EXTRA_SAMPLES:
            raise errors.InvalidArgument(f"sequences[{i}]: {len(q.extra_samples)} extra_samples, at most "
                                         f"{MAX_EXTRA_SAMPLES}")
        draws = []
        for j, params in enumerate(q.extra_samples):
            draw = dataclasses.replace(seq, temperature=params.temperature, seed=params.seed,
                                       top_p=params.top_p or 1.0, top_k=params.top_k)
            check_sampling(draw, f"sequences[{i}].extra_samples[{j}]")
            draws.append(draw)
        out.append((i, draws))
    return out
