"""Self-attention layers (config group `model/attention`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lmlab.nn.positions import PositionEncoding
from lmlab.errors import ConfigError
from lmlab.registry import Registry

ATTENTION = Registry("attention", group="model/attention", doc="self-attention layers")


@ATTENTION.register("mha")
class MultiHeadAttention(nn.Module):
    """Causal multi-head attention; n_kv_heads < n_heads gives GQA, n_kv_heads=1 gives MQA."""

    @dataclass
    class Config:
        n_heads: int = 4
        n_kv_heads: int | None = None  # None: as many as n_heads (plain MHA)
        dropout: float = 0.0

    def __init__(self, d_model: int, cfg: Config):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        if d_model % self.n_heads:
            raise ConfigError(f"d_model={d_model} is not divisible by attention.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"attention.n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        self.head_dim = d_model // self.n_heads
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d_model, bias=False)

    @staticmethod
    def head_dim_for(d_model: int, cfg: Config) -> int:
        return d_model // cfg.n_heads

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor) -> torch.Tensor:
        q = rearrange(self.q_proj(x), "b s (h d) -> b h s d", h=self.n_heads)
        k = rearrange(self.k_proj(x), "b s (h d) -> b h s d", h=self.n_kv_heads)
        v = rearrange(self.v_proj(x), "b s (h d) -> b h s d", h=self.n_kv_heads)
        q, k = position.rotate(q, k, positions)
        out = F.scaled_dot_product_attention(
            q, k, v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))
