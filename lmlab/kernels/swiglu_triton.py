"""Fused SwiGLU activation in Triton: `silu(gate) * up` in one pass, forward and backward.

`swiglu_triton(gate, up)` takes two tensors of the same shape (..., H) and dtype and returns one of
that shape and dtype, computed in float32. Eager PyTorch writes silu(gate) to memory and reads it
back for the product, and its backward keeps that intermediate alive; here the forward reads gate
and up once and writes the output, and the backward recomputes the sigmoid from the saved gate and
up, reading (dy, gate, up) once and writing (d_gate, d_up).

Inputs only need a unit stride along H: rows may be strided, so the two halves of a fused
gate/up projection (`h.chunk(2, -1)`) are read in place rather than copied.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, y_ptr, g_row_stride, u_row_stride, H, x_ptr, x_row_stride, eps, BLOCK: tl.constexpr,
                NORM_D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_D > 0:  # gate and up were projected from x before its RMSNorm: apply the row's scale (swiglu_rms)
        d = tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + row * x_row_stride + d, mask=d < NORM_D, other=0.0).to(tl.float32)
        scale = tl.math.rsqrt(tl.sum(x * x, 0) / NORM_D + eps)
        g, u = g * scale, u * scale
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, g_row_stride, u_row_stride, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # silu'(g) = sig * (1 + g * (1 - sig)).
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + row * H + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * H + cols, (dy * silu).to(du_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    # (..., H) -> (N, H) with unit column stride; a view whenever the leading dims allow it.
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(f"gate and up must match in shape and dtype; got {tuple(gate.shape)} {gate.dtype} "
                             f"and {tuple(up.shape)} {up.dtype}")
        g2, u2 = _rows(gate), _rows(up)
        n_rows, H = g2.shape
        y = torch.empty((n_rows, H), dtype=gate.dtype, device=gate.device)
        grid = (n_rows, triton.cdiv(H, BLOCK))
        _swiglu_fwd[grid](g2, u2, y, g2.stride(0), u2.stride(0), H, g2, 0, 0.0, BLOCK=BLOCK, NORM_D=0, BLOCK_D=1,
                          num_warps=4)
        ctx.save_for_backward(g2, u2)
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g2, u2 = ctx.saved_tensors
        n_rows, H = g2.shape
        dy2 = dy.reshape(n_rows, H).contiguous()
        dg = torch.empty((n_rows, H), dtype=g2.dtype, device=g2.device)
        du = torch.empty_like(dg)
        grid = (n_rows, triton.cdiv(H, BLOCK))
        _swiglu_bwd[grid](g2, u2, dy2, dg, du, g2.stride(0), u2.stride(0), H, BLOCK=BLOCK, num_warps=4)
        return dg.view(dy.shape), du.view(dy.shape)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, fused; gate and up share shape (..., H) and dtype."""
    return FusedSwiGLU.apply(gate, up)


@torch.library.custom_op("lmlab::swiglu_rms", mutates_args=())
def _swiglu_rms_op(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    g2, u2 = _rows(gate_up).chunk(2, dim=-1)  # the halves, read in place
    x2 = _rows(x)
    n_rows, H = g2.shape
    y = torch.empty((n_rows, H), dtype=gate_up.dtype, device=gate_up.device)
    _swiglu_fwd[(n_rows, triton.cdiv(H, BLOCK))](g2, u2, y, g2.stride(0), u2.stride(0), H, x2, x2.stride(0), eps,
                                                  BLOCK=BLOCK, NORM_D=x2.shape[1],
                                                  BLOCK_D=triton.next_power_of_2(x2.shape[1]), num_warps=4)
    return y.view(*gate_up.shape[:-1], H)


@_swiglu_rms_op.register_fake
def _(gate_up, x, eps):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def swiglu_rms(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """silu(s * gate) * (s * up) for gate_up (..., 2H), the gate half then the up half, and s the RMSNorm scale
    1 / sqrt(mean(x^2) + eps) of x's matching row (..., D): a SwiGLU whose input projection ran on x before its
    RMSNorm, with the norm's gain folded into its weight (inference only: no backward)."""
    if gate_up.shape[:-1] != x.shape[:-1] or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_rms: gate_up (..., 2H) and x (..., D) must share their leading shape, got "
                         f"{tuple(gate_up.shape)} and {tuple(x.shape)}")
    return _swiglu_rms_op(gate_up, x, float(eps))
