"""Fused RMSNorm in Triton: one pass over x forward, one pass over (x, dy) backward.

`rms_norm_triton(x, weight, eps)` equals lmlab's `RMSNorm` exactly:
`(x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype) * weight`, so the output has
dtype `promote_types(x.dtype, weight.dtype)`. x is (..., D) with any leading shape; weight is (D,).

`add_rms_norm_triton(x, residual, weight, eps)` is the pre-norm block's residual add fused in front:
it returns `(s, rms_norm(s))` with `s = x + residual` (rounded to their promoted dtype, as eager
PyTorch's add is). Forward: read x and residual, write s and y. Backward: read s, dy and the
gradient reaching s from the residual stream, write one dx that is both inputs' gradient.

Why a kernel: eager PyTorch materialises x.float(), x**2, the normalised x and its cast as
separate tensors, and its backward re-reads them. Here the forward reads x once and writes y plus
one float32 inverse RMS per row; the backward reads x and dy once, writes dx, and reduces the
weight gradient in two stages (each program folds a band of ROWS rows into one row of a float32
partial buffer, prefetching the next row while it finishes the current one; a second kernel sums
the partials), so no atomics and no (N, D) float32 temporaries. ROWS and the warps of the
backward are autotuned per (D, rows); its launch is a torch.library custom op, so torch.compile
calls it opaquely.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_fwd(x_ptr, r_ptr, s_ptr, w_ptr, y_ptr, rstd_ptr, x_row_stride, r_row_stride, eps,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x_raw = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # normalise s = x + residual, rounded to s's dtype as the eager add would be
        r = tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0)
        x_raw = (x_raw.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * D + cols, x_raw, mask=mask)
    x = x_raw.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    # Round the normalised row to x's dtype before the gain, as the reference's `.type_as(x)` does.
    x_hat = (x * rstd).to(x_raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (x_hat * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


def _bwd_configs() -> list[triton.Config]:
    # Rows per program x warps. More rows per program mean fewer dw partials to write and sum;
    # fewer rows mean more programs to fill the GPU. Measured on an H200 at 16384 x 4096 (bf16,
    # with the partial sum): 64 rows and 8-16 warps 113 us, 16 rows 136 us, 2 rows 337 us.
    # Triton's interpreter (TRITON_INTERPRET=1, CPU) cannot benchmark: it gets one config.
    choices = ((4, 4),) if os.environ.get("TRITON_INTERPRET") == "1" else (
        (16, 8), (32, 8), (64, 8), (64, 16), (128, 8))
    return [triton.Config({"ROWS": r}, num_warps=w) for r, w in choices]


_BWD_CONFIGS = _bwd_configs()
# The dw partial buffer is sized for the smallest ROWS tried, so it fits whichever config runs.
_MIN_BWD_ROWS = min(c.kwargs["ROWS"] for c in _BWD_CONFIGS)


@triton.autotune(configs=_BWD_CONFIGS, key=["D", "n_rows"])
@triton.jit
def _rmsnorm_bwd(x_ptr, w_ptr, dy_ptr, rstd_ptr, ds_ptr, dx_ptr, dw_part_ptr, x_row_stride, n_rows,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_DS: tl.constexpr):
    # Each program walks ROWS rows, loading row r + 1 before it reduces and stores row r, so the
    # next row's reads are in flight while this one computes (one row per iteration, no row tile:
    # the loads, not the arithmetic, are what must overlap). Its dw partial is one row of dw_part.
    # HAS_DS: x is add_rms_norm's sum s, and ds (what reached s from the residual stream) adds to dx.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS
    last = tl.minimum(first + ROWS, n_rows)
    x_next = tl.load(x_ptr + first * x_row_stride + cols, mask=col_mask, other=0.0)
    dy_next = tl.load(dy_ptr + first * D + cols, mask=col_mask, other=0.0)
    rstd_next = tl.load(rstd_ptr + first)
    if HAS_DS:
        ds_next = tl.load(ds_ptr + first * D + cols, mask=col_mask, other=0.0)
    for row in range(first, last):
        x_raw, dy, rstd = x_next, dy_next.to(tl.float32), rstd_next
        if HAS_DS:
            ds = ds_next.to(tl.float32)
        more = row + 1 < last
        x_next = tl.load(x_ptr + (row + 1) * x_row_stride + cols, mask=col_mask & more, other=0.0)
        dy_next = tl.load(dy_ptr + (row + 1) * D + cols, mask=col_mask & more, other=0.0)
        rstd_next = tl.load(rstd_ptr + row + 1, mask=more, other=0.0)
        if HAS_DS:
            ds_next = tl.load(ds_ptr + (row + 1) * D + cols, mask=col_mask & more, other=0.0)
        x_hat = x_raw.to(tl.float32) * rstd
        dw_acc += dy * x_hat.to(x_raw.dtype).to(tl.float32)
        # d x_hat = dy * w; dx = rstd * (g - x_hat * mean(g * x_hat)) is the Jacobian of x * rstd(x).
        g = dy * w
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / D))
        if HAS_DS:
            dx += ds
        tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=col_mask)
    tl.store(dw_part_ptr + pid.to(tl.int64) * D + cols, dw_acc, mask=col_mask)


@triton.jit
def _sum_rows(part_ptr, out_ptr, n_parts, D, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Column band of the (n_parts, D) float32 partials, summed down the rows.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < D
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts[:, None] < n_parts) & col_mask[None, :]
        acc += tl.load(part_ptr + parts[:, None] * D + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_mask)


def _launch_params(D: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    # Forward: one row per program, a few 16-byte vectors per thread.
    fwd_warps = 4 if block_d <= 1024 else 8 if block_d <= 4096 else 16
    return block_d, fwd_warps


def _rows(x: torch.Tensor, D: int) -> torch.Tensor:
    """x as (rows, D) with unit column stride; row-strided views are read in place."""
    x2 = x.reshape(-1, D)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s or None, the normalised rows y, 1/rms per row, the rows that were normalised: x's or s)."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight must be ({D},) to match x's last dim; got {tuple(weight.shape)}")
    x2 = _rows(x, D)
    n_rows = x2.shape[0]
    s = r2 = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
        r2 = _rows(residual, D)
        s = torch.empty((n_rows, D), dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    normed = x2 if s is None else s
    y = torch.empty((n_rows, D), dtype=torch.promote_types(normed.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_d, fwd_warps = _launch_params(D)
    _rmsnorm_fwd[(n_rows,)](x2, x2 if r2 is None else r2, y if s is None else s, weight, y, rstd, x2.stride(0),
                            0 if r2 is None else r2.stride(0), eps, D=D, BLOCK_D=block_d,
                            HAS_RESIDUAL=s is not None, num_warps=fwd_warps)
    return s, y, rstd, normed


class FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _, y, rstd, x2 = _forward(x, None, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward_op(x2, weight, dy.reshape(x2.shape), rstd, None)
        return dx.view(dy.shape), dw, None


class FusedAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        s, y, rstd, _ = _forward(x, residual, weight, eps)
        ctx.save_for_backward(s, weight, rstd)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to read
        return s.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, ds: torch.Tensor | None, dy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        s, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the sum was used
            return ds, ds, None, None
        dx, dw = _backward_op(s, weight, dy.reshape(s.shape), rstd, None if ds is None else ds.reshape(s.shape))
        dx = dx.view(dy.shape)
        return dx, dx, dw, None


# The backward is autotuned and its partial count depends on the chosen config; as a custom op,
# torch.compile sees one opaque call and never traces into the autotuner.
@torch.library.custom_op("lmlab::rms_norm_triton_bwd", mutates_args=())
def _backward_op(x2: torch.Tensor, weight: torch.Tensor, dy2: torch.Tensor, rstd: torch.Tensor,
                 ds2: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, D = x2.shape
    dy2 = dy2.contiguous()
    ds2 = None if ds2 is None else ds2.contiguous()
    dx = torch.empty((n_rows, D), dtype=x2.dtype, device=x2.device)
    # Programs write only the first cdiv(n_rows, ROWS) rows of it.
    dw_part = torch.empty((triton.cdiv(n_rows, _MIN_BWD_ROWS), D), dtype=torch.float32, device=x2.device)
    block_d, _ = _launch_params(D)
    _rmsnorm_bwd[lambda meta: (triton.cdiv(n_rows, meta["ROWS"]),)](
        x2, weight, dy2, rstd, dy2 if ds2 is None else ds2, dx, dw_part, x2.stride(0), n_rows, D=D, BLOCK_D=block_d,
        HAS_DS=ds2 is not None)
    n_parts = triton.cdiv(n_rows, _rmsnorm_bwd.best_config.kwargs["ROWS"])  # the config just launched
    dw = torch.empty_like(weight)
    block_n = 32
    _sum_rows[(triton.cdiv(D, block_n),)](dw_part, dw, n_parts, D, BLOCK_P=128, BLOCK_N=block_n, num_warps=4)
    return dx, dw


@_backward_op.register_fake
def _(x2: torch.Tensor, weight: torch.Tensor, dy2: torch.Tensor, rstd: torch.Tensor, ds2: torch.Tensor | None
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return x2.new_empty(x2.shape), weight.new_empty(weight.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of x over its last dim with gain `weight`; see the module docstring for exact semantics."""
    return FusedRMSNorm.apply(x, weight, eps)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) with s = x + residual; see the module docstring."""
    return FusedAddRMSNorm.apply(x, residual, weight, eps)
