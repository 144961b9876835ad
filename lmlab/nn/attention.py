"""Self-attention layers (config group `model/attention`).

Entries are built as `Cls(d_model, cfg=Config, layer_idx=i)` and called as
`attn(x, position, positions)`; the shared position module supplies RoPE rotations and ALiBi
biases. `shape_for(d_model, cfg)` gives (head_dim, n_heads) before a layer exists, so the
position module can be sized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.fused import fused_outputs
from lmlab.nn.norms import NORMS
from lmlab.nn.positions import PositionEncoding
from lmlab.registry import Registry

ATTENTION = Registry("attention", group="model/attention", doc="self-attention layers")


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """Additive mask: causal, optionally only the last `window` keys, plus a per-head bias.

    Positions (seq,) are shared by the batch. Positions (batch, seq) are packed documents, each
    restarting at 0: a query sees the earlier keys of its own document only, (batch, 1, seq, seq)."""
    offset = q_pos[..., :, None] - k_pos[..., None, :]
    allowed = offset >= 0
    if window is not None:
        allowed &= offset < window
    if q_pos.dim() == 2:
        index = torch.arange(q_pos.shape[-1], device=q_pos.device)
        # Positions rise by one within a document, so keys i - n of the same document are at offset n.
        allowed = (allowed & (offset == index[:, None] - index[None, :]))[:, None]  # (batch, heads, q, k)
    mask = torch.zeros(allowed.shape, device=q_pos.device).masked_fill(~allowed, float("-inf"))
    return mask if bias is None else bias + mask


def softcapped_attention(q, k, v, mask: torch.Tensor | None, cap: float, scale: float | None = None,
                         causal: bool = True) -> torch.Tensor:
    """Attention whose scores are squashed by cap * tanh(s / cap) before the softmax (Gemma 2).

    Written out because the fused kernels have no hook between the scores and the softmax.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)).float() * (scale or q.shape[-1] ** -0.5)
    scores = cap * torch.tanh(scores / cap)
    if mask is None and causal:
        mask = attention_mask(torch.arange(q.shape[2], device=q.device), torch.arange(k.shape[2], device=q.device),
                              None, None)
    scores = scores if mask is None else scores + mask
    return scores.softmax(dim=-1).to(v.dtype) @ v


