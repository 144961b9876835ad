"""Causal linear attention (Katharopoulos et al. 2020, "Transformers are RNNs").

The softmax kernel exp(q.k) is replaced by a feature-map dot product phi(q).phi(k) with
phi(x) = elu(x) + 1 (positive, so the normaliser below never changes sign). For query i:

    y_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps),   S_i = sum_{j<=i} phi(k_j) v_j^T,
                                                      z_i = sum_{j<=i} phi(k_j)

Because S_i and z_i are running sums, the same layer has two exact forms:
- parallel (training, `forward`): A = tril(phi(Q) phi(K)^T); Y = A V / (A 1 + eps). This is
  the O(seq^2) masked form; it is exact, simple and fast at the short contexts we train on.
- recurrent (generation, `step`): S += phi(k_t) v_t^T, z += phi(k_t), then y_t as above. The
  state is a fixed (head_dim x head_dim) matrix plus a head_dim vector per head, whatever the
  number of tokens seen: there is no KV cache that grows with the sequence.
There is no 1/sqrt(head_dim) scale (as in the paper). `normalize=False` drops the denominator
(y_i = phi(q_i)^T S_i), which grows with position; it is there for ablations.

Positions: RoPE rotates q and k before the feature map (so it composes, as for softmax
attention); absolute schemes work through the embeddings. ALiBi adds a bias to softmax scores,
which this layer never forms, so the model refuses it when it is built (`check_position`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION
from lmlab.nn.positions import POSITIONS, PositionEncoding

# Feature maps phi; each must be non-negative so the normaliser is a sum of non-negative terms.
FEATURE_MAPS = {
    "elu": lambda x: F.elu(x) + 1,  # Katharopoulos et al.: strictly positive, smooth
    "relu": F.relu,  # sparser; a query orthogonal to all keys falls back to the eps guard
}

State = tuple[torch.Tensor, torch.Tensor]  # S: (batch, heads, head_dim, head_dim), z: (batch, heads, head_dim)


def _no_bias(position: PositionEncoding, pos: torch.Tensor) -> None:
    if position.attn_bias(pos, pos) is not None:
        name = next((e.name for e in POSITIONS if e.target is type(position)), type(position).__name__)
        raise ConfigError(
            f"model/position={name} adds a bias to softmax attention scores, which model/attention=linear never "
            "forms; pick model/position=rope, nope, learned or sinusoidal, or model/attention=mha for ALiBi")


@ATTENTION.register("linear")
class LinearAttention(nn.Module):
    """Causal linear attention with phi(x)=elu(x)+1 (Katharopoulos 2020): parallel for training, recurrent for generation."""

    @dataclass
    class Config:
        n_heads: int = 4
        feature_map: str = "elu"  # elu: elu(x) + 1 (the paper); relu
        normalize: bool = True  # divide by phi(q).sum_j phi(k_j); False only for ablations
        eps: float = 1e-6  # guards the denominator

    def __init__(self, d_model: int, cfg: Config, layer_idx: int = 0):
        super().__init__()
        self.n_heads = cfg.n_heads
        if d_model % self.n_heads:
            raise ConfigError(f"model.d_model={d_model} is not divisible by attention.n_heads={self.n_heads}")
        if cfg.feature_map not in FEATURE_MAPS:
            raise ConfigError(f"attention.feature_map={cfg.feature_map!r}; choose one of {sorted(FEATURE_MAPS)}")
        self.head_dim = d_model // self.n_heads
        self.phi = FEATURE_MAPS[cfg.feature_map]
        self.normalize = cfg.normalize
        self.eps = cfg.eps
        self.q_proj = nn.Linear(d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.n_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.n_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d_model, bias=False)

    @staticmethod
    def shape_for(d_model: int, cfg: Config) -> tuple[int, int]:
        return d_model // cfg.n_heads, cfg.n_heads

    def score_flops_per_token(self, seq_len: int) -> float:
        """The parallel form as implemented: phi(Q)phi(K)^T and AV over all seq_len keys (the causal
        half is computed and then zeroed), forward and backward: 12 * d_attn * seq_len, like mha.
        The normaliser's row sum and the feature map are elementwise and not counted."""
        return 12 * self.n_heads * self.head_dim * seq_len

    def kv_cache_elements_per_token(self) -> int:
        """0: generation carries a constant-size state instead (see `state_elements`)."""
        return 0

    def check_position(self, position: PositionEncoding) -> None:
        """Called by the model once its shared position module exists."""
        _no_bias(position, torch.arange(1))

    def state_elements(self) -> int:
        """Elements of this layer's recurrent state per sequence: S and z, n_heads * (head_dim^2 + head_dim)."""
        return self.n_heads * (self.head_dim ** 2 + self.head_dim)

    def _heads(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor):
        split = lambda t: rearrange(t, "b s (h d) -> b h s d", h=self.n_heads)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        q, k = position.rotate(q, k, positions)  # before phi: phi(Rq).phi(Rk) keeps RoPE's relative rotation inside
        return self.phi(q), self.phi(k), v

    def _out(self, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        y = num / (den + self.eps) if self.normalize else num
        return self.o_proj(rearrange(y, "b h s d -> b s (h d)"))

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor) -> torch.Tensor:
        _no_bias(position, positions)
        q, k, v = self._heads(x, position, positions)
        causal = positions[:, None] >= positions[None, :]
        scores = (q @ k.transpose(-2, -1)).masked_fill(~causal, 0.0)  # (b, h, s, s), all >= 0
        return self._out(scores @ v, scores.sum(-1, keepdim=True))

    def init_state(self, batch_size: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> State:
        """Zero state (nothing seen yet). Pass float32 for long generations: S and z are running sums."""
        s = torch.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device, dtype=dtype)
        z = torch.zeros(batch_size, self.n_heads, self.head_dim, device=device, dtype=dtype)
        return s, z

    def step(self, x_t: torch.Tensor, position: PositionEncoding, pos_t: torch.Tensor,
             state: State) -> tuple[torch.Tensor, State]:
        """One token: x_t (batch, 1, d_model) at position pos_t (1-element tensor) -> (y_t, new state)."""
        _no_bias(position, pos_t)
        q, k, v = self._heads(x_t, position, pos_t.reshape(1))
        s, z = state
        s = s + k.transpose(-2, -1) @ v  # outer product phi(k_t) v_t^T, (b, h, d, d)
        z = z + k.squeeze(2)
        num = q @ s  # (b, h, 1, d)
        den = (q.squeeze(2) * z).sum(-1)[..., None, None]  # (b, h, 1, 1)
        return self._out(num, den), (s, z)
