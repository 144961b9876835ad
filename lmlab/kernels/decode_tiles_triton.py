"""The decode megakernel's matrix-vector tiles (lmlab.kernels.decode_layers_triton, batch 1): weight tiles cut into
chunks so each row's sum stays in one warp, the input row laid out to meet them, and the products' dequantization
(int8 per row, int4 per group: lmlab.inference.quant's) and rounding, where the reference rounds."""

from __future__ import annotations

import triton
import triton.language as tl

from lmlab.kernels.codes_triton import as_f32, nibbles_f32


@triton.jit
def round_to(x, dt: tl.constexpr):
    return x.to(dt).to(tl.float32)


@triton.jit
def row_scales(S, rows, ok, INT8: tl.constexpr):
    """INT8: the int8 weight rows' scales (float32), loaded with their tile; else ones, which `dequantized` never
    reads (so the unquantized kernel compiles to what it was before int8)."""
    if INT8:
        return tl.load(S + rows, mask=ok, other=0.0).to(tl.float32)
    else:
        return tl.full(rows.shape, 1.0, tl.float32)


@triton.jit
def dequantized(y, scales, INT8: tl.constexpr):
    """Products with int8 codes times their rows' scales (the per-output-channel int8 of lmlab.inference.quant)."""
    if INT8:
        return y * scales
    else:
        return y


@triton.jit
def scaled_round(y, scales, dt: tl.constexpr, INT8: tl.constexpr):
    """A normed matmul's products rounded to dt as the reference rounds them: the matmul's output, then with INT8
    its product with the int8 rows' scales (lmlab.inference.quant's Int8Linear)."""
    if INT8:
        return round_to(round_to(y, dt) * scales, dt)
    else:
        return round_to(y, dt)


@triton.jit
def chunked(KP: tl.constexpr, KC: tl.constexpr):
    """Offsets 0..KP-1 as (KP / KC, KC): an input row cut into KC-column chunks."""
    return tl.arange(0, KP // KC)[:, None] * KC + tl.arange(0, KC)[None, :]


@triton.jit
def weight_tile(W, rows, ok, width, KP: tl.constexpr, KC: tl.constexpr):
    """W[rows, :width] as a (rows, KP / KC, KC) tile (row, chunk, column in the chunk), zero where masked; streamed
    once a step, so evicted from L2 first. With KC = one warp's columns (256 at 16 bytes a thread), Triton lays the
    warps along the rows, so `gemv`'s sums stay inside each warp; with KC = KP they lie along the columns, and each
    sum crosses them through shared memory (three CTA barriers; SASS, 2026-12-04)."""
    ks = chunked(KP, KC)[None, :, :]
    return tl.load(W + rows[:, None, None] * width + ks, mask=ok[:, None, None] & (ks < width), other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def input_columns(KP: tl.constexpr, KC: tl.constexpr, GROUP4: tl.constexpr):
    """The input columns a tile's elements meet: `chunked`, or with GROUP4 (KP / KC, KC, 2), byte j of chunk c
    holding columns 2 (c KC + j) and the one after (KP, KC in bytes)."""
    if GROUP4:
        return chunked(KP, KC)[:, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    else:
        return chunked(KP, KC)


@triton.jit
def input_row(X, width, KP: tl.constexpr, KC: tl.constexpr, GROUP4: tl.constexpr):
    """The one sequence's row of a buffer other programs wrote (from L2: an L1 line could be stale), in float32, laid
    out as the tiles' columns (`input_columns`)."""
    ks = input_columns(KP, KC, GROUP4)
    return tl.load(X + ks, mask=ks < width, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def normed_input_row(x, NormW, d_model, eps, KP: tl.constexpr, KC: tl.constexpr, GROUP4: tl.constexpr):
    """x * gain, rounded as the tensor-core path rounds it, and the row's 1 / rms (applied after the matmul)."""
    ks = input_columns(KP, KC, GROUP4)
    gain = tl.load(NormW + ks, mask=ks < d_model, other=0.0)
    if GROUP4:
        squares = tl.sum(tl.sum(tl.sum(x * x, 2), 1), 0)
    else:
        squares = tl.sum(tl.sum(x * x, 1), 0)
    inv_rms = tl.math.rsqrt(squares / d_model + eps)
    return (x * gain).to(gain.dtype).to(tl.float32), inv_rms


@triton.jit
def gemv(w, x):
    """A `weight_tile` times a `input_row`: (rows,) float32."""
    return tl.sum(tl.sum(as_f32(w) * x[None, :, :], 2), 1)


@triton.jit
def group_scales(S, rows, ok, start, n, groups, GP: tl.constexpr):
    """int4: each (row, group)'s scale and zero, (rows, GP, 2) float32, of a projection whose rows start at row
    `start` of its kind's stack, n rows of `groups` groups: its block, (groups, n, 2) as Int4Linear keeps it, starts at
    2 * groups * start (the kind's projections before it have `groups` groups too)."""
    g = tl.arange(0, GP)[None, :, None]
    at = S + 2 * groups * start + (g * n + (rows - start)[:, None, None]) * 2 + tl.arange(0, 2)[None, None, :]
    return tl.load(at, mask=ok[:, None, None] & (g < groups), other=0.0).to(tl.float32)


@triton.jit
def tile_scales(S, rows, ok, start, n, groups, GP: tl.constexpr, INT8: tl.constexpr, GROUP4: tl.constexpr):
    """A tile's dequantizing factors: `group_scales` (int4) or `row_scales` (int8, or ones)."""
    if GROUP4:
        return group_scales(S, rows, ok, start, n, groups, GP)
    else:
        return row_scales(S, rows, ok, INT8)


@triton.jit
def tile_product(w, scales, x, INT8: tl.constexpr, GROUP4: tl.constexpr):
    """A `weight_tile` times a `input_row`, dequantized by the tile's `tile_scales`: (rows,) float32. int4: per group g of a row,
    scale * sum((code - 8) x) + zero * sum(x)."""
    if GROUP4:
        high, low = nibbles_f32(w)  # (rows, groups, bytes): the even columns', the odd ones'
        x_even, x_odd = tl.split(x)
        per_group = tl.sum(high * x_even[None, :, :] + low * x_odd[None, :, :], 2)
        scale, zero = tl.split(scales)
        return tl.sum(scale * per_group + zero * tl.sum(tl.sum(x, 2), 1)[None, :], 1)
    else:
        return dequantized(gemv(w, x), scales, INT8)


@triton.jit
def normed_gemv(w, scales, x, inv_rms, dt: tl.constexpr, INT8: tl.constexpr, GROUP4: tl.constexpr):
    """`tile_product` of a normed row, rounded where the reference rounds (int4's dequantizing kernel rounds the weights
    to dt, then the matmul's output)."""
    if GROUP4:
        return round_to(tile_product(w, scales, x, INT8, GROUP4) * inv_rms, dt)
    else:
        return scaled_round(gemv(w, x) * inv_rms, scales, dt, INT8)
