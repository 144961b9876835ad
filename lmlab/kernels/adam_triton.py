"""Fused Adam/AdamW update in Triton: one kernel per parameter instead of eight.

`adam_update_triton(p, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, decoupled)`
has the signature and arithmetic of lmlab's reference `adam_update` (lmlab.optim.adam): optional
decoupled decay of p, the L2 term otherwise, lerp of the first moment, the second moment,
bias-corrected step. It reads p, grad and both moments once and writes p and the moments once,
computing in float32; the reference launches about eight elementwise kernels per parameter,
which at a few hundred parameters makes the optimizer step launch-bound.

Tensors it cannot serve (not CUDA, not contiguous, sharded DTensors) go to the reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lmlab.optim.adam import adam_update

BLOCK = 4096


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, decay, l2, beta1, beta2, eps, step_size, bias2_sqrt,
                 BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p = p * decay  # 1 - lr * weight_decay for AdamW, 1 for Adam
    g = g + l2 * p  # weight_decay for Adam's L2 penalty, 0 for AdamW
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def _fusable(*tensors: torch.Tensor) -> bool:
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cuda and t.is_contiguous() for t in tensors)


def adam_update_triton(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                       decoupled: bool) -> None:
    if not _fusable(p, grad, exp_avg, exp_avg_sq):
        adam_update(p, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, decoupled)
        return
    beta1, beta2 = betas
    n = p.numel()
    _adam_kernel[(triton.cdiv(n, BLOCK),)](
        p, grad, exp_avg, exp_avg_sq, n,
        1.0 - lr * weight_decay if decoupled else 1.0, 0.0 if decoupled else weight_decay,
        beta1, beta2, eps, lr / (1 - beta1**step), math.sqrt(1 - beta2**step), BLOCK=BLOCK, num_warps=8)
