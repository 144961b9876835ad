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
def _swiglu_fwd(g_ptr, u_ptr, y_ptr, g_row_stride, u_row_stride, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
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
        _swiglu_fwd[grid](g2, u2, y, g2.stride(0), u2.stride(0), H, BLOCK=BLOCK, num_warps=4)
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
