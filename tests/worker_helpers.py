"""A worker server in a thread, and K/V test data."""

from __future__ import annotations

from typing import Any

import torch

from helpers import LoopThread
from worker.fence import LeaseFence
from worker.metrics import WorkerMetrics
from worker.pool import KVPool, PoolShape
from worker.server import create_server, set_serving


class WorkerThread(LoopThread):
    """A real grpc.aio worker server on 127.0.0.1:0 with a standalone pool (epoch 1).

    With ``model`` (a ``worker.llama.Llama``), the worker serves it with ``Forward``; the
    pool's layers, KV heads and head dim must then be the model's (``model_shape``).
    ``fence``: the dead leases (and generation) whose writes it refuses; ``metrics``: keep
    its metrics in ``self.metrics`` (a registry to read, no HTTP server).
    """

    def __init__(self, shape: PoolShape, pool_id: str = "w0", model: Any = None, model_name: str = "",
                 model_seed: int = 0, fence: LeaseFence | None = None, metrics: bool = False) -> None:
        super().__init__()
        self.pool = KVPool(shape, torch.device("cpu"))
        self.pool.epoch = 1
        self.pool_id = pool_id
        self.runner = None
        if model is not None:
            from worker.model import ModelRunner
            self.runner = ModelRunner(model, self.pool, model_name, model_seed)
        self.fence = fence
        self.metrics = WorkerMetrics(pool_id, self.pool, self.runner, fence) if metrics else None

    async def serve(self) -> None:
        self.server, self.port, health = await create_server(self.pool, self.pool_id, "127.0.0.1:0",
                                                             runner=self.runner, metrics=self.metrics,
                                                             fence=self.fence)
        await set_serving(health, True)
        await self.server.start()

    async def shutdown(self) -> None:
        await self.server.stop(grace=0.5)


def transformers_twin(model: Any) -> Any:
    """transformers' ``LlamaForCausalLM`` with the weights of ``model`` (a ``worker.llama.Llama``,
    as ``build_model`` gives it), float32, eval mode, its attention PyTorch's sdpa: the
    reference a worker's answers are checked against."""
    from transformers import LlamaConfig, LlamaForCausalLM

    twin = LlamaForCausalLM(LlamaConfig(**model.config.to_dict(), attn_implementation="sdpa")).float()
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def model_shape(model: Any, num_blocks: int, block_size: int) -> PoolShape:
    """The pool geometry that fits ``model`` (a ``worker.llama.Llama``)."""
    cfg = model.config
    return PoolShape(num_blocks, block_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                     model.dtype)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of one sequence's ``q`` ``[q_len, heads, d]`` over its
    contiguous ``k``/``v`` ``[ctx, kv_heads, d]``; the queries are the last positions."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    ctx, q_len = k.shape[0], q.shape[0]
    pos = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
