"""A matmul for a few rows in Triton, y = x @ weight.T, optionally with a gated FFN's activation as its prologue.

    skinny_matmul(x, weight)                   # F.linear(x, weight), x with at most MAX_ROWS rows
    gated_matmul(gate, up, weight, "silu")     # F.linear(silu(gate) * up, weight): a SwiGLU FFN's down_proj

Both accumulate in float32 and return x's (gate's) dtype; the gated product is rounded to that dtype before
the matmul, as the unfused FFN's is.

Why: at decode time a step multiplies each weight by a few rows, so a matmul is a stream of the weight, and
each launch costs 2.5-4 us whatever its size (`experiments/inference/`, H200). A SwiGLU layer's silu(gate)
* up is a launch of its own between two matmuls, and cuBLAS runs down_proj at 32 rows as a split-K GEMM plus
a reduction kernel: three launches. `gated_matmul` is one. Each program streams a BLOCK_N x K_PER_SPLIT band
of the weight in BLOCK_K-wide tiles (software-pipelined over num_stages), multiplying the few rows of x it
loads (computing act(gate) * up on the way in). A weight with few output rows also splits K: each split
writes a float32 partial, and the last program of a band to finish (an atomic counter per band, which it
resets) sums the partials and writes y. One row uses a product and a row sum; 2-64 rows use tl.dot with
the rows padded to 16.

The launch is a torch.library custom op (opaque to torch.compile, captured by CUDA graphs); with
TRITON_INTERPRET=1 it runs on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 64
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The gated prologue's activations: name -> the kernel's ACT code (0: no prologue).
ACTIVATIONS = {"silu": 1, "gelu": 2, "gelu_tanh": 3}


@triton.jit
def _gated(gate, up, ACT: tl.constexpr):
    """act(gate) * up in float32 (ACT codes as in ACTIVATIONS). Every program of a K slice recomputes it for its
    rows, so it uses exp2 and the fast division: with the IEEE ones the prologue took 3-4x the matmul's time
    (H200, 32 rows, down_proj: 18.5-20.9 us against 4.8-6.2 us)."""
    g = gate.to(tl.float32)
    if ACT == 1:  # g * sigmoid(g)
        a = tl.fdiv(g, 1.0 + tl.math.exp2(-1.4426950408889634 * g))
    elif ACT == 2:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:  # tanh approximation: g * sigmoid(2z), since (1 + tanh(z)) / 2 = sigmoid(2z)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = tl.fdiv(g, 1.0 + tl.math.exp2(-2.8853900817779268 * z))
    return a * up.to(tl.float32)


@triton.jit
def _load_x(X, U, offsets, mask, ACT: tl.constexpr):
    """A tile of x, or of act(gate) * up rounded to gate's dtype, at X/U + offsets."""
    x = tl.load(X + offsets, mask=mask, other=0.0)
    if ACT != 0:
        x = _gated(x, tl.load(U + offsets, mask=mask, other=0.0), ACT).to(x.dtype)
    return x


@triton.jit
def _skinny_kernel(X, U, W, Y, Part, Count, M, N, K, stride_xm, stride_wn, stride_ym,
                   K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ONE_ROW: tl.constexpr, PREC: tl.constexpr,
                   ACT: tl.constexpr):
    band = tl.program_id(0)
    split = tl.program_id(1)
    rn = band * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    k_first = split * K_PER_SPLIT
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_first + rk)[None, :]
    if ONE_ROW:  # a product and a row sum per tile: nothing padded
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_first + k0 + rk
        k_ok = ks < K
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if ONE_ROW:
            x = _load_x(X, U, ks, k_ok, ACT)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:
            x = _load_x(X, U, rm[:, None] * stride_xm + ks[None, :], m_ok[:, None] & k_ok[None, :], ACT)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    if ONE_ROW:
        acc = tl.sum(acc2, 1)[None, :]  # (1, BLOCK_N); BLOCK_M is 1
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=ok)
    else:
        part_ptrs = Part + (rm[:, None] * N + rn[None, :])
        tl.store(part_ptrs + split * M * N, acc, mask=ok)
        # acq_rel: this program's partial is visible before its count, and the last one sees every partial
        if tl.atomic_add(Count + band, 1) == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptrs + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=ok)
            tl.atomic_xchg(Count + band, 0)  # ready for the next call


