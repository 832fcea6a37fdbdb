"""The Worker gRPC servicer: translates proto <-> pool and checks the epoch."""

from __future__ import annotations

from typing import Any

from kvservice import errors
from kvservice.v1 import allocator_pb2, worker_pb2 as pb, worker_pb2_grpc as pb_grpc
from worker import tensors
from worker.pool import KVPool


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, pool: KVPool, pool_id: str, allocator: str = "") -> None:
        self.pool = pool
        self.pool_id = pool_id
        self.allocator = allocator

    def _check_epoch(self, epoch: int) -> None:
        current = self.pool.epoch
        if current <= 0:
            raise errors.Unavailable(f"pool {self.pool_id} is not registered with the allocator yet")
        if epoch != current:
            raise errors.FailedPrecondition(
                f"request for epoch {epoch}, but pool {self.pool_id} is at epoch {current} "
                f"(the worker restarted or re-registered; its sequences are gone)")

    def _tensor(self, t: pb.Tensor, name: str):
        return tensors.decode(t, name, self.pool.shape.dtype, self.pool.device)

    async def Describe(self, request: pb.DescribeWorkerRequest, context: Any) -> pb.WorkerInfo:
        s = self.pool.shape
        geometry = allocator_pb2.PoolGeometry(num_blocks=s.num_blocks, block_size=s.block_size,
                                              num_layers=s.num_layers, num_kv_heads=s.num_kv_heads,
                                              head_dim=s.head_dim, dtype=tensors.NAMES[s.dtype])
        return pb.WorkerInfo(pool_id=self.pool_id, epoch=max(self.pool.epoch, 0), geometry=geometry,
                             device=str(self.pool.device), backend=self.pool.backend.name,
                             bytes_per_block=s.bytes_per_block, pool_bytes=self.pool.pool_bytes,
                             allocator=self.allocator)

    async def WriteKV(self, request: pb.WriteKVRequest, context: Any) -> pb.WriteKVResponse:
        self._check_epoch(request.epoch)
        n = self.pool.write(request.layer, list(request.slot_mapping), self._tensor(request.key, "key"),
                            self._tensor(request.value, "value"))
        return pb.WriteKVResponse(num_written=n)

    async def ReadKV(self, request: pb.ReadKVRequest, context: Any) -> pb.ReadKVResponse:
        self._check_epoch(request.epoch)
        k, v = self.pool.read(request.layer, list(request.slots))
        return pb.ReadKVResponse(key=tensors.encode(k), value=tensors.encode(v))

    async def Attention(self, request: pb.AttentionRequest, context: Any) -> pb.AttentionResponse:
        self._check_epoch(request.epoch)
        out = self.pool.attention(request.layer, self._tensor(request.query, "query"),
                                  [list(t.block_ids) for t in request.block_tables], list(request.context_lens),
                                  list(request.query_lens), request.scale, request.num_splits)
        return pb.AttentionResponse(output=tensors.encode(out))

    async def CopyBlocks(self, request: pb.CopyBlocksRequest, context: Any) -> pb.CopyBlocksResponse:
        self._check_epoch(request.epoch)
        return pb.CopyBlocksResponse(num_copied=self.pool.copy([(p.src, p.dst) for p in request.pairs]))