@ATTENTION.register("mha")
class MultiHeadAttention(nn.Module):
    """Multi-head attention, causal unless causal=false; n_kv_heads < n_heads gives GQA, n_kv_heads=1 gives MQA."""

    fusable_projections = ("q_proj", "k_proj", "v_proj")  # read the same input (lmlab.nn.fused)
    supports_documents = True  # packed documents (positions (batch, seq)) get a block-diagonal causal mask

    @dataclass
    class Config:
        n_heads: int = 4
        n_kv_heads: int | None = None  # None: as many as n_heads (plain MHA)
        dropout: float = 0.0
        window: int | None = None  # sliding window: attend to the last `window` tokens only
        global_every: int | None = None  # with a window: every k-th layer attends globally (k=2 alternates)
        qk_norm: bool = False  # RMSNorm on each head's queries and keys before RoPE
        softcap: float | None = None  # squash scores with softcap * tanh(score / softcap)
        causal: bool = True  # false: every token attends to every token (an encoder's, e.g. a ViT's; no KV cache)

    def __init__(self, d_model: int, cfg: Config, layer_idx: int = 0):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        if d_model % self.n_heads:
            raise ConfigError(f"model.d_model={d_model} is not divisible by attention.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"attention.n_heads={self.n_heads} is not divisible by attention.n_kv_heads={self.n_kv_heads}")
        if cfg.global_every is not None and cfg.window is None:
            raise ConfigError("attention.global_every needs attention.window (the local layers' window)")
        if not cfg.causal and cfg.window is not None:
            raise ConfigError("attention.window is a causal sliding window; set attention.causal=true or window=null")
        self.causal = cfg.causal
        self.head_dim = d_model // self.n_heads
        self.dropout = cfg.dropout
        is_global = cfg.global_every is not None and (layer_idx + 1) % cfg.global_every == 0
        self.window = None if is_global else cfg.window
        self.softcap = cfg.softcap
        self.score_scale: float | None = None  # None: 1/sqrt(head_dim); muP sets its own
        self.q_proj = nn.Linear(d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d_model, bias=False)
        self.kernel = None  # a fused causal attention(q, k, v, causal, scale) from `kernels=`; None: SDPA
        self.kv_source: MultiHeadAttention | None = None  # CLA: the layer whose keys and values this one reads
        self.shares_kv = False  # CLA: later layers read this layer's keys and values (`shared_kv`)
        if cfg.qk_norm:
            self.q_norm = NORMS.build("rmsnorm", self.head_dim)
            self.k_norm = NORMS.build("rmsnorm", self.head_dim)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    @staticmethod
    def shape_for(d_model: int, cfg: Config) -> tuple[int, int]:
        return d_model // cfg.n_heads, cfg.n_heads

    def set_score_scale(self, scale: float) -> None:
        self.score_scale = scale

    def score_flops_per_token(self, seq_len: int) -> float:
        """QK^T and AV, forward and backward: 12 * d_attn * (keys attended), keys capped by the window."""
        keys = seq_len if self.window is None else min(seq_len, self.window)
        return 12 * self.n_heads * self.head_dim * keys

    def kv_cache_elements_per_token(self) -> int:
        return 0 if self.kv_source is not None else 2 * self.n_kv_heads * self.head_dim

    def share_kv_with(self, source: MultiHeadAttention) -> None:
        """Cross-layer attention (CLA, Brandon et al. 2024): attend over `source`'s keys and values (normed and
        rotated) instead of projecting this layer's own, so the pair caches one K/V. Its K/V projections go."""
        mine, theirs = (self.n_kv_heads, self.head_dim, self.window), (
            getattr(source, "n_kv_heads", None), getattr(source, "head_dim", None), getattr(source, "window", None))
        if not isinstance(source, MultiHeadAttention) or source.kv_source is not None or mine != theirs:
            raise ConfigError(f"model.kv_share: a layer can reuse the keys and values of an earlier mha layer with the "
                              f"same (n_kv_heads, head_dim, window) = {mine}; its group's first layer is "
                              f"{type(source).__name__} with {theirs}")
        del self.k_proj, self.v_proj, self.k_norm
        self.fusable_projections = ("q_proj",)
        self.__dict__["kv_source"] = source  # a plain reference, not a submodule: the parameters stay the source's
        source.shares_kv = True

    def use_kernels(self, ops) -> str | None:
        """Take the fused attention where it computes what this layer needs; else say why not."""
        if ops.attention is None:
            return None
        if self.head_dim not in ops.attention_head_dims:
            raise ConfigError(f"kernels.attention: head_dim {self.head_dim} (d_model / n_heads) is not supported by the "
                              f"fused attention; supported: {', '.join(map(str, ops.attention_head_dims))} "
                              "(or set kernels.attention=false)")
        unsupported = {"a sliding window": self.window is not None, "soft-capped scores": self.softcap is not None,
                       "attention dropout": self.dropout > 0}
        missing = [what for what, used in unsupported.items() if used]
        if missing:
            return f"attention keeps SDPA where the fused kernel has no {' or '.join(missing)}"
        self.kernel = ops.attention
        return None

    def check_context(self, context_length: int) -> None:
        if self.window is not None and self.window > context_length:
            raise ConfigError(f"attention.window={self.window} is larger than data.context_length={context_length}; "
                              "a window that covers the whole context is plain global attention")

    def project(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor):
        """Queries (b, n_heads, s, d), keys and values (b, n_kv_heads, s, d), normed and rotated; a KV cache
        (generation) stores the keys and values."""
        return self.rotated(*self.unrotated(x), position, positions)

    def rotated(self, q, k, v, position: PositionEncoding, positions: torch.Tensor):
        """project's second half: `unrotated`'s outputs rotated (a CLA layer's keys and values are its source's)."""
        if self.kv_source is not None:  # CLA: the group's first layer ran just before, on the same tokens
            k, v = self.kv_source.shared_kv
            return position.rotate(q, k[:, :0], positions)[0], k, v  # (no keys of its own to rotate)
        q, k = position.rotate(q, k, positions)
        if self.shares_kv:
            self.shared_kv = (k, v)
        return q, k, v

    def unrotated(self, x: torch.Tensor):
        """project's queries, keys and values before the rotation (keys and values None for a CLA layer, which has
        none of its own); a decode kernel that rotates them itself takes these."""
        fused = fused_outputs(self, x)  # one matmul for q, k and v where an inference engine fused them
        q, *kv = (fused[name] if fused else getattr(self, name)(x) for name in self.fusable_projections)
        # heads counted from head_dim: under tensor parallelism a rank holds only some of them
        q = self.q_norm(rearrange(q, "b s (h d) -> b h s d", d=self.head_dim))
        if not kv:
            return q, None, None
        k = self.k_norm(rearrange(kv[0], "b s (h d) -> b h s d", d=self.head_dim))
        return q, k, rearrange(kv[1], "b s (h d) -> b h s d", d=self.head_dim)

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, position, positions)
        bias = position.attn_bias(positions, positions)
        if self.kernel is not None and bias is None and positions.dim() == 1:
            out = self.kernel(q, k, v, self.causal, self.score_scale)
        else:
            out = self._reference_attention(q, k, v, positions, bias)
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))

    def _reference_attention(self, q, k, v, positions: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """SDPA (or the soft-capped scores written out) with the window and position bias as a mask."""
        mask = None
        if not self.causal:
            if positions.dim() == 2:
                raise ValueError("packed documents (positions (batch, seq)) need causal attention; "
                                 "give a bidirectional (causal=false) layer one sequence per row")
            mask = None if bias is None else bias.to(q.dtype)
        elif self.window is not None or bias is not None or positions.dim() == 2:
            mask = attention_mask(positions, positions, self.window, bias).to(q.dtype)
        if self.softcap is not None:
            return softcapped_attention(q, k, v, mask, self.softcap, self.score_scale, self.causal)
        return F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            is_causal=self.causal and mask is None,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.score_scale,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
