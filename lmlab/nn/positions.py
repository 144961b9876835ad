"""Positional information (config group `model/position`).

A position module is shared by all layers and has three hooks, each a no-op unless the scheme
needs it: `embed` adds to the token embeddings (absolute schemes), `rotate` transforms queries
and keys inside attention (RoPE), and `attn_bias` adds to the attention scores (ALiBi).
Entries are built as `Cls(max_seq_len, d_model, head_dim, n_heads, cfg=Config)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.registry import Registry

POSITIONS = Registry("position", group="model/position", doc="positional encodings")


class PositionEncoding(nn.Module):
    def __init__(self, max_seq_len: int):
        super().__init__()
        self.max_seq_len = max_seq_len

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, d_model); positions: (seq,), or (batch, seq) when each sequence has its own."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (batch, heads, seq, head_dim); positions: (seq,) or (batch, seq)."""
        return q, k

    def attn_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor | None:
        """Added to the attention scores: (heads, q_len, k_len), or (batch, heads, q_len, k_len) for
        positions of shape (batch, len); or None."""
        return None


@POSITIONS.register("nope")
class NoPE(PositionEncoding):
    """No positional information: causal masking alone tells tokens apart (NoPE)."""

    def __init__(self, max_seq_len: int, d_model: int, head_dim: int, n_heads: int, cfg=None):
        super().__init__(max_seq_len)


def _rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # feature i pairs with i + head_dim/2 (Hugging Face Llama)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]  # feature 2i pairs with 2i + 1 (the RoFormer paper, Meta's Llama code)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


ROPE_LAYOUTS = {"half": _rotate_half_split, "interleaved": _rotate_interleaved}


@POSITIONS.register("rope")
class RoPE(PositionEncoding):
    """Rotary embeddings: rotate query/key feature pairs by position-dependent angles."""

    @dataclass
    class Config:
        theta: float = 10000.0
        layout: str = "half"  # half: pair i with i + d/2 (HF Llama); interleaved: pair 2i with 2i + 1

    def __init__(self, max_seq_len: int, d_model: int, head_dim: int, n_heads: int, cfg: Config):
        super().__init__(max_seq_len)
        if head_dim % 2:
            raise ConfigError(f"position=rope needs an even head dim, but model.d_model / attention.n_heads = {head_dim}")
        if cfg.layout not in ROPE_LAYOUTS:
            raise ConfigError(f"model.position.layout={cfg.layout!r}; choose one of {sorted(ROPE_LAYOUTS)}")
        self.theta, self.layout = cfg.theta, cfg.layout
        self._rotate = ROPE_LAYOUTS[cfg.layout]
        inv_freq = cfg.theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (seq, head_dim/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def rotate(self, q, k, positions):
        cos, sin = self.cos[positions].to(q.dtype), self.sin[positions].to(q.dtype)
        if positions.dim() == 2:  # per-sequence positions (generation): broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


@POSITIONS.register("learned")
class LearnedPosition(PositionEncoding):
    """Learned absolute position embeddings added to the token embeddings (GPT-2)."""

    @dataclass
    class Config:
        init_std: float = 0.02

    def __init__(self, max_seq_len: int, d_model: int, head_dim: int, n_heads: int, cfg: Config):
        super().__init__(max_seq_len)
        self.embed_positions = nn.Embedding(max_seq_len, d_model)
        nn.init.normal_(self.embed_positions.weight, std=cfg.init_std)

    def embed(self, x, positions):
        return x + self.embed_positions(positions)


@POSITIONS.register("sinusoidal")
class SinusoidalPosition(PositionEncoding):
    """Fixed sine/cosine absolute positions added to the embeddings (the original Transformer)."""

    @dataclass
    class Config:
        base: float = 10000.0

    def __init__(self, max_seq_len: int, d_model: int, head_dim: int, n_heads: int, cfg: Config):
        super().__init__(max_seq_len)
        freq = cfg.base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freq)
        table = torch.zeros(max_seq_len, d_model, dtype=torch.float64)
        table[:, 0::2] = angles.sin()
        table[:, 1::2] = angles.cos()[:, : d_model // 2]
        self.register_buffer("table", table.float(), persistent=False)

    def embed(self, x, positions):
        return x + self.table[positions].to(x.dtype)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Head slopes 2^(-8h/n); for n not a power of two, the next power's odd-indexed slopes fill in (ALiBi paper)."""
    def geometric(n: int) -> list[float]:
        return [2 ** (-8 * (h + 1) / n) for h in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(closest) + geometric(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes)


@POSITIONS.register("alibi")
class ALiBi(PositionEncoding):
    """Attention with linear biases: each head penalises scores by slope * distance (no embeddings)."""

    def __init__(self, max_seq_len: int, d_model: int, head_dim: int, n_heads: int, cfg=None):
        super().__init__(max_seq_len)
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def use_kernels(self, ops) -> str | None:
        # The attention layers see the bias only at run time and then fall back to SDPA; say so once.
        if ops.attention is not None:
            return "ALiBi adds a score bias the fused attention has no input for: attention stays on SDPA"
        return None

    def attn_bias(self, q_positions, k_positions):
        distance = (q_positions[..., :, None] - k_positions[..., None, :]).clamp_min(0)  # future keys are masked anyway
        return -self.slopes[:, None, None] * distance[..., None, :, :]
