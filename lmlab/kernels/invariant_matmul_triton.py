"""A matmul whose rows do not depend on their batch (batch-invariant), in Triton.

`invariant_linear(x, weight, bias=None)` is F.linear(x, weight, bias) for x (..., K) with any number of rows,
float16, bfloat16 or float32 (the weight in x's dtype), accumulated in float32. Each row's result is the same
bits whether the row comes alone or with others. `invariant_add_product(h, x, weight)` is `h.addmm_(x, weight.T)`
for 2-D h (a residual stream updated in place, rounded once), with the same invariance.

Why: cuBLAS (and Inductor) pick the algorithm, tiles and split-K of a matmul by its shape. The same row alone
and in a batch of five is then reduced in another order, and in bf16 the two can round differently. A greedy
choice flips wherever two logits are that close. That is why speculative decoding's (k+1)-token verification
parted from the target's own one-token steps (experiments/inference/README.md, fifth and sixth sessions).

Here a row's reduction order depends only on (N, K) and the GPU's SM count. Rows go through tl.dot in tiles of
BLOCK_M = 16, and no row's products or sums mix with another's. The K range is cut into the same splits for
any number of rows. The last program of an output tile to finish (an atomic counter per tile, which it resets)
sums the splits' float32 partials in split order, so a call is one launch. The price is tiles sized for a few
rows: at hundreds of rows cuBLAS is faster, which is why the engine uses this only where it asks for invariance
(`Engine(batch_invariant=True)`).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmlab.kernels.decode_attention_triton import sm_count

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # rows per tile: the smallest tl.dot tile, so one row wastes the least
MIN_K_PER_SPLIT = 256  # no split shorter than this many columns of K
PROGRAMS_PER_SM = 2


@triton.jit
def _store_tile(Y, Bias, acc, rm, rn, m_ok, n_ok, stride_ym, HAS_BIAS: tl.constexpr, ADD_TO_Y: tl.constexpr):
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ADD_TO_Y:  # y += the product: read and written by this one program
        acc += tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _invariant_kernel(X, W, Bias, Y, Part, Count, M, N, K, stride_xm, stride_wn, stride_ym,
                      K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_TO_Y: tl.constexpr,
                      PREC: tl.constexpr):
    band = tl.program_id(0)
    row_block = tl.program_id(1)
    split = tl.program_id(2)
    rn = band * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    k_first = split * K_PER_SPLIT
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_first + rk)[None, :]
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + (k_first + rk)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        k_ok = k_first + k0 + rk < K
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    if SPLIT_K == 1:
        _store_tile(Y, Bias, acc, rm, rn, m_ok, n_ok, stride_ym, HAS_BIAS, ADD_TO_Y)
    else:
        part_ptrs = Part + rm[:, None].to(tl.int64) * N + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        tl.store(part_ptrs + split * M * N, acc, mask=ok)
        tile = row_block * tl.num_programs(0) + band
        # acq_rel: this program's partial is visible before its count, and the last one sees every partial
        if tl.atomic_add(Count + tile, 1) == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):  # in split order, whichever program finished last
                total += tl.load(part_ptrs + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            _store_tile(Y, Bias, total, rm, rn, m_ok, n_ok, stride_ym, HAS_BIAS, ADD_TO_Y)
            tl.atomic_xchg(Count + tile, 0)  # ready for the next call


@dataclass(frozen=True)
class Tiles:
    """A call's tiles: bands of block_n output columns, each cut into split_k runs of K. A function of (N, K)
    and the device only, never of the row count: that is the invariance."""

    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int = 4
    num_stages: int = 4


@functools.cache
def choose_tiles(n: int, k: int, sms: int) -> Tiles:
    """Narrow bands, and K split until there are PROGRAMS_PER_SM programs per SM for one row tile, with no
    split shorter than MIN_K_PER_SPLIT (a decode step's weights have too few output rows to fill the GPU)."""
    block_n, block_k = 32, 128
    bands = math.ceil(n / block_n)
    wanted = max(1, min(math.ceil(PROGRAMS_PER_SM * sms / bands), k // MIN_K_PER_SPLIT))
    k_per_split = math.ceil(math.ceil(k / wanted) / block_k) * block_k
    return Tiles(block_n, block_k, math.ceil(k / k_per_split), k_per_split)


class _Counters:
    """Zeroed int32 counters per device, one per output tile; each call's last programs leave them zero.
    Buffers are only ever added, never freed: a captured CUDA graph keeps the address it saw."""

    buffers: dict[torch.device, list[torch.Tensor]] = {}

    @classmethod
    def get(cls, device: torch.device, tiles: int) -> torch.Tensor:
        held = cls.buffers.setdefault(device, [])
        if not held or held[-1].numel() < tiles:
            held.append(torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device))
        return held[-1]


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor | None = None
            ) -> torch.Tensor:
    """x @ weight.T (+ bias) into a new tensor, or added into y (m, n) in place."""
    m, k = x.shape
    n = weight.shape[0]
    tiles = choose_tiles(n, k, sm_count(x.device))
    add_to_y = y is not None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if y is None else y
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, BLOCK_M), tiles.split_k)
    part = counters = y  # unused without a split
    if tiles.split_k > 1:
        part = torch.empty((tiles.split_k, m, n), dtype=torch.float32, device=x.device)
        counters = _Counters.get(x.device, grid[0] * grid[1])
    _invariant_kernel[grid](
        x, weight, y if bias is None else bias, y, part, counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        K_PER_SPLIT=tiles.k_per_split, BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SPLIT_K=tiles.split_k, HAS_BIAS=bias is not None, ADD_TO_Y=add_to_y,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return y


@torch.library.custom_op("lmlab::invariant_linear", mutates_args=())
def _invariant_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _launch(x, weight, bias)


@_invariant_op.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("lmlab::invariant_add_product", mutates_args=("h",))
def _add_product_op(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    _launch(x, weight, None, h)


def unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """Why this call cannot run here (None: it can)."""
    if not INTERPRET and not x.is_cuda:
        return "x must be a CUDA tensor"
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        return f"x of {x.dtype} with a {weight.dtype} weight (supported: float16, bfloat16, float32, both the same)"
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        return f"weight {tuple(weight.shape)} does not match x's last dimension {x.shape[-1]}"
    if weight.stride(1) != 1:
        return "the weight's rows must be contiguous"
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        return f"bias {tuple(bias.shape)} is not a contiguous ({weight.shape[0]},) vector"
    return None


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row's result independent of the other rows; see the module docstring."""
    problem = unsupported(x, weight, bias)
    if problem:
        raise ValueError(f"invariant_linear: {problem}")
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if flat.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
    return _invariant_op(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])


def invariant_add_product(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h += x @ weight.T in place (h (M, N), x (M, K), weight (N, K)), summed in float32 and rounded once, as
    `h.addmm_(x, weight.T)`, with each row independent of the others; returns h."""
    problem = unsupported(x, weight)
    if problem:
        raise ValueError(f"invariant_add_product: {problem}")
    if h.dim() != 2 or h.shape != (x.shape[0], weight.shape[0]) or h.dtype != x.dtype or h.stride(-1) != 1:
        raise ValueError(f"invariant_add_product: h must be a ({x.shape[0]}, {weight.shape[0]}) tensor of x's dtype "
                         f"with contiguous rows, got {tuple(h.shape)} {h.dtype}")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError("invariant_add_product: x must be 2-D with contiguous rows")
    if h.shape[0]:
        _add_product_op(h, x, weight)
    return h
