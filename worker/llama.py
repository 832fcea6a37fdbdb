"""Llama in plain torch: the modules a worker runs, its weights drawn from a seed or read
from a converted model folder (``model.safetensors`` and transformers' ``config.json``).

A worker never runs a whole forward of its own: ``worker.model.ModelRunner`` calls the
modules one by one, with attention over the paged pool. The module tree and parameter
names are transformers' ``LlamaForCausalLM``'s (``model.layers.0.self_attn.q_proj.weight``
...), so a state dict goes either way: the tests build transformers' model from these
weights as their reference. Importing this module costs torch alone (transformers' import
is ~3 s of CPU per worker start).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """A Llama's shape, in transformers' ``LlamaConfig`` names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    @classmethod
    def from_json(cls, path: Path) -> "LlamaConfig":
        """From transformers' ``config.json`` of a Llama.

        Raises:
            ValueError: a model that is not a Llama, or one with a RoPE scaling, biases or
                an activation other than SiLU (none of which these modules have).
        """
        d = json.loads(Path(path).read_text())
        if d.get("model_type") != "llama":
            raise ValueError(f"{path}: model_type {d.get('model_type')!r}, not 'llama'")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"{path}: RoPE type {rope.get('rope_type')!r} (only the default one is supported)")
        if d.get("attention_bias") or d.get("mlp_bias") or d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: biases or an activation other than silu are not supported")
        heads = d["num_attention_heads"]
        return cls(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                   max_position_embeddings=d.get("max_position_embeddings", 4096),
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", d.get("rope_theta", 1e4)),
                   initializer_range=d.get("initializer_range", 0.02),
                   tie_word_embeddings=d.get("tie_word_embeddings", False))

    def to_dict(self) -> dict:
        """The fields, as keyword arguments of transformers' ``LlamaConfig``."""
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE's cos and sin for positions (the default rotation, no scaling)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids`` ``[batch, T]`` -> cos, sin ``[batch, T, head_dim]`` in ``x``'s dtype."""
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` rotated by their positions' angles (``cos``/``sin`` broadcast over the
    heads at ``unsqueeze_dim``)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    """The attention's projections (the attention itself is the pool's)."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.scaling = c.head_dim ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c)


class Llama(nn.Module):
    """The decoder (``model``) and its head (``lm_head``, the embedding's weight when tied)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype


def seeded(config: LlamaConfig, seed: int) -> Llama:
    """A Llama whose weights are drawn from ``seed`` (float32, CPU, eval mode): every matrix
    and embedding from N(0, ``initializer_range``) in parameter order, norms at one. The
    same ``(config, seed)`` gives bit-identical weights in any process."""
    model = Llama(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, config.initializer_range, generator=generator)
    return model.eval()


def from_folder(folder: Path) -> Llama:
    """The Llama of a converted model folder (``config.json``, ``model.safetensors``),
    float32, CPU, eval mode.

    Raises:
        ValueError: a weight missing or one the modules do not have.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    model = Llama(LlamaConfig.from_json(folder / "config.json"))
    state = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise ValueError(f"{folder}: weights missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    return model.eval()
