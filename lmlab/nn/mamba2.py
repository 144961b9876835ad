"""Mamba-2: the state-space duality (SSD) layer (Dao & Gu 2024, "Transformers are SSMs").

Each of H heads keeps a (head_dim x d_state) state and, for token t, with a step size
dt_t = softplus(w_dt . u_t + dt_bias) > 0 and a per-head decay rate A = -exp(A_log) < 0:

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        y_t = h_t C_t + D x_t

A is a scalar times the identity (one number per head), which is what makes the layer "dual" to
attention: unrolled, y_t = sum_{s<=t} (C_t . B_s) exp(a_{s+1} + ... + a_t) dt_s x_s with a_t = dt_t A,
a causal attention whose scores C_t . B_s are weighted by a decay mask. Two exact forms follow:
- recurrent (generation, `scan_recurrent`, `ssm_step`): one state update per token, a fixed-size state.
- chunked (training, `ssd_chunked`): cut the sequence into chunks of Q tokens.
    1. within a chunk, the attention form: Y = ((C B^T) * L) (dt X), L[i, j] = exp(a_{j+1} + ... + a_i)
       for j <= i (the segment-sum decay mask), an O(Q^2) matmul per chunk;
    2. each chunk's own end state: sum_j exp(a_{j+1} + ... + a_Q) dt_j x_j B_j^T;
    3. between chunks, the same recurrence over the chunk states (decay exp(sum of a chunk's a));
    4. each token reads the state entering its chunk: exp(a_1 + ... + a_i) C_i h_in.
  Every step is a batched matmul, and the cost is linear in the sequence length for a fixed Q.
B and C are shared by the heads of a group (n_groups of them), as GQA shares keys and values.

The layer around the scan: in_proj -> (z, x, B, C, dt); a depthwise causal convolution (kernel
d_conv) and SiLU over (x, B, C); the scan; + D x; y = rmsnorm(y * silu(z)) per group; out_proj.
Parameter names are Hugging Face Mamba2's (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).
Positions are not used: the recurrence orders the tokens itself. The scan runs in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION
from lmlab.nn.positions import PositionEncoding

A_INIT_RANGE = (1.0, 16.0)  # A = -uniform(1, 16): per-head decay rates from slow to fast (Mamba-2's init)
DT_INIT_FLOOR = 1e-4  # the smallest initial step size, so no head starts frozen


class Mamba2State(NamedTuple):
    conv: torch.Tensor  # (batch, conv channels, d_conv - 1): the last conv inputs, in the model's dtype
    ssm: torch.Tensor  # (batch, heads, head_dim, d_state), float32


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """(..., T) -> (..., T, T) with [i, j] = a_{j+1} + ... + a_i for j <= i (0 on the diagonal), -inf above.

    exp of it is the decay from step j to step i. Summed from masked copies of `a`, not as cumsum_i - cumsum_j,
    which cancels large numbers and loses precision on long chunks."""
    steps = a.shape[-1]
    causal = torch.ones(steps, steps, dtype=torch.bool, device=a.device).tril()
    sums = a[..., :, None].expand(*a.shape, steps).masked_fill(~causal.tril(-1), 0.0).cumsum(-2)
    return sums.masked_fill(~causal, float("-inf"))


def _by_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C (..., groups, d_state) -> (..., heads, d_state): consecutive heads share their group's."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def _pad_time(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Zeros after the last step of dim 1: x = 0 adds nothing and a = 0 decays nothing, so the state is unchanged."""
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int, initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan in chunks (see the module docstring), in float32.

    x (batch, seq, heads, head_dim), dt (batch, seq, heads), A (heads,), B and C (batch, seq, groups, d_state),
    initial_state (batch, heads, head_dim, d_state) or None (zeros) -> y (batch, seq, heads, head_dim) without
    the D skip, and the state after the last token."""
    batch, length, heads, head_dim = x.shape
    pad = -length % chunk_size
    x, dt, B, C = (_pad_time(t.float(), pad) for t in (x, dt, B, C))
    B, C = _by_head(B, heads), _by_head(C, heads)
    chunks = lambda t: rearrange(t, "b (c q) ... -> b c q ...", q=chunk_size)  # noqa: E731
    xdt, B, C = chunks(x * dt[..., None]), chunks(B), chunks(C)
    a = rearrange(dt * A.float(), "b (c q) h -> b h c q", q=chunk_size)
    a_cum = a.cumsum(-1)

    # 1. within each chunk: attention-like scores C_i . B_j under the decay mask
    scores = torch.einsum("bcihn,bcjhn->bhcij", C, B) * segment_sums(a).exp()
    y = torch.einsum("bhcij,bcjhp->bcihp", scores, xdt)

    # 2. what each chunk alone leaves in the state at its end
    to_end = (a_cum[..., -1:] - a_cum).exp()
    states = torch.einsum("bcjhn,bhcj,bcjhp->bchpn", B, to_end, xdt)

    # 3. the recurrence over chunks, h_in[c+1] = exp(sum a of chunk c) h_in[c] + states[c], in closed form:
    # a decay matrix over the chunk boundaries (the initial state enters at boundary 0)
    if initial_state is None:
        initial_state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    states = torch.cat([initial_state.float()[:, None], states], dim=1)
    boundaries = segment_sums(F.pad(a_cum[..., -1], (1, 0))).exp()  # (b, h, c + 1, c + 1)
    entering = torch.einsum("bhij,bjhpn->bihpn", boundaries, states)

    # 4. each token reads the state entering its chunk, decayed up to itself
    y = y + torch.einsum("bcihn,bchpn,bhci->bcihp", C, entering[:, :-1], a_cum.exp())
    return rearrange(y, "b c q h p -> b (c q) h p")[:, :length], entering[:, -1]


def ssm_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence h = exp(dt A) h + dt x B^T, y = h C, in float32.

    state (batch, heads, head_dim, d_state), x (batch, heads, head_dim), dt (batch, heads), B and C
    (batch, groups, d_state) -> y (batch, heads, head_dim) without the D skip, and the new state."""
    heads = x.shape[1]
    x, dt, B, C = x.float(), dt.float(), _by_head(B.float(), heads), _by_head(C.float(), heads)
    decay = (dt * A.float()).exp()[..., None, None]
    state = decay * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", state, C), state


