"""One decode step through a whole Llama layer stack in one persistent Triton kernel (a megakernel): the device
code. `lmlab.kernels.decode_layers` launches it (`decode_layers(...)`, its settings and the scratch it needs). Its
matrix-vector tiles are in lmlab.kernels.decode_tiles_triton, its grid barriers in decode_sync_triton.

`layers_kernel` runs one new token per sequence through every layer of a pre-norm RMSNorm / RoPE / softmax attention
(MHA, GQA, MQA) / SwiGLU stack whose weights are stacked per kind (`lmlab.inference.megakernel.StackedWeights`:
layer-major, q/k/v as one matrix, gate/up as one) and writes each layer's new key and value into the caches.

Why one kernel: at batch 1 the ~400M model's compiled decode step launched 269 kernels (11 a layer),
and each cost 2.5-4 us in CUDA-graph replay whatever the bytes it read (experiments/inference/). Here a
persistent grid (a few programs per SM, never more than the GPU holds at once, or a barrier would wait forever)
walks the layers; each layer is five stages:
  qkv        the q/k/v matmul of the RMS-normed rows (the norm's 1 / rms applied after the products), RoPE; q to
             scratch, k and v into the caches; each item then counts itself done for its kv head
  attention  flash-decoding over (sequence, kv head, key split); an item loads its first block of earlier steps'
             keys and values, then waits only for its kv head's q/k/v items (a counter, not a grid barrier); the
             last split of a (sequence, kv head) to finish (an atomic count) combines the splits
  o_proj     the o_proj matmul, added into the residual stream
  gate/up    RMSNorm as in qkv, the gate and up matmuls, silu(gate) * up to scratch
  down       the down matmul, added into the residual stream
and all programs meet at a grid-wide barrier (an atomic counter) before o_proj, gate/up, down and the next layer's
qkv. With GEMV_O_PROJ_ON_COUNTERS at batch 1, o_proj has no barrier: its items are (head, output rows), each waits
for its kv head's splits (their count), combines that head's splits itself and adds its share into a per-layer
float32 sum with atomics, which gate/up and down read with the residual (the sums' order, so the last bits, then
vary from run to run). The residual stream stays in float32 for the whole step. The matmuls take one of two paths:
  batch 1    matrix-vector products: a work item is a few weight rows over the whole input width, loaded as one
             tile and reduced on the CUDA cores (tiles with a row per warp in 256-column chunks, so that each row's
             sum stays in one warp). A program issues the loads of its next item before it reduces the current
             one, and those of a stage's first item before the barrier that opens the stage, so the weights stream
             while the programs wait; with PREFETCH it also asks L2 for its later gate/up and down items there.
  batch > 1  tensor-core tiles of 16 output rows, in BLOCK_K-column steps, the batch padded to 16 rows.
The first version had only the second path and was slower than the compiled step at batch 1 (1.14 ms for the
layer stack against 0.82 ms for the whole compiled step): its tiles kept too few weight bytes in flight.
With INT8 the four weights are int8 codes, one scale per output row (lmlab.inference.quant's `int8`): the tiles
carry half the bytes, the codes become float32 in registers (lmlab.kernels.codes_triton) and each row's product is
scaled once; the activations keep the norms' dtype. With GROUP4 (batch 1 only) they are int4 codes, two a byte, with
a scale and zero per group of GROUP4 input columns (lmlab.inference.quant's `int4` stored for its `dequant` kernel):
a tile's chunks are its groups, each group's products summed first, then scaled, plus zero times the group's inputs.

STAGE >= 0 runs one (layer, stage) as a kernel of its own instead (no barrier), or stages STAGE to LAST of a layer
(q/k/v, attention and o_proj, whose items wait on counters): the same code, for Triton's CPU interpreter
(TRITON_INTERPRET=1 runs programs one after another, so a barrier there would never open) and as the many-launch
baseline. With PDL those launches are a chain of programmatic dependent launches (sm_90): each lets the
next start at once, and waits for the one before (`griddepcontrol.wait`) where the persistent kernel would wait at a
grid barrier, after issuing its first tiles' loads; nothing it reads before that wait is written in the step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmlab.kernels.decode_attention_triton import (attend_block, attend_key_range, combined_output, empty_state,
                                                   key_split)
from lmlab.kernels.codes_triton import as_f32
from lmlab.kernels.decode_sync_triton import (barrier_arrive, grid_barrier, let_next_launch, prefetch_rows, stamp,
                                              wait_for_previous, wait_until)
from lmlab.kernels.decode_tiles_triton import (dequantized, input_row, normed_gemv, normed_input_row, round_to,
                                               row_scales, scaled_round, tile_product, tile_scales, weight_tile)


@triton.jit
def _normed_matmul_pair(X, NormW, W, S, w_rows1, w_rows2, w_ok, rows, row_ok, d_model, eps,
                        BB: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr, INT8: tl.constexpr):
    """RMSNorm(X rows) @ W[w_rows1].T and @ W[w_rows2].T (BB, 16) each, in float32. The rows' 1 / rms is a
    factor of each output row, so it is applied after the loop that also sums the squares: one pass over X. INT8:
    W holds int8 codes (exact in the activations' dtype) and S their rows' scales, applied to the products."""
    acc1 = tl.zeros((BB, 16), tl.float32)
    acc2 = tl.zeros((BB, 16), tl.float32)
    squares = tl.zeros((BB,), tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < d_model
        x = tl.load(X + rows[:, None] * d_model + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                    cache_modifier=".cg")
        gain = tl.load(NormW + ks, mask=k_ok, other=0.0)
        squares += tl.sum(x * x, 1)
        xg = (x * gain[None, :]).to(gain.dtype)
        ok = w_ok[:, None] & k_ok[None, :]
        w1 = tl.load(W + w_rows1[:, None] * d_model + ks[None, :], mask=ok, other=0.0)
        w2 = tl.load(W + w_rows2[:, None] * d_model + ks[None, :], mask=ok, other=0.0)
        acc1 = tl.dot(xg, tl.trans(w1.to(xg.dtype)), acc1, input_precision=PREC)
        acc2 = tl.dot(xg, tl.trans(w2.to(xg.dtype)), acc2, input_precision=PREC)
    inv_rms = tl.math.rsqrt(squares / d_model + eps)[:, None]
    # rounded to the activations' dtype, as the reference's matmuls round their outputs (and its scales' products)
    dt: tl.constexpr = NormW.dtype.element_ty
    return (scaled_round(acc1 * inv_rms, row_scales(S, w_rows1, w_ok, INT8)[None, :], dt, INT8),
            scaled_round(acc2 * inv_rms, row_scales(S, w_rows2, w_ok, INT8)[None, :], dt, INT8))


@triton.jit
def _qkv_rows(item, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, INTERLEAVED: tl.constexpr):
    """A q/k/v work item -> its head, its RoPE frequencies, and the two rows of that head each frequency rotates."""
    HALF: tl.constexpr = HEAD_DIM // 2
    CHUNKS: tl.constexpr = HALF // PAIRS
    head = item // CHUNKS  # q heads, then k heads, then v heads
    freq = (item % CHUNKS) * PAIRS + tl.arange(0, PAIRS)
    if INTERLEAVED:
        first, second = 2 * freq, 2 * freq + 1
    else:
        first, second = freq, freq + HALF
    return head, freq, first, second


@triton.jit
def _rope_tables(Cos, Sin, pos, freq, row_ok, HEAD_DIM: tl.constexpr):
    """RoPE's cos and sin at each row's position `pos` for the frequencies `freq`: (rows, pairs) each."""
    HALF: tl.constexpr = HEAD_DIM // 2
    cos = tl.load(Cos + pos[:, None] * HALF + freq[None, :], mask=row_ok[:, None], other=1.0)
    sin = tl.load(Sin + pos[:, None] * HALF + freq[None, :], mask=row_ok[:, None], other=0.0)
    return cos, sin


@triton.jit
def _qkv_out(acc1, acc2, head, freq, first, second, Q, Kc, Vc, cos, sin, Sync, slot, rows, row_ok, sc_b, sc_h,
             sc_l, n_heads, n_kv_heads, HEAD_DIM: tl.constexpr):
    """RoPE (cos, sin: `_rope_tables`) on a (batch, pairs) item of q or k; q to scratch, k and v into the caches at
    `slot`; then the item counts itself done in its kv head's counter (Sync[1 + kv head]), which the attention items
    wait on."""
    rotated = head < n_heads + n_kv_heads
    out1 = tl.where(rotated, acc1 * cos - acc2 * sin, acc1)
    out2 = tl.where(rotated, acc2 * cos + acc1 * sin, acc2)
    ok = row_ok[:, None]
    q_at = Q + (rows[:, None] * n_heads + head) * HEAD_DIM
    tl.store(q_at + first[None, :], out1, mask=ok & (head < n_heads))
    tl.store(q_at + second[None, :], out2, mask=ok & (head < n_heads))
    kv_head = (head - n_heads) % n_kv_heads
    cache_at = rows[:, None] * sc_b + kv_head * sc_h + slot * sc_l
    is_k = (head >= n_heads) & (head < n_heads + n_kv_heads)
    tl.store(Kc + cache_at + first[None, :], out1.to(Kc.dtype.element_ty), mask=ok & is_k)
    tl.store(Kc + cache_at + second[None, :], out2.to(Kc.dtype.element_ty), mask=ok & is_k)
    is_v = head >= n_heads + n_kv_heads
    tl.store(Vc + cache_at + first[None, :], out1.to(Vc.dtype.element_ty), mask=ok & is_v)
    tl.store(Vc + cache_at + second[None, :], out2.to(Vc.dtype.element_ty), mask=ok & is_v)
    tl.debug_barrier()  # the item's stores are all issued before it counts itself done for its kv head
    group = tl.where(head < n_heads, head // (n_heads // n_kv_heads), kv_head)
    tl.atomic_add(Sync + 1 + group, 1, sem="release", scope="gpu")


@triton.jit
def _qkv_stage(X, NormW, W, S, Q, Kc, Vc, Cos, Sin, Sync, Slots, Start, rows, row_ok, pid, n_programs, eps,
               sc_b, sc_h, sc_l, d_model, n_heads, n_kv_heads,
               BB: tl.constexpr, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, INTERLEAVED: tl.constexpr,
               BLOCK_K: tl.constexpr, PREC: tl.constexpr, INT8: tl.constexpr):
    tl.static_assert(PAIRS == 16)  # two (batch, 16) tensor-core products per item
    slot = tl.load(Slots)
    pos = tl.maximum(slot - tl.load(Start + rows, mask=row_ok, other=0), 0)
    for item in range(pid, (n_heads + 2 * n_kv_heads) * (HEAD_DIM // 2 // PAIRS), n_programs):
        head, freq, first, second = _qkv_rows(item, HEAD_DIM, PAIRS, INTERLEAVED)
        acc1, acc2 = _normed_matmul_pair(X, NormW, W, S, head * HEAD_DIM + first, head * HEAD_DIM + second,
                                         freq < HEAD_DIM, rows, row_ok, d_model, eps, BB, BLOCK_K, PREC, INT8)
        cos, sin = _rope_tables(Cos, Sin, pos, freq, row_ok, HEAD_DIM)
        _qkv_out(acc1, acc2, head, freq, first, second, Q, Kc, Vc, cos, sin, Sync, slot, rows, row_ok,
                 sc_b, sc_h, sc_l, n_heads, n_kv_heads, HEAD_DIM)


@triton.jit
def _qkv_tiles(W, S, item, n_items, d_model, n_heads, n_kv_heads, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr,
               INTERLEAVED: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr, INT8: tl.constexpr,
               GROUP4: tl.constexpr):
    """A q/k/v item's two tiles (the rows each RoPE frequency rotates together) and their `tile_scales`."""
    head, freq, first, second = _qkv_rows(item, HEAD_DIM, PAIRS, INTERLEAVED)
    ok = (freq < HEAD_DIM) & (item < n_items)
    rows1, rows2 = head * HEAD_DIM + first, head * HEAD_DIM + second
    # the head's projection (q, k or v): its first row in the stack and its rows
    start = tl.where(head < n_heads, 0, tl.where(head < n_heads + n_kv_heads, n_heads, n_heads + n_kv_heads)) * HEAD_DIM
    n = tl.where(head < n_heads, n_heads, n_kv_heads) * HEAD_DIM
    groups = d_model // tl.maximum(GROUP4, 1)
    return (weight_tile(W, rows1, ok, d_model // (2 if GROUP4 else 1), KP, KC),
            weight_tile(W, rows2, ok, d_model // (2 if GROUP4 else 1), KP, KC),
            tile_scales(S, rows1, ok, start, n, groups, KP // KC, INT8, GROUP4),
            tile_scales(S, rows2, ok, start, n, groups, KP // KC, INT8, GROUP4))


@triton.jit
def _qkv_item_rope(Cos, Sin, pos, item, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, INTERLEAVED: tl.constexpr):
    """_rope_tables of a matrix-vector q/k/v item, (1, PAIRS) each."""
    _, freq, _, _ = _qkv_rows(item, HEAD_DIM, PAIRS, INTERLEAVED)
    return _rope_tables(Cos, Sin, pos, freq, pos >= 0, HEAD_DIM)


@triton.jit
def _qkv_gemv(X, NormW, W, S, Q, Kc, Vc, Cos, Sin, Sync, slot, pos, pid, n_programs, n_items, eps, sc_b, sc_h,
              sc_l, d_model, n_heads, n_kv_heads, w1, w2, s1, s2, cos, sin,
              HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, INTERLEAVED: tl.constexpr, KP: tl.constexpr,
              KC: tl.constexpr, INT8: tl.constexpr, GROUP4: tl.constexpr):
    """_qkv_stage for one sequence (at position pos (1,), cache slot `slot`), as matrix-vector products; w1, w2: the
    first item's tiles, already loading (s1, s2 their scales), and cos, sin its RoPE tables (loaded before the
    barrier, not after the products: one round trip to memory off the chain that every attention item waits on)."""
    rows = tl.arange(0, 1)
    dt: tl.constexpr = NormW.dtype.element_ty
    x, inv_rms = normed_input_row(input_row(X, d_model, KP, KC, GROUP4), NormW, d_model, eps, KP, KC, GROUP4)
    for item in range(pid, n_items, n_programs):
        next1, next2, next_s1, next_s2 = _qkv_tiles(W, S, item + n_programs, n_items, d_model, n_heads, n_kv_heads,
                                                    HEAD_DIM, PAIRS, INTERLEAVED, KP, KC, INT8, GROUP4)
        next_cos, next_sin = _qkv_item_rope(Cos, Sin, pos, item + n_programs, HEAD_DIM, PAIRS, INTERLEAVED)
        head, freq, first, second = _qkv_rows(item, HEAD_DIM, PAIRS, INTERLEAVED)
        _qkv_out(normed_gemv(w1, s1, x, inv_rms, dt, INT8, GROUP4)[None, :],
                 normed_gemv(w2, s2, x, inv_rms, dt, INT8, GROUP4)[None, :], head, freq, first,
                 second, Q, Kc, Vc, cos, sin, Sync, slot, rows, rows < 1, sc_b, sc_h, sc_l, n_heads,
                 n_kv_heads, HEAD_DIM)
        w1, w2, s1, s2, cos, sin = next1, next2, next_s1, next_s2, next_cos, next_sin


@triton.jit
def _attend_own_key(q, k, v, holds, qk_scale, m_i, l_i, acc):
    """attend_block for one key, the query's own (k, v: (HEAD_DIM,)), where `holds`; rounded as the blocks round
    (q and the probabilities in the caches' dtype, products summed in float32)."""
    score = tl.where(holds, tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, score)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(score - m_safe)
    p_rounded = p.to(v.dtype).to(tl.float32)
    return m_new, l_i * alpha + p, acc * alpha[:, None] + p_rounded[:, None] * v.to(tl.float32)[None, :]


@triton.jit
def _attention_stage(Q, Kc, Vc, PartO, PartL, Attn, Arrived, Sync, Slots, Start, layer, pid, n_programs, batch,
                     n_heads, n_kv_heads, n_split, sc_b, sc_h, sc_l, qk_scale,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_SPLIT: tl.constexpr, QKV_PAIRS: tl.constexpr, PREC: tl.constexpr,
                     COMBINE: tl.constexpr, PDL: tl.constexpr):
    """Flash-decoding over (sequence, kv head, key split). An item loads its first block of earlier steps' keys and
    values, then waits for every q/k/v item of its kv head (a counter; no grid barrier after qkv), and counts itself
    in Arrived once its partial results are out. COMBINE: the last split of a (sequence, kv head) to finish combines
    the splits into the attention output (Attn, batch x heads * head_dim); else o_proj's items combine them."""
    qkv_items = (GROUP + 2) * (HEAD_DIM // 2 // QKV_PAIRS)  # per kv head and layer: its q heads, its k and its v
    slot = tl.load(Slots, cache_modifier=".cg")
    r = tl.arange(0, BLOCK_M)
    r_ok = r < GROUP
    dims = tl.arange(0, HEAD_DIM)
    for item in range(pid, batch * n_kv_heads * n_split, n_programs):
        split = item % n_split
        bg = item // n_split  # (sequence, kv head)
        b = bg // n_kv_heads
        kv_head = bg % n_kv_heads
        head = kv_head * GROUP + r
        start = tl.load(Start + b, cache_modifier=".cg")
        k_lo, k_hi = key_split(tl.minimum(start, slot), slot + 1, split, n_split, BLOCK_N)
        k_base, v_base = Kc + b * sc_b + kv_head * sc_h, Vc + b * sc_b + kv_head * sc_h
        keys = k_lo + tl.arange(0, BLOCK_N)
        before = tl.minimum(k_hi, slot)  # the split's keys from earlier steps end here; this step's is the range's last
        earlier = keys < before  # loaded while the q/k/v items run
        k = tl.load(k_base + keys[:, None] * sc_l + dims[None, :], mask=earlier[:, None], other=0.0)
        v = tl.load(v_base + keys[:, None] * sc_l + dims[None, :], mask=earlier[:, None], other=0.0)
        holds = (k_lo <= slot) & (slot < k_hi)  # the split whose range ends with this step's key
        wait_for_previous(PDL)
        wait_until(Sync + 1 + kv_head, (layer + 1) * qkv_items)
        # This step's key and value (vectors, attended on their own after the blocks), then q: loads issued before any
        # is used (when the step's key was merged into the block, the compiled code waited for each load in turn)
        k_new = tl.load(k_base + slot * sc_l + dims, mask=holds & (dims < HEAD_DIM), other=0.0, cache_modifier=".cg")
        v_new = tl.load(v_base + slot * sc_l + dims, mask=holds & (dims < HEAD_DIM), other=0.0, cache_modifier=".cg")
        q = tl.load(Q + (b * n_heads + head)[:, None] * HEAD_DIM + dims[None, :], mask=r_ok[:, None], other=0.0,
                    cache_modifier=".cg").to(Kc.dtype.element_ty)
        q_slot = tl.zeros((BLOCK_M,), tl.int64) + slot
        m_i, l_i, acc = empty_state(BLOCK_M, HEAD_DIM)
        m_i, l_i, acc = attend_block(q, k, v, keys, earlier, q_slot, start, qk_scale, 0, m_i, l_i, acc, False, PREC)
        m_i, l_i, acc = attend_key_range(q, k_base, v_base, sc_l, sc_l, k_lo + BLOCK_N, before, q_slot, start,
                                         qk_scale, 0, m_i, l_i, acc, BLOCK_N, HEAD_DIM, False, PREC)
        m_i, l_i, acc = _attend_own_key(q, k_new, v_new, holds, qk_scale, m_i, l_i, acc)
        part = (b * n_heads + head) * n_split
        tl.store(PartL + part + split, tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i)), mask=r_ok)
        tl.store(PartO + (part + split)[:, None] * HEAD_DIM + dims[None, :],
                 acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None], mask=r_ok[:, None])
        tl.debug_barrier()  # this program's partial results are all issued before it counts itself in
        arrived = tl.atomic_add(Arrived + bg, 1, sem="acq_rel", scope="gpu")  # counts up over the layers
        if COMBINE and arrived == (layer + 1) * n_split - 1:
            for g in range(GROUP):
                row = b * n_heads + kv_head * GROUP + g
                out = combined_output(PartO, PartL, row, n_split, HEAD_DIM, BLOCK_SPLIT)
                tl.store(Attn + row * HEAD_DIM + dims, out.to(Attn.dtype.element_ty))


@triton.jit
def _o_proj_tile(W, S, item, d_model, width, TILE: tl.constexpr, HEAD_DIM: tl.constexpr, INT8: tl.constexpr):
    """o_proj's item (head, chunk of TILE output rows): W[rows, head's columns], a (TILE, HEAD_DIM) tile, and the
    rows' scales."""
    chunks = tl.cdiv(d_model, TILE)
    rows = (item % chunks) * TILE + tl.arange(0, TILE)
    cols = (item // chunks) * HEAD_DIM + tl.arange(0, HEAD_DIM)
    ok = (rows < d_model)[:, None] & (cols < width)[None, :]
    return (tl.load(W + rows[:, None] * width + cols[None, :], mask=ok, other=0.0, eviction_policy="evict_first"),
            row_scales(S, rows, rows < d_model, INT8))


@triton.jit
def _o_proj_gemv(W, S, PartO, PartL, Arrived, OAcc, layer, pid, n_programs, d_model, n_heads, n_split,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SPLIT: tl.constexpr, TILE: tl.constexpr,
                 DT: tl.constexpr, INT8: tl.constexpr, PDL: tl.constexpr):
    """o_proj for one sequence without a grid barrier: an item is (head, chunk of output rows). It waits only for
    its kv head's attention splits (their count in Arrived), combines that head's splits itself, and adds its
    share, In[head] @ W[rows, head].T, into OAcc with atomics (the next stages read the residual as X + OAcc).
    Items are taken from the last program down, so the programs with no attention item take them first."""
    chunks = tl.cdiv(d_model, TILE)
    first = n_programs - 1 - pid
    w, s = _o_proj_tile(W, S, first, d_model, n_heads * HEAD_DIM, TILE, HEAD_DIM, INT8)
    wait_for_previous(PDL)
    for item in range(first, n_heads * chunks, n_programs):
        next_w, next_s = _o_proj_tile(W, S, item + n_programs, d_model, n_heads * HEAD_DIM, TILE, HEAD_DIM, INT8)
        head = item // chunks
        wait_until(Arrived + head // GROUP, (layer + 1) * n_split)
        attn = combined_output(PartO, PartL, head, n_split, HEAD_DIM, BLOCK_SPLIT)
        attn = round_to(attn, DT)  # rounded as the reference's attention output
        rows = (item % chunks) * TILE + tl.arange(0, TILE)
        tl.atomic_add(OAcc + rows, dequantized(tl.sum(as_f32(w) * attn[None, :], 1), s, INT8),
                      mask=rows < d_model, sem="relaxed", scope="gpu")
        w, s = next_w, next_s


@triton.jit
def _matmul_add_stage(X, Out, last, W, S, In, rows, row_ok, pid, n_programs, d_model, width,
                      BB: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr, INT8: tl.constexpr):
    """X[rows] += In[rows] @ W.T, W (d_model, width): o_proj over the attention output, down over the FFN's; where
    `last`, the sums also go to Out in its dtype (the step's output). INT8: W is int8 codes, S their rows' scales."""
    for item in range(pid, tl.cdiv(d_model, 16), n_programs):
        cols = item * 16 + tl.arange(0, 16)
        col_ok = cols < d_model
        acc = tl.zeros((BB, 16), tl.float32)
        for k0 in range(0, width, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < width
            a = tl.load(In + rows[:, None] * width + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                        cache_modifier=".cg")
            w = tl.load(W + cols[:, None] * width + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PREC)
        at = rows[:, None] * d_model + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        acc = dequantized(acc, row_scales(S, cols, col_ok, INT8)[None, :], INT8)
        total = tl.load(X + at, mask=ok, other=0.0, cache_modifier=".cg") + acc
        tl.store(X + at, total, mask=ok)  # the residual stream stays float32
        tl.store(Out + at, total.to(Out.dtype.element_ty), mask=ok & last)


@triton.jit
def _swiglu(gate, up, dt: tl.constexpr):
    return (gate * tl.sigmoid(gate)).to(dt) * up.to(dt)  # rounded where the reference rounds: silu, then the product


@triton.jit
def _gate_up_stage(X, NormW, W, S, Act, rows, row_ok, pid, n_programs, eps, d_model, d_ff,
                   BB: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr, INT8: tl.constexpr):
    for item in range(pid, tl.cdiv(d_ff, 16), n_programs):
        cols = item * 16 + tl.arange(0, 16)
        col_ok = cols < d_ff
        gate, up = _normed_matmul_pair(X, NormW, W, S, cols, d_ff + cols, col_ok, rows, row_ok, d_model, eps,
                                       BB, BLOCK_K, PREC, INT8)
        tl.store(Act + rows[:, None] * d_ff + cols[None, :], _swiglu(gate, up, Act.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_tiles(W, S, item, d_model, d_ff, TILE: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
                   INT8: tl.constexpr, GROUP4: tl.constexpr):
    """A gate/up item's gate and up tiles and their `tile_scales`."""
    cols = item * TILE + tl.arange(0, TILE)
    ok = cols < d_ff
    width = d_model // (2 if GROUP4 else 1)
    groups = d_model // tl.maximum(GROUP4, 1)
    return (weight_tile(W, cols, ok, width, KP, KC), weight_tile(W, d_ff + cols, ok, width, KP, KC),
            tile_scales(S, cols, ok, 0, d_ff, groups, KP // KC, INT8, GROUP4),
            tile_scales(S, d_ff + cols, ok, d_ff, d_ff, groups, KP // KC, INT8, GROUP4))


@triton.jit
def _prefetch_gate_up(W, d_ff, width, first_item, n_programs, TILE: tl.constexpr):
    """prefetch_rows of a program's gate/up items from first_item on: their gate rows and their up rows."""
    prefetch_rows(W, 0, d_ff, width, first_item, n_programs, TILE)
    prefetch_rows(W, d_ff, d_ff, width, first_item, n_programs, TILE)


@triton.jit
def _gate_up_gemv(X, OAcc, NormW, W, S, Act, pid, n_programs, eps, d_model, d_ff, gate_w, up_w, gate_s, up_s,
                  TILE: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr, INT8: tl.constexpr, GROUP4: tl.constexpr):
    """_gate_up_stage for one sequence, whose residual is X + OAcc (o_proj's sums); gate_w, up_w: the first item's
    tiles, already loading (gate_s, up_s their scales)."""
    dt: tl.constexpr = Act.dtype.element_ty
    residual = input_row(X, d_model, KP, KC, GROUP4) + input_row(OAcc, d_model, KP, KC, GROUP4)
    x, inv_rms = normed_input_row(residual, NormW, d_model, eps, KP, KC, GROUP4)
    for item in range(pid, tl.cdiv(d_ff, TILE), n_programs):
        next_gate, next_up, next_gate_s, next_up_s = _gate_up_tiles(W, S, item + n_programs, d_model, d_ff, TILE, KP,
                                                                    KC, INT8, GROUP4)
        cols = item * TILE + tl.arange(0, TILE)
        tl.store(Act + cols, _swiglu(normed_gemv(gate_w, gate_s, x, inv_rms, dt, INT8, GROUP4),
                                     normed_gemv(up_w, up_s, x, inv_rms, dt, INT8, GROUP4), dt), mask=cols < d_ff)
        gate_w, up_w, gate_s, up_s = next_gate, next_up, next_gate_s, next_up_s


@triton.jit
def _add_tile(W, S, item, d_model, width, TILE: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
              INT8: tl.constexpr, GROUP4: tl.constexpr):
    """A down (or o_proj) item's tile and its `tile_scales`."""
    cols = item * TILE + tl.arange(0, TILE)
    ok = cols < d_model
    return (weight_tile(W, cols, ok, width // (2 if GROUP4 else 1), KP, KC),
            tile_scales(S, cols, ok, 0, d_model, width // tl.maximum(GROUP4, 1), KP // KC, INT8, GROUP4))


@triton.jit
def _add_gemv(X, Out, last, OAcc, W, S, In, pid, n_programs, d_model, width, w, s, TILE: tl.constexpr,
              KP: tl.constexpr, KC: tl.constexpr, INT8: tl.constexpr, GROUP4: tl.constexpr):
    """_matmul_add_stage for one sequence, also folding o_proj's sums (OAcc) into X; w: the first item's tile,
    already loading (s its scales)."""
    a = input_row(In, width, KP, KC, GROUP4)
    for item in range(pid, tl.cdiv(d_model, TILE), n_programs):
        next_w, next_s = _add_tile(W, S, item + n_programs, d_model, width, TILE, KP, KC, INT8, GROUP4)
        cols = item * TILE + tl.arange(0, TILE)
        ok = cols < d_model
        residual = tl.load(X + cols, mask=ok, other=0.0, cache_modifier=".cg")
        residual += tl.load(OAcc + cols, mask=ok, other=0.0, cache_modifier=".cg")
        residual += tile_product(w, s, a, INT8, GROUP4)
        tl.store(X + cols, residual, mask=ok)
        tl.store(Out + cols, residual.to(Out.dtype.element_ty), mask=ok & last)
        w, s = next_w, next_s


@triton.jit
def _residual_matmul(X, Out, last, OAcc, W, S, In, Sync, target, rows, row_ok, pid, n_programs, d_model, width,
                     Stamp, BARRIER: tl.constexpr, GEMV: tl.constexpr, TILE: tl.constexpr, KP: tl.constexpr,
                     KC: tl.constexpr, BB: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                     ARRIVE_FIRST: tl.constexpr, PREFETCH: tl.constexpr, TIMELINE: tl.constexpr,
                     INT8: tl.constexpr, GROUP4: tl.constexpr, PDL: tl.constexpr):
    """X += In @ W.T (down; o_proj where its items do not wait on counters), the matrix-vector path also folding in
    OAcc, and where `last` also written to Out; opened by a grid barrier (Sync[0] reaching `target`) when BARRIER, and
    stamped at Stamp once open; the first matrix-vector tile's loads are issued before the wait (and, with ARRIVE_FIRST,
    after the arrival)."""
    if BARRIER and ARRIVE_FIRST:
        barrier_arrive(Sync)
    if GEMV:
        w, s = _add_tile(W, S, pid, d_model, width, TILE, KP, KC, INT8, GROUP4)
    if PREFETCH and (BARRIER or PDL):
        prefetch_rows(W, 0, d_model, width // (2 if GROUP4 else 1), pid + n_programs, n_programs, TILE)
    if BARRIER:
        grid_barrier(Sync, target, ARRIVE_FIRST)
    wait_for_previous(PDL)
    stamp(Stamp, TIMELINE)
    if GEMV:
        _add_gemv(X, Out, last, OAcc, W, S, In, pid, n_programs, d_model, width, w, s, TILE, KP, KC, INT8, GROUP4)
    else:
        _matmul_add_stage(X, Out, last, W, S, In, rows, row_ok, pid, n_programs, d_model, width, BB, BLOCK_K, PREC,
                          INT8)


@triton.jit
def layers_kernel(X, Out, Wqkv, Wo, Wgu, Wd, Scales, Norm1, Norm2, Kc, Vc, Q, PartO, PartL, Attn, Arrived, Act, Cos,
                  Sin, Slots, Start, Sync, OAcc, Times, layer_lo, layer_hi, batch, d_model, d_ff, n_heads, n_kv_heads,
                  n_split, eps, qk_scale, sc_layer, sc_b, sc_h, sc_l,
                  STAGE: tl.constexpr, LAST: tl.constexpr, BB: tl.constexpr, HEAD_DIM: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SPLIT: tl.constexpr,
                  BLOCK_K: tl.constexpr, INTERLEAVED: tl.constexpr, PREC: tl.constexpr, GEMV: tl.constexpr,
                  KP_MODEL: tl.constexpr, KP_ATTN: tl.constexpr, KP_FF: tl.constexpr, C_MODEL: tl.constexpr,
                  C_ATTN: tl.constexpr, C_FF: tl.constexpr, PREFETCH: tl.constexpr, T_QKV: tl.constexpr,
                  T_O: tl.constexpr, T_GU: tl.constexpr, T_D: tl.constexpr, SPLIT_O: tl.constexpr,
                  ARRIVE_FIRST: tl.constexpr, GATE_UP_EARLY: tl.constexpr, PREFETCH_GU_EARLY: tl.constexpr,
                  PREFETCH_DOWN_EARLY: tl.constexpr, TIMELINE: tl.constexpr, INT8: tl.constexpr,
                  GROUP4: tl.constexpr, PDL: tl.constexpr):
    """X: the float32 residual stream, updated in place; the launch's last layer also writes it to Out in Out's dtype.
    INT8: the four weights hold int8 codes, and Scales (layer, rows of q/k/v, o, gate/up, down) their rows' scales.
    GROUP4 (> 0, GEMV without SPLIT_O): they hold int4 codes two a byte, and Scales per layer each projection's
    (groups, rows, 2) scales and zeros in the weights' order; KP_* and C_* count bytes. The activations' dtype is the
    norms' (Norm1's).
    STAGE -1 (LAST 4): every stage of layers [layer_lo, layer_hi) with a grid barrier before each stage but the first
    (and on the GEMV path but o_proj, whose items wait on counters); else stages STAGE to LAST of one layer (one
    stage, or q/k/v, attention and o_proj together where o_proj's items wait on counters, SPLIT_O). So stage k runs
    where STAGE <= k <= LAST. GEMV: batch 1, matrix-vector
    tiles whose first loads are issued before the barrier's wait (with ARRIVE_FIRST after the program arrives, so its
    arrival does not wait on them; with GATE_UP_EARLY, gate/up's are issued before o_proj, while its items wait on
    attention); o_proj adds into OAcc[layer], not X. PREFETCH (with GEMV and barriers or PDL):
    the programs also ask L2 for the later items of gate/up and down as they arrive (with PDL, before the wait);
    with PREFETCH_GU_EARLY (and GATE_UP_EARLY) gate/up's with its first tiles, before o_proj; with
    PREFETCH_DOWN_EARLY all of down's items as they arrive at gate/up's barrier.
    TIMELINE: each program stamps eight moments a layer into Times (layer - layer_lo, moment, program), int64 ns:
    qkv open, qkv done, attention done, o_proj done, gate/up open, gate/up done, down open, down done.
    PDL (STAGE >= 0, each launch a link of a programmatic-dependent-launch chain): the next launch may start at once;
    this one waits for the previous where a barrier would open its stage, after issuing its first weight loads."""
    tl.static_assert(not PDL or STAGE >= 0)
    tl.static_assert((STAGE < 0 and LAST == 4) or LAST == STAGE or (STAGE == 0 and LAST == 2 and SPLIT_O))
    let_next_launch(PDL)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    rows = tl.arange(0, BB)
    row_ok = rows < batch
    qkv_rows = (n_heads + 2 * n_kv_heads) * HEAD_DIM
    n_qkv_items = (n_heads + 2 * n_kv_heads) * (HEAD_DIM // 2 // T_QKV)
    width = n_heads * HEAD_DIM
    BARRIERS: tl.constexpr = 3 if SPLIT_O else 4  # per layer
    PACK: tl.constexpr = 2 if GROUP4 else 1  # codes per weight element
    EARLY_GU: tl.constexpr = GATE_UP_EARLY and GEMV and STAGE < 0
    GU_AHEAD: tl.constexpr = EARLY_GU and PREFETCH and PREFETCH_GU_EARLY  # gate/up's L2 prefetch before o_proj
    if GEMV:  # the same every layer: the position, and the RoPE tables of the program's first q/k/v item
        slot = tl.load(Slots, cache_modifier=".cg")
        pos = tl.maximum(slot - tl.load(Start + rows, cache_modifier=".cg"), 0)
        cos, sin = _qkv_item_rope(Cos, Sin, pos, pid, HEAD_DIM, T_QKV, INTERLEAVED)
    for layer in range(layer_lo, layer_hi):
        at = tl.cast(layer, tl.int64)
        arrivals = (layer - layer_lo) * BARRIERS * n_programs  # every program's arrivals at earlier layers' barriers
        kc, vc = Kc + at * sc_layer, Vc + at * sc_layer
        wqkv, wo = Wqkv + at * qkv_rows * (d_model // PACK), Wo + at * d_model * (width // PACK)
        wgu, wd = Wgu + at * 2 * d_ff * (d_model // PACK), Wd + at * d_model * (d_ff // PACK)
        o_acc = OAcc + at * d_model
        # this layer's scales, in the weights' order: per (group, row) a scale and a zero (int4), or per row (int8)
        if GROUP4:
            per_model, per_attn, per_ff = 2 * (d_model // GROUP4), 2 * (width // GROUP4), 2 * (d_ff // GROUP4)
        else:
            per_model, per_attn, per_ff = 1, 1, 1
        sqkv = Scales + at * (qkv_rows * per_model + d_model * per_attn + 2 * d_ff * per_model + d_model * per_ff)
        so = sqkv + qkv_rows * per_model
        sgu = so + d_model * per_attn
        sd = sgu + 2 * d_ff * per_model
        stamps = Times + (layer - layer_lo) * 8 * n_programs + pid
        if STAGE <= 0:
            if ARRIVE_FIRST and STAGE < 0 and layer > layer_lo:
                barrier_arrive(Sync)
            if GEMV:
                w1, w2, s1, s2 = _qkv_tiles(wqkv, sqkv, pid, n_qkv_items, d_model, n_heads, n_kv_heads, HEAD_DIM,
                                            T_QKV, INTERLEAVED, KP_MODEL, C_MODEL, INT8, GROUP4)
            if STAGE < 0 and layer > layer_lo:
                grid_barrier(Sync, arrivals, ARRIVE_FIRST)
            wait_for_previous(PDL)
            stamp(stamps, TIMELINE)
            if GEMV:
                _qkv_gemv(X, Norm1 + at * d_model, wqkv, sqkv, Q, kc, vc, Cos, Sin, Sync, slot, pos, pid, n_programs,
                          n_qkv_items, eps, sc_b, sc_h, sc_l, d_model, n_heads, n_kv_heads, w1, w2, s1, s2, cos,
                          sin, HEAD_DIM, T_QKV, INTERLEAVED, KP_MODEL, C_MODEL, INT8, GROUP4)
            else:
                _qkv_stage(X, Norm1 + at * d_model, wqkv, sqkv, Q, kc, vc, Cos, Sin, Sync, Slots, Start, rows, row_ok,
                           pid, n_programs, eps, sc_b, sc_h, sc_l, d_model, n_heads, n_kv_heads,
                           BB, HEAD_DIM, T_QKV, INTERLEAVED, BLOCK_K, PREC, INT8)
            stamp(stamps + n_programs, TIMELINE)
        if STAGE <= 1 and 1 <= LAST:
            _attention_stage(Q, kc, vc, PartO, PartL, Attn, Arrived, Sync, Slots, Start, layer, pid, n_programs,
                             batch, n_heads, n_kv_heads, n_split, sc_b, sc_h, sc_l, qk_scale,
                             GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SPLIT, T_QKV, PREC, not SPLIT_O, PDL)
            stamp(stamps + 2 * n_programs, TIMELINE)
        if STAGE <= 2 and 2 <= LAST:
            if EARLY_GU:  # while o_proj's items wait on attention
                gate_w, up_w, gate_s, up_s = _gate_up_tiles(wgu, sgu, pid, d_model, d_ff, T_GU, KP_MODEL, C_MODEL,
                                                            INT8, GROUP4)
            if GU_AHEAD:
                _prefetch_gate_up(wgu, d_ff, d_model // PACK, pid + n_programs, n_programs, T_GU)
            if SPLIT_O:
                _o_proj_gemv(wo, so, PartO, PartL, Arrived, o_acc, layer, pid, n_programs, d_model, n_heads, n_split,
                             GROUP, HEAD_DIM, BLOCK_SPLIT, T_O, Norm1.dtype.element_ty, INT8, PDL)
            else:
                _residual_matmul(X, Out, False, o_acc, wo, so, Attn, Sync, arrivals + n_programs, rows, row_ok, pid,
                                 n_programs, d_model, width, Times, STAGE < 0, GEMV, T_O, KP_ATTN, C_ATTN, BB, BLOCK_K,
                                 PREC, ARRIVE_FIRST, False, False, INT8, GROUP4, PDL)
            stamp(stamps + 3 * n_programs, TIMELINE)
        if STAGE <= 3 and 3 <= LAST:
            if ARRIVE_FIRST and STAGE < 0:
                barrier_arrive(Sync)
            if GEMV:
                if not EARLY_GU:
                    gate_w, up_w, gate_s, up_s = _gate_up_tiles(wgu, sgu, pid, d_model, d_ff, T_GU, KP_MODEL,
                                                                C_MODEL, INT8, GROUP4)
                if PREFETCH and (STAGE < 0 or PDL):
                    if not GU_AHEAD:
                        _prefetch_gate_up(wgu, d_ff, d_model // PACK, pid + n_programs, n_programs, T_GU)
                    if PREFETCH_DOWN_EARLY:
                        prefetch_rows(wd, 0, d_model, d_ff // PACK, pid, n_programs, T_D)
            if STAGE < 0:
                grid_barrier(Sync, arrivals + (BARRIERS - 2) * n_programs, ARRIVE_FIRST)
            wait_for_previous(PDL)
            stamp(stamps + 4 * n_programs, TIMELINE)
            if GEMV:
                _gate_up_gemv(X, o_acc, Norm2 + at * d_model, wgu, sgu, Act, pid, n_programs, eps, d_model, d_ff,
                              gate_w, up_w, gate_s, up_s, T_GU, KP_MODEL, C_MODEL, INT8, GROUP4)
            else:
                _gate_up_stage(X, Norm2 + at * d_model, wgu, sgu, Act, rows, row_ok, pid, n_programs, eps, d_model,
                               d_ff, BB, BLOCK_K, PREC, INT8)
            stamp(stamps + 5 * n_programs, TIMELINE)
        if STAGE <= 4 and 4 <= LAST:
            _residual_matmul(X, Out, layer == layer_hi - 1, o_acc, wd, sd, Act, Sync,
                             arrivals + (BARRIERS - 1) * n_programs, rows, row_ok, pid, n_programs, d_model, d_ff,
                             stamps + 6 * n_programs, STAGE < 0, GEMV, T_D, KP_FF, C_FF, BB, BLOCK_K, PREC,
                             ARRIVE_FIRST, PREFETCH and GEMV and not PREFETCH_DOWN_EARLY, TIMELINE, INT8, GROUP4, PDL)
            stamp(stamps + 7 * n_programs, TIMELINE)
