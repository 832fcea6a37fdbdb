"""A real decoder on the worker: Llama presets and one paged step for a batch.

``build_model`` draws a preset's weights from a seed (nothing is downloaded), so the
same ``(name, seed)`` gives bit-identical weights in any process. ``ModelRunner`` runs
one step for a batch of sequences, prefill and decode mixed, with the model's own
modules and weights but with attention over the pool's paged K/V: for every layer the
new tokens' K (after RoPE) and V are written into their slots, then each new token
attends causally over its sequence's block table.

Sampling: temperature 0 is greedy (argmax, the lowest id on a tie). Otherwise the token
at position ``p`` (the context length of the step, i.e. the position it will occupy) is
drawn by ``torch.multinomial`` from ``softmax(logits / temperature)`` computed in
float64, with a CPU ``torch.Generator`` seeded by
``(seed * 1_000_003 + p) % 2**63``. A sequence's tokens therefore depend only on its
own context, seed and temperature, never on what it is batched with: a forked child
with seed ``s`` generates exactly what an independent sequence with seed ``s`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvservice import errors
from worker.llama import Llama, LlamaConfig, apply_rotary_pos_emb, from_folder, seeded
from worker.pool import KVPool, check_block_table

_COMMON = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "initializer_range": 0.1}

#: Model presets by name. ``initializer_range`` 0.1 makes greedy generations of the
#: random weights varied instead of one token repeated.
MODEL_PRESETS: dict[str, LlamaConfig] = {
    "tiny-llama": LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, **_COMMON),
    "small-llama": LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=64, **_COMMON),
    # tiny-llama's weights (the same seed draws the same ones) with a position range of
    # 128k tokens: long contexts on a CPU.
    "tiny-llama-long": LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   **{**_COMMON, "max_position_embeddings": 1 << 17}),
}
MODEL_DTYPE = torch.float32
SEED_MULTIPLIER = 1_000_003


def build_model(name: str, seed: int = 0) -> Llama:
    """A preset with weights drawn from ``seed`` (float32, CPU, eval mode; ``worker.llama.seeded``),
    or a pretrained one (``worker.weights.PRETRAINED``: its own weights, no seed).

    Args:
        name: a key of ``MODEL_PRESETS`` or of ``PRETRAINED``.
        seed: the seed of ``torch.manual_seed`` before the weights are drawn.

    Raises:
        ValueError: for an unknown preset.
    """
    from worker.weights import PRETRAINED, converted

    if name in PRETRAINED:
        return from_folder(converted(name))
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model {name!r} (presets: {', '.join([*MODEL_PRESETS, *PRETRAINED])})")
    return seeded(MODEL_PRESETS[name], seed).to(MODEL_DTYPE)


def sampling_seed(seed: int, position: int) -> int:
    """The generator seed for the token at ``position`` of a sequence sampled with ``seed``."""
    return (seed * SEED_MULTIPLIER + position) % 2**63


@dataclass(slots=True)
class StepSequence:
    """One sequence's part of a step.

    Attributes:
        token_ids: the new tokens (prefill: the uncached part of the prompt; decode: one).
        start_position: position of ``token_ids[0]``; the context after the step is
            ``start_position + len(token_ids)`` tokens.
        block_table: the sequence's physical block ids, logical order.
        slot_mapping: one slot per new token, ``block_id * block_size + offset`` of its
            position in ``block_table``.
        temperature: 0 for greedy, else the softmax temperature.
        seed: the sampling seed (see the module docstring).
        top_p: nucleus sampling (0 or 1: off). top_k: the k most likely tokens (0: off).
    """

    token_ids: list[int]
    start_position: int
    block_table: list[int]
    slot_mapping: list[int]
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def context_len(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass(slots=True)
class ForwardResult:
    """``next_tokens``: one per sequence; ``logits``: float32 ``[num_seqs, vocab]`` of
    each sequence's last new token."""

    next_tokens: list[int]
    logits: torch.Tensor = field(repr=False)


def check_sampling(q: "StepSequence", where: str) -> None:
    """Raises InvalidArgument naming the field unless ``q``'s sampling is valid."""
    t = q.temperature
    if not (math.isfinite(t) and t >= 0):
        raise errors.InvalidArgument(f"{where}.temperature must be finite and >= 0 (0: greedy), got {t}")
    if not (math.isfinite(q.top_p) and 0 <= q.top_p <= 1):
        raise errors.InvalidArgument(f"{where}.top_p must be in [0, 1] (0 or 1: off), got {q.top_p}")
    if q.top_k < 0:
        raise errors.InvalidArgument(f"{where}.top_k must be >= 0 (0: off), got {q.top_k}")


