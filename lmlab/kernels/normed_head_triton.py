"""The final RMSNorm and the output head of a decode step in one pass over the head's weight.

`normed_head(x, gain, eps, head)` gives float32 logits multiplier * rms_norm(x) @ head.weight.T for MAX_ROWS rows
x (rows, d_model), rounded where the reference rounds (the norm's output, the matmul's and the multiplier's product in
x's dtype), so it stands in for `model._head(model.norm(x)).float()` (a soft-capped head takes that path). With
`scales`, head.weight holds int8 codes of an int8-quantized head (lmlab.inference.quant's Int8Linear: weight row v is
codes[v] * scales[v]), read as codes (half the bytes) and scaled after the product, rounded as Int8Linear rounds.

Why a kernel: at batch 1 the head reads 103 MB (llama400m's 50,304 x 1,024 bf16) and is the largest read of a decode
step after the layer stack. Inductor's fused norm + matrix-vector product took 32.7 us of GPU time on an H200 (3.1
TB/s), plus a launch of its own for the norm's mean of squares; this kernel took 25.5 us in the same step
(experiments/inference/h200-2026-12-04d/). Here each program takes ROWS vocabulary rows, computes the input row's norm
itself (d_model values, from L2), and reads its weight tile once; a tile is cut into 256-column chunks, one warp's
16-byte loads across each, so every dot product is summed inside one warp (as lmlab.kernels.decode_tiles_triton's
tiles).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from lmlab.kernels.decode_attention_triton import INTERPRET
from lmlab.kernels.codes_triton import as_f32

if TYPE_CHECKING:
    from lmlab.nn.transformer import OutputHead

ROWS, CHUNK, NUM_WARPS = 16, 256, 4
# Input rows it takes: one (a batch-1 decode step). On an H200 at llama400m it took 29.4 us against Inductor's 32.0 at
# one row, but 40.2 and 57.5 us against 38.3 and 38.1 at two and four (experiments/inference/h200-2026-12-04d/).
MAX_ROWS = 1


@triton.jit
def _round(x, dt: tl.constexpr):
    return x.to(dt).to(tl.float32)


@triton.jit
def _normed_head_kernel(X, Gain, W, Scales, Out, n_rows, vocab, d_model, eps, multiplier,
                        ROWS: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr, SCALED: tl.constexpr,
                        INT8: tl.constexpr):
    dt: tl.constexpr = X.dtype.element_ty
    ids = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ks = tl.arange(0, KP // KC)[:, None] * KC + tl.arange(0, KC)[None, :]  # (chunk, column in the chunk)
    k_ok = ks < d_model
    w = tl.load(W + ids[:, None, None] * d_model + ks[None, :, :], mask=(ids < vocab)[:, None, None] & k_ok[None],
                other=0.0, eviction_policy="evict_first")
    gain = tl.load(Gain + ks, mask=k_ok, other=0.0).to(tl.float32)
    if INT8:
        scales = tl.load(Scales + ids, mask=ids < vocab, other=0.0).to(tl.float32)
    for r in range(n_rows):
        x = tl.load(X + r * d_model + ks, mask=k_ok, other=0.0).to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / d_model + eps)
        normed = _round(_round(x * inv_rms, dt) * gain, dt)  # rms_norm: normalised, rounded, times the gain
        logits = _round(tl.sum(tl.sum(as_f32(w) * normed[None, :, :], 2), 1), dt)
        if INT8:
            logits = _round(logits * scales, dt)
        if SCALED:
            logits = _round(logits * multiplier, dt)
        tl.store(Out + r * vocab + ids, logits, mask=ids < vocab)


def unsupported(x: torch.Tensor, head: OutputHead, scales: torch.Tensor | None = None) -> str | None:
    """Why these rows and this head (with `scales`: int8 codes) cannot take the kernel (None: they can)."""
    if not x.is_cuda and not INTERPRET:
        return "x is not on a CUDA device"
    if head.softcap is not None:
        return "a soft-capped head"
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return f"x must be (rows <= {MAX_ROWS}, d_model), got {tuple(x.shape)}"
    if head.weight.dtype != (x.dtype if scales is None else torch.int8) or head.weight.shape[1] != x.shape[1] \
            or not head.weight.is_contiguous() or not x.is_contiguous():
        return "the head's weight needs x's dtype (int8 with scales), x's width and contiguous rows, as x does"
    if scales is not None and scales.shape != head.weight.shape[:1]:
        return f"scales {tuple(scales.shape)} for {head.weight.shape[0]} rows"
    return None


def normed_head(x: torch.Tensor, gain: torch.Tensor, eps: float, head: OutputHead,
                scales: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, d_model) -> float32 logits (rows, vocab) of head(rms_norm(x, gain, eps)); see the module docstring."""
    problem = unsupported(x, head, scales)
    if problem:
        raise ValueError(f"normed_head: {problem}")
    return _normed_head_op(x, gain, float(eps), head.weight, scales, float(head.multiplier))


# A custom op, so that torch.compile keeps the launch as one call and a CUDA graph captures it
@torch.library.custom_op("lmlab::normed_head", mutates_args=())
def _normed_head_op(x: torch.Tensor, gain: torch.Tensor, eps: float, weight: torch.Tensor,
                    scales: torch.Tensor | None, multiplier: float) -> torch.Tensor:
    vocab, d_model = weight.shape
    out = torch.empty(x.shape[0], vocab, dtype=torch.float32, device=x.device)
    kp = triton.next_power_of_2(d_model)
    _normed_head_kernel[(triton.cdiv(vocab, ROWS),)](x, gain, weight, gain if scales is None else scales, out,
                                                      x.shape[0], vocab, d_model, eps, multiplier, ROWS=ROWS, KP=kp,
                                                      KC=min(CHUNK, kp), SCALED=multiplier != 1.0,
                                                      INT8=scales is not None, num_warps=NUM_WARPS)
    return out


@_normed_head_op.register_fake
def _(x, gain, eps, weight, scales, multiplier):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)
