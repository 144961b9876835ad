"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule").

Each head keeps a fast-weight state S (d_k x d_v) that maps keys to values. A token writes to it with
the delta rule (replace what S recalls for k_t by v_t, at learning rate beta_t) after a decay alpha_t:

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t / sqrt(d_k)

alpha_t = 1, beta_t = 1 is the plain delta rule (S recalls exactly v_t for k_t); beta_t = 0 keeps S
and alpha_t decays it (Mamba-2's gate), so the layer can both overwrite one association and forget all.
Per head and token: beta_t = sigmoid(b_proj(x_t)), and log alpha_t = g_t = -exp(A_log) softplus(a_proj(x_t)
+ dt_bias) < 0. q, k, v pass a short causal depthwise convolution and SiLU; q and k are L2-normalised
(so I - beta k k^T is a contraction); o is RMS-normed per head, gated by silu(g_proj(x)), then o_proj.

Training uses the chunked parallel form (`chunk_gated_delta_rule`). Write S_t = alpha_t S_{t-1} + k_t u_t^T
with u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t). Inside a chunk of C tokens with state S_0 at its start and
gamma_t = alpha_1 ... alpha_t (G = cumsum g), unrolling gives, for t, i in the chunk,

    u_t + sum_{i<t} beta_t (gamma_t / gamma_i) (k_t . k_i) u_i = beta_t v_t - beta_t gamma_t S_0^T k_t,

a unit lower-triangular system (I + A) U = diag(beta) V - diag(beta gamma) K S_0. Solving it once per chunk
for both right-hand sides (the UT transform) gives the WY representation U = U' - W S_0 with
U' = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta gamma) K, which needs no S_0. Then

    O   = diag(gamma) Q S_0 + (tril(Q K^T) * Gamma) U,        Gamma_ti = gamma_t / gamma_i
    S_C = gamma_C S_0 + K^T diag(gamma_C / gamma) U

All chunks' U', W and Q K^T are batched matmuls; only the state update runs chunk after chunk. Decays
are formed as exp(G_t - G_i) with i <= t (never a division by gamma), so strong forgetting underflows to
0 rather than overflowing. `recurrent_gated_delta_rule` is the token-by-token form: the cache's decode
step and the tests' reference. Both compute in float32.

