"""A skinny matmul in Triton, y = x @ weight.T for a few rows of x: an experiment on the decode step's matmuls.

`skinny_matmul(x, weight)` takes x (..., K) with at most MAX_ROWS rows in all and a Linear's weight (N, K),
and returns (..., N) in x's dtype: `F.linear(x, weight)` with float32 accumulation.

The question: could a matmul made for 1-64 rows, a pure stream of the weight through the SMs, beat cuBLAS
(at 32 rows the engine's GEMMs moved llama400m's weights at ~1.3 TB/s) and Inductor's matmul-as-reduction
(at one row), and so bring the engine's decode step to issue 17's targets? Each program streams a
BLOCK_N x K_PER_SPLIT band of the weight in BLOCK_K-wide tiles (software-pipelined over num_stages),
multiplying the few rows of x it holds. A weight with few output rows (o_proj, down_proj) also splits K:
each split writes a float32 partial, and the last program of a band to finish (an atomic counter per
band, which it resets) sums the partials and writes y, so a call is one launch either way. One row uses a
product and a row sum; 2-64 rows use tl.dot with the rows padded to 16.

The answer (`sweep_skinny_matmul.py`, README): not enough. In CUDA-graph replay on an H200 the best tiles
beat cuBLAS at 32 rows by 5% per layer and Inductor at one row by ~2.4 us per layer, and every one of
these calls costs 2.5-4 us whatever its size. The engine does not use it: at one row Inductor fuses the
RMSNorm before q/k/v and gate/up into its matmul, which an opaque call would split off again.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmlab.kernels.invariant_matmul_triton import unsupported as invariant_unsupported

MAX_ROWS = 64
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _skinny_kernel(X, W, Y, Part, Count, M, N, K, stride_xm, stride_wn, stride_ym,
                   K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ONE_ROW: tl.constexpr, PREC: tl.constexpr):
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
            x = tl.load(X + ks, mask=k_ok, other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:
            x = tl.load(X + rm[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
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
    """Tiles that keep ~2 programs per SM streaming weight: narrow bands where N allows, K split where it
    does not, and no split shorter than 256 columns of K."""
    block_k = 256 if m == 1 else 128
    block_n = 16 if m == 1 else 32
    bands = math.ceil(n / block_n)
    split_k = max(1, min(math.ceil(2 * sms / bands), k // 256))
    return Launch(block_n, block_k, split_k)


_counters: dict[torch.device, torch.Tensor] = {}


def _band_counters(device: torch.device, bands: int) -> torch.Tensor:
    """Zeroed int32 counters, one per band, kept per device: each call's last program leaves them zero."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < bands:
        counters = torch.zeros(max(bands, 4096), dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters


def launch_skinny(x: torch.Tensor, weight: torch.Tensor, launch: Launch) -> torch.Tensor:
    """y = x @ weight.T for a 2-D x of at most MAX_ROWS rows, with the given tiles."""
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
        x, weight, y, part, counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        K_PER_SPLIT=k_per_split, BLOCK_M=1 if m == 1 else max(16, triton.next_power_of_2(m)),
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SPLIT_K=split_k, ONE_ROW=m == 1,
        PREC="ieee", num_warps=launch.num_warps, num_stages=launch.num_stages)
    return y


@torch.library.custom_op("lmlab_experiments::skinny_matmul", mutates_args=())
def _skinny_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    return launch_skinny(x, weight, choose_launch(m, weight.shape[0], k, sm_count(x.device)))


@_skinny_op.register_fake
def _(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]))


def unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why this call cannot run here (None: it can): lmlab's batch-invariant matmul's limits, and MAX_ROWS."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows of x (supported: 1 to {MAX_ROWS})"
    return invariant_unsupported(x, weight)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for x (..., K) of at most MAX_ROWS rows; see the module docstring."""
    problem = unsupported(x, weight)
    if problem:
        raise ValueError(f"skinny_matmul: {problem}")
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return _skinny_op(flat, weight).view(*x.shape[:-1], weight.shape[0])
