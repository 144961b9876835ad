"""Top-k sparse attention with a lightning indexer (DeepSeek Sparse Attention, DeepSeek-V3.2).

A small indexer scores every past token for each query, and the query attends only to the
`top_k` tokens it scores highest. With index heads j = 1..H_I of width d_I,

    I[t, s] = sum_j w[t, j] * relu(qI[t, j] . kI[s])          (s a candidate of t)
    S_t     = the min(top_k, |candidates of t|) candidates with the largest I[t, s]
    y_t     = sum_{s in S_t} softmax_{s in S_t}(q_t . k_s / sqrt(d)) v_s   (per head, as in MHA)

with qI = index_q_proj(x) (H_I queries per token), kI = index_k_proj(x) (one key per token,
shared by the index heads) and w = index_weights(x) (a weight per index head). Candidates are
the keys causal attention allows: s <= t, within the window and the document where those apply.
The queries, keys and values, GQA, QK-norm, RoPE, ALiBi and soft-capping are MultiHeadAttention's.
The indexer rotates qI and kI with its own RoPE (theta 1e4, whatever the model's position scheme;
the shared one is sized for the heads' width), so I[t, s] sees the distance t - s: it can prefer
recent tokens, and two equal hidden states at different places never tie.

Training the indexer. The selection has no gradient, so the main loss never reaches the indexer.
It gets its own loss: the KL divergence, over the selected keys, from the main attention's
distribution (summed over heads, L1-normalised, detached) to softmax(I):

    p_t = sum_h P_h[t, S_t] / n_heads,   L_I = mean_t KL(p_t || softmax(I[t, S_t]))

set after each forward as `losses["indexer_kl_loss"]` with its weight in `loss_weights`, as
MoELayer does for its router losses. Gradients of L_I also reach the layer's input.

Implementation: each query's selected keys and values are gathered, (batch, kv_heads, seq, k,
head_dim), and attention runs over those k only, so the main attention never forms seq x seq
scores: memory and compute grow with k, not with the sequence. The indexer forms its seq x seq
scores, as it must to rank every candidate. Ties (relu makes exact zeros common) go to the
earlier key through a stable sort, so a KV cache that sees the same scores picks the same keys.
With top_k >= seq_len every candidate is kept and the layer computes dense causal attention
(gathering all keys then costs seq x seq x head_dim memory: fine for checks, wasteful for use).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION, MultiHeadAttention, attention_mask
from lmlab.nn.positions import ROPE_LAYOUTS, PositionEncoding

INDEX_ROPE_THETA = 10000.0


def select_top_k(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (b, s, min(k, keys)) of each query's highest-scoring allowed keys, and which of them are
    allowed (a query with fewer than k candidates fills its row with disallowed keys).
    scores (b, s, keys); allowed broadcasts to it. Equal scores go to the earlier key."""
    ranked = scores.masked_fill(~allowed, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
    index = ranked[..., :k]
    return index, allowed.expand_as(scores).gather(-1, index)


def rotate_by_position(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE (half-split pairs) on t (b, s, ..., d) at positions (s,) or (b, s)."""
    d = t.shape[-1]
    inv_freq = INDEX_ROPE_THETA ** (-torch.arange(0, d, 2, device=t.device, dtype=torch.float32) / d)
    angles = (positions[..., None].float() * inv_freq).reshape(*positions.shape, *[1] * (t.dim() - 3), d // 2)
    return ROPE_LAYOUTS["half"](t, angles.cos().to(t.dtype), angles.sin().to(t.dtype))


def _gather_keys(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(b, heads, keys, d) at each query's selected keys index (b, s, k) -> (b, heads, s, k, d)."""
    rows = torch.arange(t.shape[0], device=t.device)[:, None, None]
    return rearrange(t[rows, :, index], "b s k h d -> b h s k d")


def indexer_kl(selected_scores: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """mean over queries of KL(p || softmax(I)) over each query's valid selected keys, where p is the attention
    `probs` (b, kv_heads, groups, s, k) summed over heads and normalised, without gradient."""
    target = probs.detach().sum(dim=(1, 2))
    target = target / target.sum(dim=-1, keepdim=True)
    log_q = selected_scores.float().masked_fill(~valid, float("-inf")).log_softmax(dim=-1).masked_fill(~valid, 0.0)
    return (torch.xlogy(target, target) - target * log_q).sum(dim=-1).mean()


@ATTENTION.register("topk_sparse")
class TopKSparseAttention(MultiHeadAttention):
    """Causal attention over each query's top-k past tokens, chosen by a lightning indexer (DeepSeek-V3.2's DSA)."""

    supports_documents = True  # candidates come from the block-diagonal causal mask of packed documents

    @dataclass
    class Config(MultiHeadAttention.Config):
        top_k: int = 8  # keys each query attends to (fewer while it has fewer past tokens)
        index_heads: int = 2  # indexer query heads H_I
        index_dim: int = 16  # width d_I of the index queries and of the one index key per token
        indexer_loss_weight: float = 1.0  # weight of the indexer's KL loss in the training loss

    def __init__(self, d_model: int, cfg: Config, layer_idx: int = 0):
        super().__init__(d_model, cfg, layer_idx)
        at_least("attention", cfg, 1, "top_k", "index_heads", "index_dim")
        at_least("attention", cfg, 0, "indexer_loss_weight")
        if not cfg.causal:
            raise ConfigError("topk_sparse attention picks each query's past keys; causal=false is for mha")
        if cfg.index_dim % 2:
            raise ConfigError(f"attention.index_dim={cfg.index_dim} must be even (the indexer's RoPE turns "
                              "feature pairs)")
        self.top_k = cfg.top_k
        self.index_dim = cfg.index_dim
        self.index_q_proj = nn.Linear(d_model, cfg.index_heads * cfg.index_dim, bias=False)
        self.index_k_proj = nn.Linear(d_model, cfg.index_dim, bias=False)
        self.index_weights = nn.Linear(d_model, cfg.index_heads, bias=False)
        self.loss_weights = {"indexer_kl_loss": cfg.indexer_loss_weight}
        self.losses: dict[str, torch.Tensor] = {}

    def score_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward (x3): the main QK^T and AV over min(top_k, keys) keys, 12 * d_attn * that, plus the
        indexer's qI . kI over every key, 6 * index_heads * index_dim * keys (its backward is computed densely
        too). keys = seq_len, capped by the window. The relu and the per-head weighting are not counted."""
        keys = seq_len if self.window is None else min(seq_len, self.window)
        index_width = self.index_q_proj.out_features
        return 12 * self.n_heads * self.head_dim * min(self.top_k, keys) + 6 * index_width * keys

    def kv_cache_elements_per_token(self) -> int:
        return super().kv_cache_elements_per_token() + self.index_dim

    def use_kernels(self, ops) -> str | None:
        if ops.attention is None:
            return None
        return "topk_sparse attention keeps its gathered PyTorch path: the fused causal kernel attends to every key"

    def index_keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """kI (b, s, index_dim), rotated: what a KV cache keeps for the indexer."""
        return rotate_by_position(self.index_k_proj(x), positions)

    def index_scores(self, x: torch.Tensor, positions: torch.Tensor, index_keys: torch.Tensor) -> torch.Tensor:
        """I (b, s, keys) of the queries x (b, s, d_model) at `positions` over index keys (b, keys, index_dim)."""
        q = rearrange(self.index_q_proj(x), "b s (j d) -> b s j d", d=self.index_dim)
        q = rotate_by_position(q, positions)
        per_head = torch.einsum("bsjd,bkd->bsjk", q, index_keys).relu()
        return torch.einsum("bsj,bsjk->bsk", self.index_weights(x), per_head)

    def attend_selected(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
                        valid: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q (b, heads, s, d) over the keys/values (b, kv_heads, keys, d) that index (b, s, k)
        selects, those not `valid` masked; bias (heads or b x heads, s, keys) or None. Returns the output after
        o_proj (b, s, d_model) and the attention probabilities before dropout (b, kv_heads, groups, s, k)."""
        b, heads, s, _ = q.shape
        kv_heads = keys.shape[1]  # query heads share kv heads in groups, as SDPA's enable_gqa pairs them
        q = rearrange(q, "b (n g) s d -> b n g s d", n=kv_heads)
        k_sel, v_sel = _gather_keys(keys, index), _gather_keys(values, index)
        scores = torch.einsum("bngsd,bnskd->bngsk", q, k_sel).float() * (self.score_scale or self.head_dim ** -0.5)
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if bias is not None:
            picked = bias.expand(b, heads, s, -1).gather(-1, index[:, None].expand(-1, heads, -1, -1))
            scores = scores + rearrange(picked, "b (n g) s k -> b n g s k", n=kv_heads)
        probs = scores.masked_fill(~valid[:, None, None], float("-inf")).softmax(dim=-1)
        weights = F.dropout(probs, self.dropout, self.training).to(v_sel.dtype)
        out = torch.einsum("bngsk,bnskd->bngsd", weights, v_sel)
        return self.o_proj(rearrange(out, "b n g s d -> b s (n g d)")), probs

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, position, positions)
        seq = x.shape[1]
        allowed = attention_mask(positions, positions, self.window, None).isfinite().reshape(-1, seq, seq)
        scores = self.index_scores(x, positions, self.index_keys(x, positions))
        index, valid = select_top_k(scores, allowed, self.top_k)
        out, probs = self.attend_selected(q, k, v, index, valid, position.attn_bias(positions, positions))
        self.losses = {"indexer_kl_loss": indexer_kl(scores.gather(-1, index), probs, valid)}
        return out

