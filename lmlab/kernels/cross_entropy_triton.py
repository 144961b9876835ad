"""Fused cross-entropy (with label smoothing and z-loss) over precomputed logits, in Triton.

`cross_entropy_triton(logits, targets, ignore_index, label_smoothing, z_loss)` takes logits
(..., V) in bf16/fp16/fp32 and int64 targets (...,) and returns `(ce, z)`:
ce equals `F.cross_entropy(logits.float(), targets, ignore_index=..., label_smoothing=...)` (mean
over non-ignored rows) and z is the mean over non-ignored rows of logsumexp(logits)**2, or None
when z_loss is False. Both are float32 scalars and both are differentiable.

Why a kernel: the reference upcasts the (N, V) logits to float32 and keeps log-softmax for the
backward, several N x V float32 tensors for a 50k vocabulary. Here the forward walks each row in
blocks with an online max/sum and keeps only one float32 log-sum-exp per row; the backward
recomputes the softmax from the logits and that lse and writes dlogits in the logits' dtype, the
only N x V allocation. The number of valid rows stays on the device (no host sync); as in PyTorch,
if every row is ignored the losses are NaN and the gradients zero. Targets outside [0, V) that are
not ignore_index are not checked (that would need a sync) and give meaningless losses.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _ce_fwd(logits_ptr, targets_ptr, lse_ptr, loss_ptr, row_stride, V, ignore_index, smoothing,
            BLOCK_V: tl.constexpr, HAS_SMOOTHING: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    offs = tl.arange(0, BLOCK_V)
    # A running max per block (one exp per element) and a per-lane rescaled sum, reduced once at the end.
    # The finite floor keeps exp(m_old - m_new) from being exp(-inf + inf) while only padding was seen.
    m = tl.full([], -1e30, dtype=tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    x_sum = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
        if HAS_SMOOTHING:
            x_sum += tl.where(mask, x, 0.0)
    lse = m + tl.log(tl.sum(s, axis=0))
    tl.store(lse_ptr + row, lse)

    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    x_target = tl.load(row_ptr + target, mask=valid, other=0.0).to(tl.float32)
    loss = lse - x_target
    if HAS_SMOOTHING:
        # torch: (1 - eps) * nll + eps * mean over classes of -log p.
        loss = (1.0 - smoothing) * loss + smoothing * (lse - tl.sum(x_sum, axis=0) / V)
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))


@triton.jit
def _ce_bwd(logits_ptr, targets_ptr, lse_ptr, scale_ptr, dlogits_ptr, row_stride, V, ignore_index, smoothing,
            BLOCK_V: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    out_ptr = dlogits_ptr + row * V
    offs = tl.arange(0, BLOCK_V)
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    lse = tl.load(lse_ptr + row)
    # scale = (grad_ce, grad_z) / n_valid, zeroed for ignored rows so they write zeros.
    scale_ce = tl.where(valid, tl.load(scale_ptr), 0.0)
    coef_p = scale_ce
    if HAS_Z:
        coef_p += tl.where(valid, tl.load(scale_ptr + 1), 0.0) * 2.0 * lse
    floor = 0.0
    if HAS_SMOOTHING:
        floor = scale_ce * smoothing / V
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        d = coef_p * p - floor
        d -= tl.where(cols == target, scale_ce * (1.0 - smoothing), 0.0)
        tl.store(out_ptr + cols, d.to(dlogits_ptr.dtype.element_ty), mask=mask)


class FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float,
                z_loss: bool) -> tuple[torch.Tensor, torch.Tensor]:
        V = logits.shape[-1]
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"targets must be {tuple(logits.shape[:-1])} to match logits; got {tuple(targets.shape)}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must lie in [0, 1]; got {label_smoothing}")
        logits2 = logits.reshape(-1, V)
        if logits2.stride(-1) != 1:
            logits2 = logits2.contiguous()
        targets1 = targets.reshape(-1).contiguous()
        n_rows = logits2.shape[0]
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        _ce_fwd[(n_rows,)](logits2, targets1, lse, loss, logits2.stride(0), V, ignore_index, label_smoothing,
                           BLOCK_V=BLOCK_V, HAS_SMOOTHING=label_smoothing > 0.0, num_warps=NUM_WARPS)
        valid = targets1 != ignore_index
        n_valid = valid.sum().float()
        ce = loss.sum() / n_valid
        z = torch.where(valid, lse.square(), 0.0).sum() / n_valid
        ctx.save_for_backward(logits2, targets1, lse, n_valid)
        ctx.logits_shape = logits.shape
        ctx.ignore_index, ctx.label_smoothing, ctx.z_loss = ignore_index, label_smoothing, z_loss
        return ce, z

    @staticmethod
    def backward(ctx: Any, grad_ce: torch.Tensor, grad_z: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        logits2, targets1, lse, n_valid = ctx.saved_tensors
        n_rows, V = logits2.shape
        scale = torch.stack([grad_ce.float(), grad_z.float()]) / n_valid
        dlogits = torch.empty((n_rows, V), dtype=logits2.dtype, device=logits2.device)
        _ce_bwd[(n_rows,)](logits2, targets1, lse, scale, dlogits, logits2.stride(0), V, ctx.ignore_index,
                           ctx.label_smoothing, BLOCK_V=BLOCK_V, HAS_SMOOTHING=ctx.label_smoothing > 0.0,
                           HAS_Z=ctx.z_loss, num_warps=NUM_WARPS)
        return dlogits.view(ctx.logits_shape), None, None, None, None


def cross_entropy_triton(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean cross-entropy, mean lse**2 or None) over the non-ignored rows; see the module docstring."""
    ce, z = FusedCrossEntropy.apply(logits, targets, ignore_index, label_smoothing, z_loss)
    return ce, (z if z_loss else None)
