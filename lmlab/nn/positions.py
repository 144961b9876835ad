"""Positional information (config group `model/position`).

A position module is shared by all layers and has two hooks, each the identity unless the
scheme needs it: `embed` adds to the token embeddings (absolute schemes) and `rotate`
transforms queries and keys inside attention (relative schemes such as RoPE).
"""

from __future__ import annotations

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
        """x: (batch, seq, d_model); positions: (seq,)."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (batch, heads, seq, head_dim); positions: (seq,)."""
        return q, k


@POSITIONS.register("rope")
class RoPE(PositionEncoding):
    """Rotary embeddings: rotate query/key feature pairs by position-dependent angles."""

    @dataclass
    class Config:
        theta: float = 10000.0

    def __init__(self, max_seq_len: int, d_model: int, head_dim: int, cfg: Config):
        super().__init__(max_seq_len)
        if head_dim % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got {head_dim}")
        inv_freq = cfg.theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        # Half-split layout (as in Hugging Face Llama): pair feature i with i + head_dim/2.
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def rotate(self, q, k, positions):
        cos = self.cos[positions].to(q.dtype)
        sin = self.sin[positions].to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@POSITIONS.register("learned")
class LearnedPosition(PositionEncoding):
    """Learned absolute position embeddings added to the token embeddings (GPT-2)."""

    @dataclass
    class Config:
        init_std: float = 0.02

    def __init__(self, max_seq_len: int, d_model: int, head_dim: int, cfg: Config):
        super().__init__(max_seq_len)
        self.embed_positions = nn.Embedding(max_seq_len, d_model)
        nn.init.normal_(self.embed_positions.weight, std=cfg.init_std)

    def embed(self, x, positions):
        return x + self.embed_positions(positions)