def scan_recurrent(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: `ssd_chunked`'s result token by token with `ssm_step` (same arguments, no chunk size)."""
    batch, length, heads, head_dim = x.shape
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1], dtype=torch.float32) if initial_state is None \
        else initial_state.float()
    ys = []
    for t in range(length):
        y, state = ssm_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y)
    return torch.stack(ys, dim=1), state


class GatedRMSNorm(nn.Module):
    """rmsnorm(y * silu(z)) * weight, normalised over each group's channels (as Mamba-2 does, so that a
    tensor-parallel shard of whole groups normalises on its own)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.groups = groups
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = rearrange(y.float() * F.silu(z.float()), "... (g d) -> ... g d", g=self.groups)
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return rearrange(normed, "... g d -> ... (g d)").to(z.dtype) * self.weight


@ATTENTION.register("mamba2")
class Mamba2(nn.Module):
    """Mamba-2's SSD layer (Dao & Gu 2024): a chunked scan for training, a recurrent state for generation."""

    supports_documents = False  # the state would carry one packed document into the next
    uses_positions = False  # order comes from the recurrence; position arguments are accepted and ignored

    @dataclass
    class Config:
        n_heads: int = 4
        d_state: int = 16  # N: state columns per head (the size of B and C)
        expand: int = 2  # inner width = expand * d_model, split into n_heads heads
        d_conv: int = 4  # kernel of the depthwise causal convolution over (x, B, C)
        chunk_size: int = 16  # Q of the chunked scan; a power of two
        n_groups: int = 1  # B and C are shared by the n_heads / n_groups heads of a group
        dt_min: float = 0.001  # the initial step sizes are log-uniform in [dt_min, dt_max]
        dt_max: float = 0.1
        norm_eps: float = 1e-5  # of the gated RMSNorm

    def __init__(self, d_model: int, cfg: Config, layer_idx: int = 0):
        super().__init__()
        at_least("attention", cfg, 1, "n_heads", "d_state", "expand", "d_conv", "chunk_size", "n_groups")
        d_inner = cfg.expand * d_model
        if d_inner % cfg.n_heads:
            raise ConfigError(f"attention.expand * model.d_model = {d_inner} is not divisible by "
                              f"attention.n_heads={cfg.n_heads}")
        if cfg.n_heads % cfg.n_groups:
            raise ConfigError(f"attention.n_heads={cfg.n_heads} is not divisible by attention.n_groups={cfg.n_groups}")
        if cfg.chunk_size & (cfg.chunk_size - 1):
            raise ConfigError(f"attention.chunk_size={cfg.chunk_size} must be a power of two (16, 64, 256, ...)")
        if not 0 < cfg.dt_min <= cfg.dt_max:
            raise ConfigError(f"attention.dt_min={cfg.dt_min} and dt_max={cfg.dt_max} must satisfy "
                              "0 < dt_min <= dt_max")
        self.n_heads, self.head_dim, self.d_inner = cfg.n_heads, d_inner // cfg.n_heads, d_inner
        self.d_state, self.n_groups, self.d_conv, self.chunk_size = cfg.d_state, cfg.n_groups, cfg.d_conv, cfg.chunk_size
        self.conv_dim = d_inner + 2 * cfg.n_groups * cfg.d_state  # x, B and C go through the convolution
        self.in_proj = nn.Linear(d_model, d_inner + self.conv_dim + cfg.n_heads, bias=False)  # z, (x, B, C), dt
        # No padding here: `convolve` puts the previous inputs (zeros, or the cached ones) in front.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.d_conv, groups=self.conv_dim)
        dt = torch.empty(cfg.n_heads).uniform_(math.log(cfg.dt_min), math.log(cfg.dt_max)).exp().clamp_min(DT_INIT_FLOOR)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt): softplus(dt_bias) = dt
        self.A_log = nn.Parameter(torch.empty(cfg.n_heads).uniform_(*A_INIT_RANGE).log())
        self.D = nn.Parameter(torch.ones(cfg.n_heads))
        self.norm = GatedRMSNorm(d_inner, cfg.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    @staticmethod
    def shape_for(d_model: int, cfg: Config) -> tuple[int, int]:
        return cfg.expand * d_model // cfg.n_heads, cfg.n_heads

    def score_flops_per_token(self, seq_len: int) -> float:
        """The scan and the convolution as implemented, forward and backward (3x the forward), per token.
        Forward, per head, with Q = chunk_size, P = head_dim, N = d_state and c = ceil(seq_len / Q) chunks:
        C B^T and its product with X over whole Q x Q chunks, 2Q(N + P); each chunk's state and each token's
        read of the entering state, 2PN each; the (c + 1)^2 decay matrix over chunk states, 2(c + 1)^2 PN / seq_len.
        The convolution: 2 * d_conv per channel. Exponentials and other elementwise work are not counted."""
        q, p, n = self.chunk_size, self.head_dim, self.d_state
        chunks = math.ceil(seq_len / q)
        scan = self.n_heads * (2 * q * (n + p) + 4 * p * n + 2 * (chunks + 1) ** 2 * p * n / seq_len)
        return 3 * (scan + 2 * self.d_conv * self.conv_dim)

    def kv_cache_elements_per_token(self) -> int:
        """0: generation carries a constant-size state instead (see `state_elements`)."""
        return 0

    def state_elements(self) -> int:
        """Elements of the generation state per sequence: the SSM state (heads x head_dim x d_state) and the
        last d_conv - 1 inputs of every convolution channel."""
        return self.n_heads * self.head_dim * self.d_state + self.conv_dim * (self.d_conv - 1)

    def init_state(self, batch_size: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Mamba2State:
        """Nothing seen yet: zero conv inputs (in `dtype`) and a zero float32 SSM state."""
        return Mamba2State(torch.zeros(batch_size, self.conv_dim, self.d_conv - 1, device=device, dtype=dtype),
                           torch.zeros(batch_size, self.n_heads, self.head_dim, self.d_state, device=device,
                                       dtype=torch.float32))

    def convolve(self, xbc: torch.Tensor, conv_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal depthwise convolution and SiLU of xbc (batch, seq, channels), continuing after the inputs in
        `conv_state` (None: zeros, a sequence's start) -> the outputs and the last d_conv - 1 inputs."""
        xbc = xbc.transpose(1, 2)
        if conv_state is None:
            inputs = F.pad(xbc, (self.d_conv - 1, 0))
        else:
            inputs = torch.cat([conv_state.to(xbc.dtype), xbc], dim=-1)
        return F.silu(self.conv1d(inputs)).transpose(1, 2), inputs[..., xbc.shape[-1]:]

    def forward(self, x: torch.Tensor, position: PositionEncoding | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """x (batch, seq, d_model) from a sequence's start; the position arguments are accepted and unused."""
        return self.forward_with_state(x)[0]

    def forward_with_state(self, x: torch.Tensor, state: Mamba2State | None = None,
                           real: torch.Tensor | None = None) -> tuple[torch.Tensor, Mamba2State]:
        """Continue from `state` (None: a sequence's start) over x (batch, seq, d_model): one token by the
        recurrence, several by the chunked scan. `real` (batch, seq) bool marks the tokens to take in; the others
        (left padding) get no conv input and dt = 0, so the state is left as if they were absent.
        -> (output, state after the last token)."""
        z, xbc, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)
        if real is not None:
            xbc = xbc * real[..., None]
        xbc, conv_state = self.convolve(xbc, None if state is None else state.conv)
        xs, B, C = xbc.split([self.d_inner, self.n_groups * self.d_state, self.n_groups * self.d_state], dim=-1)
        xs = rearrange(xs, "b s (h p) -> b s h p", p=self.head_dim)
        B, C = (rearrange(t, "b s (g n) -> b s g n", g=self.n_groups) for t in (B, C))
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if real is not None:
            dt = dt * real[..., None]
        A = -self.A_log.float().exp()
        ssm_state = None if state is None else state.ssm
        if x.shape[1] == 1 and ssm_state is not None:  # decoding: one recurrence step
            y, ssm_state = ssm_step(ssm_state, xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
            y = y[:, None]
        else:
            y, ssm_state = ssd_chunked(xs, dt, A, B, C, self.chunk_size, ssm_state)
        y = y + self.D.float()[:, None] * xs.float()
        out = self.out_proj(self.norm(rearrange(y, "b s h p -> b s (h p)"), z))
        return out, Mamba2State(conv_state, ssm_state)