def _truncated(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """``probs`` (float64, one row) with all but the top-k / nucleus tokens zeroed. Ties
    are broken by the lower token id (a stable sort), so the set depends on the row only."""
    if not (0 < top_k < probs.numel()) and not (0 < top_p < 1):
        return probs
    order = torch.sort(probs, descending=True, stable=True).indices
    keep = probs.numel()
    if 0 < top_k < keep:
        keep = top_k
    if 0 < top_p < 1:
        cumulative = torch.cumsum(probs[order], 0)
        # the smallest prefix whose mass reaches top_p (at least one token)
        keep = min(keep, int(torch.searchsorted(cumulative, torch.tensor(top_p, dtype=cumulative.dtype))) + 1)
    out = torch.zeros_like(probs)
    out[order[:keep]] = probs[order[:keep]]
    return out


def weights_in_columns(model: torch.nn.Module) -> None:
    """Stores every linear layer's weight ``[out, in]`` as the transpose of a contiguous
    ``[in, out]`` matrix, in place (the values, the parameters and tied weights are kept).

    A step multiplies a few rows (one per decoding sequence) by each weight; on a CPU the
    BLAS runs ``x @ W`` with ``W`` in ``[in, out]`` order about twice as fast as against
    ``[out, in]`` for 8 to 32 rows (SmolLM2-135M, 12 sequences, one thread: 192 -> 124 ms
    a decode step).
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.is_contiguous():
                module.weight.data = module.weight.data.t().contiguous().t()


class ModelRunner:
    """Runs a Llama model over a worker's paged KV pool.

    Args:
        model: a ``worker.llama.Llama`` (or transformers' ``LlamaForCausalLM``, which has the
            same modules) on the pool's device, in the pool's dtype.
        pool: the KV pool; its geometry must be the model's (layers, KV heads, head
            dim, dtype).
        name: the preset name reported by ``Describe``.
        seed: the seed the weights were drawn with.

    Raises:
        ValueError: when the pool's geometry or device does not fit the model.
    """

    def __init__(self, model: Llama, pool: KVPool, name: str = "", seed: int = 0) -> None:
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        s = pool.shape
        want = (cfg.num_hidden_layers, cfg.num_key_value_heads, self.head_dim, model.dtype)
        have = (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype)
        if want != have:
            raise ValueError(f"pool geometry (layers, kv_heads, head_dim, dtype) = {have} does not fit the "
                             f"model's {want}")
        device = next(model.parameters()).device
        if device != pool.device:
            raise ValueError(f"the model is on {device}, the pool on {pool.device}")
        self.model = model.eval()
        if device.type == "cpu":
            weights_in_columns(model)
        self.pool = pool
        self.name = name
        self.seed = seed
        from worker.weights import source_of, tokenizer_files

        #: Where a pretrained model's weights come from ("" for a seeded preset).
        self.source = source_of(name)
        #: A pretrained model's tokenizer (None: a seeded preset speaks token ids only).
        self.tokenizer = tokenizer_files(name)
        self.max_position_embeddings = getattr(cfg, "max_position_embeddings", 0) or 0
        self.num_parameters = sum(p.numel() for p in model.parameters())
        self.vocab_size = cfg.vocab_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scale = getattr(model.model.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        #: Tokens computed by ``step`` so far (read by the worker's metrics).
        self.num_tokens = 0

    # ------------------------------------------------------------ checks

    def check(self, copies: list[tuple[int, int]], sequences: list[StepSequence]) -> None:
        """Raises InvalidArgument naming the offending value unless the whole step is valid;
        nothing is changed either way."""
        s = self.pool.shape
        self.pool.check_copies(copies, "copies")
        if not sequences:
            raise errors.InvalidArgument("forward needs at least one sequence (sequences is empty)")
        written: dict[int, tuple[int, int]] = {}
        for i, seq in enumerate(sequences):
            n = len(seq.token_ids)
            if n == 0:
                raise errors.InvalidArgument(f"sequences[{i}] has no token_ids: each sequence needs a new token")
            if len(seq.slot_mapping) != n:
                raise errors.InvalidArgument(f"sequences[{i}]: {len(seq.slot_mapping)} slots in slot_mapping for "
                                             f"{n} token_ids (one slot per new token)")
            if seq.start_position < 0:
                raise errors.InvalidArgument(f"sequences[{i}].start_position = {seq.start_position} is negative")
            ctx, table = seq.context_len, seq.block_table
            check_block_table(s, table, ctx, f"sequences[{i}]: context of {ctx} tokens", f"sequences[{i}].block_table")
            for j, tok in enumerate(seq.token_ids):
                if not 0 <= tok < self.vocab_size:
                    raise errors.InvalidArgument(f"sequences[{i}].token_ids[{j}] = {tok} is out of range "
                                                 f"0..{self.vocab_size - 1}")
            for j, slot in enumerate(seq.slot_mapping):
                if not 0 <= slot < s.num_slots:
                    raise errors.InvalidArgument(f"sequences[{i}].slot_mapping[{j}] = {slot} is out of range "
                                                 f"0..{s.num_slots - 1}")
                pos = seq.start_position + j
                expected = table[pos // s.block_size] * s.block_size + pos % s.block_size
                if slot != expected:
                    raise errors.InvalidArgument(f"sequences[{i}].slot_mapping[{j}] = {slot}, but position {pos} "
                                                 f"is slot {expected} of its block table")
                if slot in written:
                    a, b = written[slot]
                    raise errors.InvalidArgument(f"sequences[{i}].slot_mapping[{j}] = {slot} is also "
                                                 f"sequences[{a}].slot_mapping[{b}]: a slot is written once a step")
                written[slot] = (i, j)
            check_sampling(seq, f"sequences[{i}].sampling")

    # ------------------------------------------------------------ the step

    def step(self, copies: list[tuple[int, int]], sequences: list[StepSequence]) -> ForwardResult:
        """Checks the step, applies ``copies`` (copy-on-write, all layers), runs the model
        over the new tokens and samples each sequence's next token."""
        self.check(copies, sequences)
        self.pool.copy(copies)
        logits = self.forward(sequences)
        self.num_tokens += sum(len(seq.token_ids) for seq in sequences)
        return ForwardResult(self.sample(logits, sequences), logits)

    def forward(self, sequences: list[StepSequence]) -> torch.Tensor:
        """The model over the sequences' new tokens, writing their K/V into the pool.

        Args:
            sequences: checked steps (``check``); their earlier tokens' K/V are in the pool.

        Returns:
            float32 ``[num_seqs, vocab]``: the logits of each sequence's last new token.
        """
        pool, dev, bs = self.pool, self.pool.device, self.pool.shape.block_size
        lens = [len(q.token_ids) for q in sequences]
        tokens = torch.tensor([t for q in sequences for t in q.token_ids], dtype=torch.long, device=dev)
        positions = torch.tensor([q.start_position + j for q in sequences for j in range(len(q.token_ids))],
                                 dtype=torch.long, device=dev)
        slots = torch.tensor([x for q in sequences for x in q.slot_mapping], dtype=torch.int64, device=dev)
        width = max(math.ceil(q.context_len / bs) for q in sequences)
        tables = torch.zeros((len(sequences), width), dtype=torch.int32)
        for i, q in enumerate(sequences):
            used = math.ceil(q.context_len / bs)
            tables[i, :used] = torch.tensor(q.block_table[:used], dtype=torch.int32)
        tables = tables.to(dev)
        context_lens = torch.tensor([q.context_len for q in sequences], dtype=torch.int32, device=dev)
        starts = torch.zeros(len(sequences) + 1, dtype=torch.int64)
        starts[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
        last = (starts[1:] - 1).to(dev)
        starts = starts.to(torch.int32).to(dev)
        num_tokens = tokens.shape[0]

        with torch.inference_mode():
            inner = self.model.model
            x = inner.embed_tokens(tokens)                                   # [T, hidden]
            cos, sin = inner.rotary_emb(x, positions[None])                  # [1, T, head_dim] each
            cos, sin = cos[0], sin[0]
            for layer_idx, layer in enumerate(inner.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q = attn.q_proj(h).view(num_tokens, self.num_heads, self.head_dim)
                k = attn.k_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim)
                v = attn.v_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim)
                q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # [T, heads, head_dim]
                pool.backend.reshape_and_cache(k.contiguous(), v.contiguous(), pool.k_caches[layer_idx],
                                               pool.v_caches[layer_idx], slots)
                out = pool.backend.paged_attention(q.contiguous(), pool.k_caches[layer_idx],
                                                   pool.v_caches[layer_idx], tables, context_lens, starts,
                                                   self.scale)              # [T, heads, head_dim]
                x = x + attn.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            h = inner.norm(x[last])                                          # [num_seqs, hidden]
            return self.model.lm_head(h).float()

    @staticmethod
    def sample(logits: torch.Tensor, sequences: list[StepSequence]) -> list[int]:
        """Each sequence's next token from its logits row.

        Args:
            logits: float32 ``[num_seqs, vocab]``.
            sequences: the step's sequences (temperature, seed, context length).

        Returns:
            One token id per sequence: argmax at temperature 0, else a draw seeded by
            ``sampling_seed(seed, context_len)``.
        """
        rows = logits.detach().to("cpu", torch.float64)
        out = []
        for row, q in zip(rows, sequences):
            if q.temperature == 0:
                out.append(int(torch.argmax(row)))
                continue
            probs = torch.softmax(row / q.temperature, dim=-1)
            if not torch.isfinite(probs).all():      # a temperature so small that it overflows
                out.append(int(torch.argmax(row)))
                continue
            probs = _truncated(probs, q.top_p, q.top_k)
            gen = torch.Generator(device="cpu").manual_seed(sampling_seed(q.seed, q.context_len))
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
        return out