Positions are not used: the convolution and the decay give order (as in Qwen3-Next's linear layers),
so RoPE and ALiBi apply only to softmax-attention layers of the model, and learned or sinusoidal
positions through the embeddings. Packed documents are not supported (the state would leak across them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION
from lmlab.nn.norms import RMSNorm
from lmlab.nn.positions import PositionEncoding


class DeltaInputs(NamedTuple):
    """Float32 inputs of the delta rule: q (scaled by 1/sqrt(d_k)), k (b, h, s, d_k), v (b, h, s, d_v);
    g = log alpha and beta (b, h, s)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


ConvStates = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the last d_conv - 1 inputs of q, k, v (b, c, d_conv - 1)


def _start_state(initial_state: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The state before the first token (b, h, d_k, d_v): `initial_state` in float32, or zeros."""
    if initial_state is None:
        return k.new_zeros(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1])
    return initial_state.float()


def chunk_gated_delta_rule(q, k, v, g, beta, chunk_size: int, initial_state: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked parallel form (module docstring). Shapes as `DeltaInputs`; any length (padded to whole
    chunks with k = 0, g = 0, which leave the state alone); initial_state (b, h, d_k, d_v), None: zeros.
    Returns o (b, h, s, d_v) and the final state, float32."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    length, d_k = k.shape[2], k.shape[3]
    pad = -length % chunk_size
    chunks = lambda t: rearrange(F.pad(t, (0, 0, 0, pad)), "b h (n c) d -> b h n c d", c=chunk_size)  # noqa: E731
    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g[..., None]).squeeze(-1), chunks(beta[..., None])  # beta keeps a trailing 1 to scale rows
    big_g = g.cumsum(-1)  # (b, h, n, c): log gamma_t within each chunk
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (big_g[..., :, None] - big_g[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # Gamma, 0 above

    a = (beta * decay * (k @ k.transpose(-1, -2))).tril(-1)
    rhs = torch.cat([beta * big_g[..., None].exp() * k, beta * v], dim=-1)
    eye = torch.eye(chunk_size, device=q.device)
    w, u_free = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True).split(
        [d_k, v.shape[-1]], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * decay
    to_end = (big_g[..., -1:] - big_g).exp()[..., None]  # gamma_C / gamma_i

    state = _start_state(initial_state, k, v)
    outputs = []
    for n in range(q.shape[2]):
        u = u_free[:, :, n] - w[:, :, n] @ state
        outputs.append(big_g[:, :, n, :, None].exp() * (q[:, :, n] @ state) + scores[:, :, n] @ u)
        state = big_g[:, :, n, -1, None, None].exp() * state + (k[:, :, n] * to_end[:, :, n]).transpose(-1, -2) @ u
    return torch.cat(outputs, dim=2)[:, :, :length], state


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence one token at a time; same arguments and results as `chunk_gated_delta_rule`."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    state = _start_state(initial_state, k, v)
    outputs = []
    for t in range(q.shape[2]):
        k_t = k[:, :, t]
        state = g[:, :, t, None, None].exp() * state
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, state))
        state = state + k_t[..., :, None] * u[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    return torch.stack(outputs, dim=2), state


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| along the last dim; smooth at 0 (padding slots' keys are zero vectors)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _check(d_model: int, cfg: GatedDeltaNet.Config) -> tuple[int, int]:
    """(d_k, d_v) per head, or one ConfigError naming the field."""
    if cfg.n_heads < 1:
        raise ConfigError(f"attention.n_heads={cfg.n_heads}; must be >= 1")
    if cfg.head_dim is None and d_model % cfg.n_heads:
        raise ConfigError(f"model.d_model={d_model} is not divisible by attention.n_heads={cfg.n_heads}; "
                          "set attention.head_dim or pick n_heads dividing d_model")
    d_k = cfg.head_dim or d_model // cfg.n_heads
    if d_k < 1:
        raise ConfigError(f"attention.head_dim={cfg.head_dim}; must be >= 1 (or null: d_model // n_heads)")
    d_v = d_k * cfg.expand_v
    if d_v < 1 or d_v != int(d_v):
        raise ConfigError(f"attention.expand_v={cfg.expand_v} makes the value head {d_v} wide (head_dim {d_k} * "
                          "expand_v); it must be a whole number >= 1")
    if cfg.d_conv < 1:
        raise ConfigError(f"attention.d_conv={cfg.d_conv}; the short convolution needs a kernel width >= 1")
    if cfg.chunk_size < 1 or cfg.chunk_size & (cfg.chunk_size - 1):
        raise ConfigError(f"attention.chunk_size={cfg.chunk_size}; must be a power of two (16, 32, 64, ...)")
    if not cfg.norm_eps > 0:
        raise ConfigError(f"attention.norm_eps={cfg.norm_eps}; must be > 0")
    return d_k, int(d_v)


@ATTENTION.register("gated_deltanet")
class GatedDeltaNet(nn.Module):
    """Gated delta rule (Yang et al. 2024): chunked WY/UT form for training, a recurrent state for generation."""

    supports_documents = False

    @dataclass
    class Config:
        n_heads: int = 4
        head_dim: int | None = None  # key (and query) width per head; None: d_model // n_heads
        expand_v: float = 1.0  # value head width = head_dim * expand_v
        d_conv: int = 4  # kernel width of the short causal depthwise convolution on q, k and v
        chunk_size: int = 16  # tokens per chunk of the parallel form; a power of two
        use_gate: bool = True  # gate the normed output with silu(g_proj(x))
        norm_eps: float = 1e-5  # of the per-head output RMSNorm

    def __init__(self, d_model: int, cfg: Config, layer_idx: int = 0):
        super().__init__()
        self.head_dim, self.head_v_dim = _check(d_model, cfg)
        self.n_heads, self.d_conv, self.chunk_size = cfg.n_heads, cfg.d_conv, cfg.chunk_size
        key_dim, value_dim = self.n_heads * self.head_dim, self.n_heads * self.head_v_dim
        self.q_proj = nn.Linear(d_model, key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, value_dim, bias=False)
        self.a_proj = nn.Linear(d_model, self.n_heads, bias=False)
        self.b_proj = nn.Linear(d_model, self.n_heads, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(c, c, cfg.d_conv, groups=c, bias=False) for c in (key_dim, key_dim, value_dim))
        # Decay rates A in [1, 16] and time steps dt log-uniform in [1e-3, 0.1] (Mamba-2's ranges): some heads
        # remember for thousands of tokens, others for a few. dt_bias is softplus^-1(dt).
        self.A_log = nn.Parameter(torch.empty(self.n_heads).uniform_(1, 16).log())
        dt = torch.empty(self.n_heads).uniform_(math.log(1e-3), math.log(0.1)).exp()
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.o_norm = RMSNorm(self.head_v_dim, RMSNorm.Config(eps=cfg.norm_eps))
        self.g_proj = nn.Linear(d_model, value_dim, bias=False) if cfg.use_gate else None
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)

    @staticmethod
    def shape_for(d_model: int, cfg: Config) -> tuple[int, int]:
        return _check(d_model, cfg)[0], cfg.n_heads

    def score_flops_per_token(self, seq_len: int) -> float:
        """The chunked form's products beyond the projections, forward and backward (3x forward), per token,
        with chunk length C and per-head widths d_k, d_v: K K^T and Q K^T (2 * 2C d_k), the triangular solve
        for W and U' (C (d_k + d_v)), the intra-chunk scores times U (2C d_v), and W S, Q S and the state
        update K^T U (3 * 2 d_k d_v). Constant in seq_len, as the state replaces attention over the past."""
        c, d_k, d_v = self.chunk_size, self.head_dim, self.head_v_dim
        return 3 * self.n_heads * (c * (5 * d_k + 3 * d_v) + 6 * d_k * d_v)

    def kv_cache_elements_per_token(self) -> int:
        """0: generation carries a constant-size state instead (see `state_elements`)."""
        return 0

    def state_elements(self) -> int:
        """Per sequence: S (n_heads * d_k * d_v) and the convolutions' last d_conv - 1 inputs of q, k and v."""
        channels = self.n_heads * (2 * self.head_dim + self.head_v_dim)
        return self.n_heads * self.head_dim * self.head_v_dim + (self.d_conv - 1) * channels

    def _short_conv(self, conv: nn.Conv1d, x: torch.Tensor, past: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """SiLU(causal depthwise conv) of x (b, s, c), continuing after the inputs `past` (b, c, d_conv - 1)
        (None: zeros, the sequence starts here). Returns it (b, s, c) and the last d_conv - 1 inputs."""
        x = x.transpose(1, 2)
        if past is None:
            past = x.new_zeros(x.shape[0], x.shape[1], self.d_conv - 1)
        window = torch.cat([past.to(x.dtype), x], dim=-1)
        return F.silu(conv(window)).transpose(1, 2), window[..., window.shape[-1] - (self.d_conv - 1):]

    def heads(self, x: torch.Tensor, conv_states: ConvStates | None = None) -> tuple[DeltaInputs, ConvStates]:
        """The delta rule's inputs for x (b, s, d_model), the convolutions continuing from `conv_states`
        (None: a fresh sequence), and the convolutions' states after x."""
        past = conv_states or (None, None, None)
        q, q_tail = self._short_conv(self.q_conv1d, self.q_proj(x), past[0])
        k, k_tail = self._short_conv(self.k_conv1d, self.k_proj(x), past[1])
        v, v_tail = self._short_conv(self.v_conv1d, self.v_proj(x), past[2])
        split = lambda t: rearrange(t, "b s (h d) -> b h s d", h=self.n_heads).float()  # noqa: E731
        q = l2_normalize(split(q)) * self.head_dim ** -0.5
        k, v = l2_normalize(split(k)), split(v)
        beta = self.b_proj(x).float().sigmoid().transpose(1, 2)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        return DeltaInputs(q, k, v, g.transpose(1, 2), beta), (q_tail, k_tail, v_tail)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of o (b, h, s, d_v), the silu(g_proj(x)) gate, then o_proj."""
        o = self.o_norm(rearrange(o.to(x.dtype), "b h s d -> b s h d"))
        if self.g_proj is not None:
            o = o * F.silu(rearrange(self.g_proj(x), "b s (h d) -> b s h d", h=self.n_heads))
        return self.o_proj(rearrange(o, "b s h d -> b s (h d)"))

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor) -> torch.Tensor:
        inputs, _ = self.heads(x)
        o, _ = chunk_gated_delta_rule(*inputs, chunk_size=self.chunk_size)
        return self.output(o, x)
