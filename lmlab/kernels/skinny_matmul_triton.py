"""Matmuls for a few rows in Triton: a decode step's projections, where each weight is read to multiply 2-64 rows.

    skinny_matmul(x, weight)                  # F.linear(x, weight), x with at most MAX_ROWS rows
    gated_matmul(x, gate_up, "silu")          # silu(x @ gate.T) * (x @ up.T): a SwiGLU FFN's gate/up and activation
    with DecodeMatmuls():                     # every F.linear of 2-64 rows it can take runs skinny_matmul
        ...

Both accumulate in float32 and return x's dtype. `gated_matmul` takes the FFN's gate and up weights stacked as one
(2F, K) tensor (lmlab.nn.fused's group): each program multiplies x by F-aligned bands of both halves, rounds the
two products to x's dtype as the unfused matmuls do, and writes act(gate) * up. So the activation, a launch of
its own after cuBLAS's gate/up GEMM, runs in the matmul's epilogue.

Why: at batch 32 the ~400M model's decode step spends most of its time in these matmuls, and cuBLAS moves the
weights at ~1.3 TB/s there (`experiments/inference/`, H200). Each program streams a BLOCK_N x K_PER_SPLIT band
of the weight in BLOCK_K-wide tiles (software-pipelined over num_stages) and multiplies the rows of x, padded
to 16 for tl.dot. A weight with few output rows and a long K (down_proj) also splits K: each split writes a
float32 partial, and the last program of a band to finish (an atomic counter per band, which it resets) sums
the partials and writes y, so a call is one launch where cuBLAS makes two. One row is not this kernel's
case: there torch.compile turns the matmul into a reduction fused with the RMSNorm before it.

The launches are torch.library custom ops (opaque to torch.compile, captured by CUDA graphs); with
TRITON_INTERPRET=1 they run on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.overrides import TorchFunctionMode

MAX_ROWS = 64
MIN_DECODE_ROWS = 2  # DecodeMatmuls leaves one row to Inductor's fused reductions
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ACTIVATIONS = {"silu": 1, "gelu": 2, "gelu_tanh": 3}  # gated_matmul's activations: name -> the kernel's ACT


@triton.jit
def _activation(g, ACT: tl.constexpr):
    """act(g) for float32 g (ACT codes as in ACTIVATIONS; 0: none)."""
    if ACT == 1:
        g = g / (1.0 + tl.exp(-g))
    elif ACT == 2:
        g = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 3:  # tanh approximation: g * sigmoid(2z), since (1 + tanh(z)) / 2 = sigmoid(2z)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        g = g / (1.0 + tl.exp(-2.0 * z))
    return g


@triton.jit
def _skinny_kernel(X, W, Y, Part, Count, M, N, K, stride_xm, stride_wn, stride_ym,
                   K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PREC: tl.constexpr, ACT: tl.constexpr):
    band = tl.program_id(0)
    split = tl.program_id(1)
    rn = band * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    k_first = split * K_PER_SPLIT
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_first + rk)[None, :]
    up_offset = N.to(tl.int64) * stride_wn  # gated: the up half's rows follow the gate half's
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_first + k0 + rk
        k_ok = ks < K
        w_ok = n_ok[:, None] & k_ok[None, :]
        x = tl.load(X + rm[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(w_ptrs + k0, mask=w_ok, other=0.0)), acc, input_precision=PREC)
        if ACT != 0:
            w_up = tl.load(w_ptrs + up_offset + k0, mask=w_ok, other=0.0)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PREC)
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if ACT != 0:  # the unfused FFN rounds gate and up to the input's dtype before the activation
        gate = acc.to(Y.dtype.element_ty).to(tl.float32)
        acc = _activation(gate, ACT) * acc_up.to(Y.dtype.element_ty).to(tl.float32)
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
    num_stages: int = 3


@functools.cache
def sm_count(device: torch.device) -> int:
    return 4 if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count


def choose_launch(n: int, k: int, sms: int, gated: bool = False) -> Launch:
    """Bands of 16-64 columns in 256-wide K tiles: narrow bands where N is small, so the grid still covers the SMs,
    wide ones where N is huge (the head); K split only while the grid has under one program per SM, and never
    below 640 columns. From an H200 sweep at 32 rows (2026-12-02, experiments/inference/h200-2026-12-02b/), where
    a split K paid off only for down_proj (K 2752: split 4). Gated calls read two bands a program, so narrower."""
    block_n = 16 if n <= 1024 or gated else 32 if n <= 8 * sms * 32 else 64
    bands = math.ceil(n / block_n)
    split_k = 1 if gated else max(1, min(sms // bands, k // 640))
    return Launch(block_n, 256 if block_n < 64 else 64, split_k)


_counters: dict[torch.device, torch.Tensor] = {}


def _band_counters(device: torch.device, bands: int) -> torch.Tensor:
    """Zeroed int32 counters, one per band, kept per device: each call's last program leaves them zero."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < bands:
        counters = torch.zeros(max(bands, 4096), dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters


def launch_skinny(x: torch.Tensor, weight: torch.Tensor, launch: Launch, act: int = 0) -> torch.Tensor:
    """y = x @ weight.T for a 2-D x of at most MAX_ROWS rows, with the given tiles; act != 0: weight stacks gate
    and up (2F, K) and y = act(x @ gate.T) * (x @ up.T), (M, F)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if act else weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bands = triton.cdiv(n, launch.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, launch.split_k), launch.block_k) * launch.block_k
    split_k = triton.cdiv(k, k_per_split)  # rounding K_PER_SPLIT up may leave fewer splits
    if act and split_k > 1:
        raise ValueError("a gated call cannot split K (its epilogue needs the whole sums)")
    part = counters = y
    if split_k > 1:
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        counters = _band_counters(x.device, bands)
    _skinny_kernel[(bands, split_k)](
        x, weight, y, part, counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        K_PER_SPLIT=k_per_split, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, SPLIT_K=split_k, PREC="ieee", ACT=act, num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return y


@torch.library.custom_op("lmlab::skinny_matmul", mutates_args=())
def _skinny_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return launch_skinny(x, weight, choose_launch(weight.shape[0], x.shape[1], sm_count(x.device)))


@_skinny_op.register_fake
def _(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("lmlab::gated_matmul", mutates_args=())
def _gated_op(x: torch.Tensor, weight: torch.Tensor, act: int) -> torch.Tensor:
    launch = choose_launch(weight.shape[0] // 2, x.shape[1], sm_count(x.device), gated=True)
    return launch_skinny(x, weight, launch, act)


@_gated_op.register_fake
def _(x, weight, act):
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


def unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why F.linear(x, weight) cannot run here (None: it can)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not INTERPRET and not x.is_cuda:
        return "x must be a CUDA tensor"
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        return f"x of {x.dtype} with a {weight.dtype} weight (supported: float16, bfloat16, float32, both the same)"
    if type(weight) is not torch.Tensor and type(weight) is not torch.nn.Parameter:
        return f"a {type(weight).__name__} weight (a plain tensor is needed)"
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


def gated_matmul(x: torch.Tensor, gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(x @ gate.T) * (x @ up.T) for x (..., K) of at most MAX_ROWS rows, gate_up = cat([gate, up]) (2F, K)."""
    problem = unsupported(x, gate_up)
    if act not in ACTIVATIONS:
        problem = f"activation {act!r} (supported: {', '.join(ACTIVATIONS)})"
    elif gate_up.shape[0] % 2:
        problem = f"gate_up has {gate_up.shape[0]} rows: not gate and up of one size"
    if problem:
        raise ValueError(f"gated_matmul: {problem}")
    return _gated_op(_rows(x), gate_up, ACTIVATIONS[act]).view(*x.shape[:-1], gate_up.shape[0] // 2)


def _decode_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return MIN_DECODE_ROWS <= x.numel() // max(x.shape[-1], 1) and unsupported(x, weight) is None


def decode_gated_matmul(x: torch.Tensor, gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
    """gated_matmul where a decode step's 2-64 rows can take it, else None (the caller's own path)."""
    if act not in ACTIVATIONS or gate_up.shape[0] % 2 or not _decode_rows(x, gate_up):
        return None
    return gated_matmul(x, gate_up, act)


class DecodeMatmuls(TorchFunctionMode):
    """While active, F.linear without a bias on 2-64 rows that skinny_matmul supports runs it; any other call,
    cuBLAS as usual. torch.compile traces through the mode, so the compiled step calls the custom op. `gated` is
    what a GLU's `gated_kernel` takes (lmlab.nn.ffn)."""

    gated = staticmethod(decode_gated_matmul)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if bias is None and not kwargs.keys() - {"bias"} and _decode_rows(x, weight):
                return skinny_matmul(x, weight)
        return func(*args, **kwargs)
