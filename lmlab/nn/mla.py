"""Multi-head latent attention (DeepSeek-V2), an entry of the `model/attention` group.

Keys and values are up-projected from one low-rank latent per token, so an inference cache
holds only that latent plus one small rotary key shared by all heads. RoPE on keys taken from
the latent would put a position-dependent rotation between the query and the key
up-projection, which then could no longer be folded into the query projection at inference;
so each head's query and key are split into a "nope" part (keys from the latent) and a small
"rope" part that alone is rotated: the decoupled RoPE.

Parameter names follow Hugging Face's DeepSeek-V2 (`q_proj` or `q_a_proj`/`q_a_layernorm`/
`q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`). The rotary
feature layout is whatever the shared position module uses, so converting HF weights needs the
usual permutation of the rope rows when the layouts differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION, attention_mask
from lmlab.nn.norms import NORMS
from lmlab.nn.positions import PositionEncoding


@ATTENTION.register("mla")
class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention (DeepSeek-V2): K/V from a small cached latent, decoupled RoPE."""

    supports_documents = True  # packed documents (positions (batch, seq)) get a block-diagonal causal mask

    @dataclass
    class Config:
        n_heads: int = 4
        kv_lora_rank: int = 64  # width of the cached K/V latent
        q_lora_rank: int | None = None  # None: plain q_proj; else queries also go through a latent of this width
        qk_nope_head_dim: int | None = None  # None: d_model // n_heads
        qk_rope_head_dim: int = 16  # rotated part of each query and of the one shared key
        v_head_dim: int | None = None  # None: d_model // n_heads
        dropout: float = 0.0

    def __init__(self, d_model: int, cfg: Config, layer_idx: int = 0):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.nope_dim, self.v_dim = self._head_dims(d_model, cfg)
        self.rope_dim = cfg.qk_rope_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.dropout = cfg.dropout
        q_out = self.n_heads * self.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, q_out, bias=False)
        else:
            # A query latent saves activation memory in training; it is never cached.
            self.q_a_proj = nn.Linear(d_model, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = NORMS.build("rmsnorm", cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        # One projection makes both cached pieces: the latent and the shared (MQA-like) rope key.
        self.kv_a_proj_with_mqa = nn.Linear(d_model, self.kv_lora_rank + self.rope_dim, bias=False)
        # DeepSeek-V2 normalises the latent, so kv_b_proj sees inputs of a fixed scale.
        self.kv_a_layernorm = NORMS.build("rmsnorm", self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, d_model, bias=False)

    @staticmethod
    def _head_dims(d_model: int, cfg: Config) -> tuple[int, int]:
        """(qk_nope_head_dim, v_head_dim) after defaults; raises ConfigError on values a user set wrong."""
        if cfg.n_heads <= 0:
            raise ConfigError(f"attention.n_heads={cfg.n_heads} must be positive")
        if (cfg.qk_nope_head_dim is None or cfg.v_head_dim is None) and d_model % cfg.n_heads:
            raise ConfigError(f"model.d_model={d_model} is not divisible by attention.n_heads={cfg.n_heads}; "
                              "change one, or set attention.qk_nope_head_dim and attention.v_head_dim explicitly")
        nope = d_model // cfg.n_heads if cfg.qk_nope_head_dim is None else cfg.qk_nope_head_dim
        v = d_model // cfg.n_heads if cfg.v_head_dim is None else cfg.v_head_dim
        sizes = {"kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": nope, "v_head_dim": v,
                 "qk_rope_head_dim": cfg.qk_rope_head_dim}
        if cfg.q_lora_rank is not None:
            sizes["q_lora_rank"] = cfg.q_lora_rank
        for field, value in sizes.items():
            if value <= 0:
                raise ConfigError(f"attention.{field}={value} must be positive")
        # Checked here, not only by RoPE, so the message names MLA's field rather than d_model / n_heads.
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"attention.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even "
                              "(rotary embeddings turn feature pairs)")
        return nope, v

    @staticmethod
    def shape_for(d_model: int, cfg: Config) -> tuple[int, int]:
        # The shared position module rotates only the decoupled rope part, so size it for that.
        MultiHeadLatentAttention._head_dims(d_model, cfg)  # fail on a bad config before RoPE does
        return cfg.qk_rope_head_dim, cfg.n_heads

    def score_flops_per_token(self, seq_len: int) -> float:
        """QK^T (2 * qk_head_dim) plus AV (2 * v_head_dim) per head and key, times 3 for forward +
        backward: 12 * n_heads * (qk_head_dim + v_head_dim) / 2 * seq_len, MHA's formula when the dims match.
        Counts the naive (expanded) form that training runs, not inference's absorbed form."""
        return 12 * self.n_heads * (self.qk_head_dim + self.v_dim) / 2 * seq_len

    def kv_cache_elements_per_token(self) -> int:
        # The point of MLA: only the normalised latent and the one shared rope key are cached;
        # per-head K and V are recomputed (or kv_b_proj absorbed into q_proj/o_proj).
        return self.kv_lora_rank + self.rope_dim

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor) -> torch.Tensor:
        q = rearrange(self._queries(x), "b s (h d) -> b h s d", h=self.n_heads)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)

        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = rearrange(self.kv_b_proj(self.kv_a_layernorm(latent)), "b s (h d) -> b h s d", h=self.n_heads)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)

        # The rope key is one head for all query heads: rotate it once, then broadcast.
        q_rope, k_rope = position.rotate(q_rope, k_rope[:, None], positions)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)

        bias = position.attn_bias(positions, positions)
        documents = positions.dim() == 2
        mask = None if bias is None and not documents else attention_mask(positions, positions, None, bias).to(q.dtype)
        # SDPA allows a value head dim that differs from the query/key head dim.
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.qk_head_dim ** -0.5,
        )
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))