@dataclass(frozen=True)
class Launch:
    """Tile and grid of one call: bands of block_n output columns, each split split_k ways along K."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@functools.cache
def sm_count(device: torch.device) -> int:
    return 4 if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count


def choose_launch(m: int, n: int, k: int, sms: int) -> Launch:
    """One row: narrow bands of long tiles, K split until ~2 programs per SM stream. More rows: bands of 32 and
    256-wide tiles, K split only until the grid has about one program per SM and never below 640 columns.
    From an H200 sweep at 32 rows (2026-12-02, `experiments/inference/h200-2026-12-02b/sweep.json`), where a
    split K paid off only for down_proj (K 2752: split 4, 6.6 us against 7.1 at the first rule's split 9)."""
    if m == 1:
        bands = math.ceil(n / 16)
        return Launch(16, 256, max(1, min(math.ceil(2 * sms / bands), k // 256)))
    bands = math.ceil(n / 32)
    return Launch(32, 256, max(1, min(sms // bands, k // 640)), num_stages=3)


_counters: dict[torch.device, torch.Tensor] = {}


def _band_counters(device: torch.device, bands: int) -> torch.Tensor:
    """Zeroed int32 counters, one per band, kept per device: each call's last program leaves them zero."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < bands:
        counters = torch.zeros(max(bands, 4096), dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters


def launch_skinny(x: torch.Tensor, weight: torch.Tensor, launch: Launch, up: torch.Tensor | None = None,
                  act: int = 0) -> torch.Tensor:
    """y = x @ weight.T (act: x is the gate, the rows are act(x) * up) for a 2-D x of at most MAX_ROWS rows,
    with the given tiles; up has x's shape and strides."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bands = triton.cdiv(n, launch.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, launch.split_k), launch.block_k) * launch.block_k
    split_k = triton.cdiv(k, k_per_split)  # rounding K_PER_SPLIT up may leave fewer splits
    part = counters = y
    if split_k > 1:
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        counters = _band_counters(x.device, bands)
    _skinny_kernel[(bands, split_k)](
        x, x if up is None else up, weight, y, part, counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        K_PER_SPLIT=k_per_split, BLOCK_M=1 if m == 1 else max(16, triton.next_power_of_2(m)),
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SPLIT_K=split_k, ONE_ROW=m == 1,
        PREC="ieee", ACT=act, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return y


def _default_launch(x: torch.Tensor, weight: torch.Tensor) -> Launch:
    return choose_launch(x.shape[0], weight.shape[0], x.shape[1], sm_count(x.device))


@torch.library.custom_op("lmlab::skinny_matmul", mutates_args=())
def _skinny_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return launch_skinny(x, weight, _default_launch(x, weight))


@_skinny_op.register_fake
def _(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("lmlab::gated_matmul", mutates_args=())
def _gated_op(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, act: int) -> torch.Tensor:
    return launch_skinny(gate, weight, _default_launch(gate, weight), up, act)


@_gated_op.register_fake
def _(gate, up, weight, act):
    return gate.new_empty((gate.shape[0], weight.shape[0]))


def unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why this call cannot run here (None: it can)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not INTERPRET and not x.is_cuda:
        return "x must be a CUDA tensor"
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        return f"x of {x.dtype} with a {weight.dtype} weight (supported: float16, bfloat16, float32, both the same)"
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        return f"weight {tuple(weight.shape)} does not match x's last dimension {x.shape[-1]}"
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows of x (supported: 1 to {MAX_ROWS})"
    if weight.stride(1) != 1:
        return "the weight's rows must be contiguous"
    return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for x (..., K) of at most MAX_ROWS rows; see the module docstring."""
    problem = unsupported(x, weight)
    if problem:
        raise ValueError(f"skinny_matmul: {problem}")
    return _skinny_op(_rows(x), weight).view(*x.shape[:-1], weight.shape[0])


def gated_matmul(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, act: str) -> torch.Tensor:
    """F.linear(act(gate) * up, weight) for gate and up (..., K) of at most MAX_ROWS rows; act one of ACTIVATIONS."""
    problem = unsupported(gate, weight)
    if act not in ACTIVATIONS:
        problem = f"activation {act!r} (supported: {', '.join(ACTIVATIONS)})"
    if gate.shape != up.shape or gate.dtype != up.dtype:
        problem = f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
    if problem:
        raise ValueError(f"gated_matmul: {problem}")
    gate_rows, up_rows = _rows(gate), _rows(up)
    if gate_rows.stride() != up_rows.stride():
        gate_rows, up_rows = gate_rows.contiguous(), up_rows.contiguous()
    return _gated_op(gate_rows, up_rows, weight, ACTIVATIONS[act]).view(*gate.shape[:-1], weight.shape[0])


def decode_gated_matmul(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, act: str) -> torch.Tensor | None:
    """gated_matmul where it takes these inputs (a decode step's 2-64 rows), else None (the caller's own path).
    Not one row: there torch.compile already makes the activation and down_proj one reduction, which took 3.6 us
    against this kernel's 5.5 at its best tiles (H200, `experiments/inference/h200-2026-12-02b/`)."""
    rows = gate.numel() // max(gate.shape[-1], 1)
    if (rows == 1 or unsupported(gate, weight) or act not in ACTIVATIONS or gate.shape != up.shape
            or gate.dtype != up.dtype):
        return None
    return gated_matmul(gate, up, weight, act)
