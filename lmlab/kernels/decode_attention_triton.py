"""Decode attention over a slot-addressed KV cache in Triton (flash-decoding).

`decode_attention(q, k_cache, v_cache, slots, start, scale=None, window=None)` attends a few new
queries per sequence, q (batch, heads, S, head_dim) at the ascending cache slots `slots` (S,), over caches
(batch, kv_heads, cache_len, head_dim) whose slot j holds the token written at slot j. Sequence b's
real tokens start at slot start[b] (left padding before it). Query slot q sees key slot k when
start[b] <= k <= q (and q - k < window); a padding query sees itself, so no row is empty. This is
the mask `lmlab.inference.cache.CacheState.allowed` builds for SDPA, computed in the kernel instead.

Why a kernel: one decode step of a small model is latency-bound, and SDPA with a mask both reads
the whole preallocated cache (filled or not) and runs one program per (batch, head), which leaves
most SMs idle at batch 1. Here one program per (sequence, kv head, split) loads the group's query
heads (GQA: keys and values are read once per kv head, never repeated), walks only the filled key
range [first visible slot, last query slot], and, when the batch gives too few programs to fill
the GPU, splits that range across programs whose partial results (output and log-sum-exp) a
second small kernel combines. Softmax runs in base 2 with log2(e) folded into the scale.

`new_keys`/`new_values` (batch, kv_heads, S, head_dim), with `rotary=(cos, sin, interleaved)` (RoPE's
float32 tables, (positions, head_dim/2)): the step's own keys and values come in unrotated and unstored. The
kernel rotates them and the queries (at position slot - start), attends them from registers, and its last
key split writes them to the caches at `slots`. That takes the RoPE and the two cache writes, two launches
a layer at decode, into this one (the key split reads only the slots before `slots`, so it never races the
write). With `norm=(x, eps)` as well, q, k and v came from the rows x before their RMSNorm (whose gain the
projection folded in: lmlab.inference.folded_norms), and the kernel scales them by each token's 1/rms of x.

`split_keys` > 0 makes every query row's result independent of the step's shape (batch-invariant): the
key range splits at fixed multiples of split_keys slots from the sequence's start, blocks align to those, this
step's keys are read in their blocks like cached ones (each split rotates and stores the new keys that fall in
its range), and the splits combine in order, each row over the splits up to its own slot. A token at slot p then
gets the same bits from a one-token step and from a (k+1)-token verification at any batch size, which exact
greedy speculative decoding in bf16 needs (lmlab.inference.batch_invariant).

The launch is a torch.library custom op, so torch.compile treats it as one opaque call and a CUDA
graph captures it. With TRITON_INTERPRET=1 it runs on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_QUERY_ROWS = 64  # query heads per kv head x new tokens: decode and speculative verification, not prefill

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = math.log2(math.e)
# Keys per loop step, the launch's warps and pipeline stages, and the split rule: key ranges are split
# until the grid has PROGRAMS_PER_SM programs per SM, but no split gets fewer than KEYS_PER_SPLIT
# slots. From a sweep of 162 settings on an H200 (2026-12-01; bf16, 16 heads of 64, a 384-slot cache
# with 256 filled; microseconds per call in CUDA-graph replay; experiments/inference/h200-2026-12-01/
# kbench.txt): these were fastest at batch 1 and 128 (4.3-4.5 and 38.9, SDPA 9.1 and 64.0); at
# batches 8 and 32 the top settings were within 3% of each other (6.3 and 10.5; SDPA 10.8 and 23.1).
BLOCK_N, NUM_WARPS, NUM_STAGES = 32, 2, 3
PROGRAMS_PER_SM, KEYS_PER_SPLIT = 2, 32


@triton.jit
def key_split(lo, hi, split, n_split, BLOCK_N: tl.constexpr):
    """Split `split` of n_split of the key slots [lo, hi), in whole blocks of BLOCK_N (late splits may be empty)."""
    per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), n_split) * BLOCK_N
    k_lo = lo + split * per_split
    return k_lo, tl.minimum(hi, k_lo + per_split)


@triton.jit
def empty_state(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The online softmax's state before any key: running max, sum and unnormalised output (base 2)."""
    return (tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
            tl.zeros((BLOCK_M, HEAD_DIM), tl.float32))


@triton.jit
def attend_block(q, k, v, keys, in_range, q_slot, start, qk_scale, window, m_i, l_i, acc,
                 HAS_WINDOW: tl.constexpr, PREC: tl.constexpr):
    """The state (m_i, l_i, acc) of the rows q (BLOCK_M, HEAD_DIM), at cache slots q_slot (BLOCK_M,), after also
    attending keys k and values v (BLOCK_N, HEAD_DIM) at slots `keys` (BLOCK_N,), of which `in_range` count."""
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    ks, qs = keys[None, :], q_slot[:, None]
    seen = (ks <= qs) & (ks >= start)
    if HAS_WINDOW:
        seen = seen & (qs - ks < window)
    seen = (seen | (ks == qs)) & in_range[None, :]
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays empty
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def attend_key_range(q, k_base, v_base, sk_l, sv_l, k_lo, k_hi, q_slot, start, qk_scale, window, m_i, l_i, acc,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr):
    """attend_block over the keys and values at slots [k_lo, k_hi) of one (sequence, kv head), BLOCK_N at a time."""
    dims = tl.arange(0, HEAD_DIM)
    for k0 in range(k_lo, k_hi, BLOCK_N):
        keys = k0 + tl.arange(0, BLOCK_N)
        in_range = keys < k_hi
        k = tl.load(k_base + keys[:, None] * sk_l + dims[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_base + keys[:, None] * sv_l + dims[None, :], mask=in_range[:, None], other=0.0)
        m_i, l_i, acc = attend_block(q, k, v, keys, in_range, q_slot, start, qk_scale, window, m_i, l_i, acc,
                                     HAS_WINDOW, PREC)
    return m_i, l_i, acc


@triton.jit
def attend_fresh_range(q, k_base, v_base, sk_l, sv_l, k_lo, k_hi, first, q_slot, start, qk_scale, window, m_i, l_i,
                       acc, KNew, VNew, skn_s, svn_s, Cos, Sin, X, sx_s, eps, BLOCK_N: tl.constexpr,
                       HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, NEW_KV: tl.constexpr,
                       S: tl.constexpr, ROPE: tl.constexpr, NORM_WIDTH: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """attend_key_range where slots from `first` on are this step's (NEW_KV): in each block they are rotated (and
    scaled) from KNew/VNew in place of the cache's entries, and stored, so every block holds what a later step
    would read from the cache and the blocks are the same whatever the step's shape."""
    dims = tl.arange(0, HEAD_DIM)
    for k0 in range(k_lo, k_hi, BLOCK_N):
        keys = k0 + tl.arange(0, BLOCK_N)
        in_range = keys < k_hi
        if NEW_KV:
            fresh = in_range & (keys >= first)
            cached = in_range & (keys < first)
        else:
            cached = in_range
        k = tl.load(k_base + keys[:, None] * sk_l + dims[None, :], mask=cached[:, None], other=0.0)
        v = tl.load(v_base + keys[:, None] * sv_l + dims[None, :], mask=cached[:, None], other=0.0)
        if NEW_KV:
            if k0 + BLOCK_N > first:
                t = tl.maximum(keys - first, 0)
                k_new = rotated_rows(KNew, t * skn_s, dims, tl.maximum(keys - start, 0), Cos, Sin, fresh, HEAD_DIM,
                                     ROPE)
                v_new = tl.load(VNew + t[:, None] * svn_s + dims[None, :], mask=fresh[:, None], other=0.0).to(tl.float32)
                if NORM_WIDTH > 0:
                    scale = token_scales(X, sx_s, t, eps, S, NORM_WIDTH, NORM_BLOCK)[:, None]
                    k_new, v_new = k_new * scale, v_new * scale
                k_new, v_new = k_new.to(k.dtype), v_new.to(v.dtype)
                k = tl.where(fresh[:, None], k_new, k)
                v = tl.where(fresh[:, None], v_new, v)
                tl.store(k_base + keys[:, None] * sk_l + dims[None, :], k_new, mask=fresh[:, None])
                tl.store(v_base + keys[:, None] * sv_l + dims[None, :], v_new, mask=fresh[:, None])
        m_i, l_i, acc = attend_block(q, k, v, keys, in_range, q_slot, start, qk_scale, window, m_i, l_i, acc,
                                     HAS_WINDOW, PREC)
    return m_i, l_i, acc


ROPE_NONE, ROPE_HALF, ROPE_INTERLEAVED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # the kernel's ROPE


@triton.jit
def rotated_rows(base, row_offset, dims, pos, Cos, Sin, mask, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr):
    """The rows at base + row_offset (BLOCK,) as float32 (BLOCK, HEAD_DIM), rotated by RoPE at positions pos (BLOCK,).
    ROPE_HALF pairs feature i with i + HEAD_DIM/2 (Hugging Face Llama), ROPE_INTERLEAVED 2i with 2i + 1; the
    tables are rounded to the rows' dtype first, as `lmlab.nn.positions.RoPE.rotate` does."""
    x = tl.load(base + row_offset[:, None] + dims[None, :], mask=mask[:, None], other=0.0)
    if ROPE == ROPE_NONE:
        return x.to(tl.float32)
    if ROPE == ROPE_HALF:
        partner, freq, leads = (dims + HEAD_DIM // 2) % HEAD_DIM, dims % (HEAD_DIM // 2), dims < HEAD_DIM // 2
    else:
        partner, freq, leads = dims ^ 1, dims // 2, dims % 2 == 0
    other = tl.load(base + row_offset[:, None] + partner[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    table = pos[:, None] * (HEAD_DIM // 2) + freq[None, :]
    cos = tl.load(Cos + table, mask=mask[:, None], other=1.0).to(x.dtype).to(tl.float32)
    sin = tl.load(Sin + table, mask=mask[:, None], other=0.0).to(x.dtype).to(tl.float32)
    return x.to(tl.float32) * cos + tl.where(leads[None, :], -other, other) * sin


@triton.jit
def token_scales(base, row_stride, tokens, eps, S: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """RMSNorm's scale 1 / sqrt(mean(x^2) + eps) of token tokens[i]'s row x (WIDTH,) at base + token * row_stride,
    float32, for each entry of `tokens` (values below S). Each of the S rows is loaded whole, unrolled, so the loads
    are in flight together: a loop over column chunks would wait for each in turn before the keys' loads start."""
    cols = tl.arange(0, BLOCK_W)  # WIDTH rounded up to a power of two
    scales = tl.zeros(tokens.shape, tl.float32)
    for t in tl.static_range(S):
        x = tl.load(base + t * row_stride + cols, mask=cols < WIDTH, other=0.0).to(tl.float32)
        scales = tl.where(tokens == t, tl.math.rsqrt(tl.sum(x * x, 0) / WIDTH + eps), scales)
    return scales


@triton.jit
def _decode_kernel(Q, K, V, Slots, Start, Out, PartOut, PartLse, KNew, VNew, Cos, Sin, X,
                   sq_b, sq_h, sq_s, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, skn_b, skn_h, skn_s, svn_b, svn_h, svn_s,
                   sx_b, sx_s, n_kv_heads, n_heads, qk_scale, window, n_split, eps,
                   S: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
                   NEW_KV: tl.constexpr, BLOCK_S: tl.constexpr, ROPE: tl.constexpr, NORM_WIDTH: tl.constexpr,
                   NORM_BLOCK: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // n_kv_heads
    kv_head = bh % n_kv_heads
    rows = tl.arange(0, BLOCK_M)  # row r: query head kv_head * GROUP + r // S, new token r % S
    row_ok = rows < GROUP * S
    head = kv_head * GROUP + rows // S
    tok = rows % S
    dims = tl.arange(0, HEAD_DIM)
    q_slot = tl.load(Slots + tok)
    first = tl.load(Slots)
    start = tl.load(Start + b)
    q = rotated_rows(Q + b * sq_b, head * sq_h + tok * sq_s, dims, tl.maximum(q_slot - start, 0), Cos, Sin, row_ok,
                     HEAD_DIM, ROPE)
    if NORM_WIDTH > 0:  # q, k and v were projected from un-normalised rows: apply each token's RMSNorm scale
        q = q * token_scales(X + b * sx_b, sx_s, tok, eps, S, NORM_WIDTH, NORM_BLOCK)[:, None]
    q = q.to(Q.dtype.element_ty)
    lo = tl.minimum(start, first)
    m_i, l_i, acc = empty_state(BLOCK_M, HEAD_DIM)
    k_base, v_base = K + b * sk_b + kv_head * sk_h, V + b * sv_b + kv_head * sv_h
    if SPLIT_KEYS > 0:  # batch-invariant: fixed splits and blocks from lo, this step's keys inside their blocks
        k_lo = lo + split * SPLIT_KEYS
        k_hi = tl.minimum(tl.load(Slots + S - 1) + 1, k_lo + SPLIT_KEYS)
        if HAS_WINDOW:  # skip the whole blocks every query's window leaves out
            k_lo = tl.maximum(k_lo, lo + tl.maximum(first - window + 1 - lo, 0) // BLOCK_N * BLOCK_N)
        m_i, l_i, acc = attend_fresh_range(q, k_base, v_base, sk_l, sv_l, k_lo, k_hi, first, q_slot, start, qk_scale,
                                           window, m_i, l_i, acc, KNew + b * skn_b + kv_head * skn_h,
                                           VNew + b * svn_b + kv_head * svn_h, skn_s, svn_s, Cos, Sin, X + b * sx_b,
                                           sx_s, eps, BLOCK_N, HEAD_DIM, HAS_WINDOW, PREC, NEW_KV, S, ROPE,
                                           NORM_WIDTH, NORM_BLOCK)
    else:
        if HAS_WINDOW:
            lo = tl.maximum(lo, first - window + 1)
        hi = first if NEW_KV else tl.load(Slots + S - 1) + 1  # NEW_KV: this step's slots come from KNew/VNew
        k_lo, k_hi = key_split(lo, hi, split, n_split, BLOCK_N)
        m_i, l_i, acc = attend_key_range(q, k_base, v_base, sk_l, sv_l, k_lo, k_hi, q_slot, start, qk_scale, window,
                                         m_i, l_i, acc, BLOCK_N, HEAD_DIM, HAS_WINDOW, PREC)
    if NEW_KV and SPLIT_KEYS == 0:
        if split == n_split - 1:  # the last split attends this step's keys and stores them
            t = tl.arange(0, BLOCK_S)
            t_ok = t < S
            t_slot = tl.load(Slots + t, mask=t_ok, other=0)
            k = rotated_rows(KNew + b * skn_b + kv_head * skn_h, t * skn_s, dims, tl.maximum(t_slot - start, 0),
                             Cos, Sin, t_ok, HEAD_DIM, ROPE)
            v = tl.load(VNew + b * svn_b + kv_head * svn_h + t[:, None] * svn_s + dims[None, :], mask=t_ok[:, None],
                        other=0.0).to(tl.float32)
            if NORM_WIDTH > 0:
                scale = token_scales(X + b * sx_b, sx_s, t, eps, S, NORM_WIDTH, NORM_BLOCK)[:, None]
                k, v = k * scale, v * scale
            k, v = k.to(K.dtype.element_ty), v.to(V.dtype.element_ty)
            m_i, l_i, acc = attend_block(q, k, v, t_slot, t_ok, q_slot, start, qk_scale, window, m_i, l_i, acc,
                                         HAS_WINDOW, PREC)
            tl.store(k_base + t_slot[:, None] * sk_l + dims[None, :], k, mask=t_ok[:, None])
            tl.store(v_base + t_slot[:, None] * sv_l + dims[None, :], v, mask=t_ok[:, None])
    row = (b * n_heads + head) * S + tok  # row of the (batch, heads, S) output
    store_output(m_i, l_i, acc, row, row_ok, dims, split, n_split, Out, PartOut, PartLse, HEAD_DIM, SPLIT)


@triton.jit
def store_output(m_i, l_i, acc, row, row_ok, dims, split, n_split, Out, PartOut, PartLse, HEAD_DIM: tl.constexpr,
                 SPLIT: tl.constexpr):
    """The online softmax's end for output rows `row`: normalized, to Out in its dtype; or with SPLIT, in float32
    with the rows' log-sum-exp (base 2) as key split `split` of n_split, for `combined_output` to weigh."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        tl.store(PartLse + row * n_split + split, lse, mask=row_ok)
        tl.store(PartOut + (row * n_split + split)[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])
    else:
        tl.store(Out + row[:, None] * HEAD_DIM + dims[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def combined_output(PartOut, PartLse, row, n_split, HEAD_DIM: tl.constexpr, BLOCK_SPLIT: tl.constexpr):
    """Row `row`'s attention output (HEAD_DIM,), float32: its splits' outputs weighted by their share of the softmax
    mass. Read from L2 (.cg), so that a persistent kernel sees what its other programs wrote."""
    splits = tl.arange(0, BLOCK_SPLIT)
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(PartLse + row * n_split + splits, mask=splits < n_split, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 0)
    weight = tl.math.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # a row with no keys: all zero
    weight = weight / tl.maximum(tl.sum(weight, 0), 1e-30)
    part = tl.load(PartOut + (row * n_split + splits)[:, None] * HEAD_DIM + dims[None, :],
                   mask=(splits < n_split)[:, None], other=0.0, cache_modifier=".cg")
    return tl.sum(weight[:, None] * part, 0)


@triton.jit
def combine_splits(PartOut, PartLse, Out, n_split, HEAD_DIM: tl.constexpr, BLOCK_SPLIT: tl.constexpr):
    row = tl.program_id(0)
    out = combined_output(PartOut, PartLse, row, n_split, HEAD_DIM, BLOCK_SPLIT)
    tl.store(Out + row * HEAD_DIM + tl.arange(0, HEAD_DIM), out.to(Out.dtype.element_ty))


@triton.jit
def combine_in_order(PartOut, PartLse, Out, Slots, Start, n_split, n_heads, split_keys, S: tl.constexpr,
                     HEAD_DIM: tl.constexpr):
    """combine_splits for fixed splits (split_keys > 0): one after another, over the splits up to the row's own
    slot, so a row's sum has the same terms in the same order whatever the step's shape."""
    row = tl.program_id(0)
    tok = row % S
    b = row // (n_heads * S)
    first = tl.load(Slots)
    q_slot = tl.load(Slots + tok)
    used = tl.minimum((q_slot - tl.minimum(tl.load(Start + b), first)) // split_keys + 1, n_split)
    top = float("-inf")
    for s in range(used):
        top = tl.maximum(top, tl.load(PartLse + row * n_split + s))
    top = tl.where(top == float("-inf"), 0.0, top)
    dims = tl.arange(0, HEAD_DIM)
    total = 0.0
    out = tl.zeros((HEAD_DIM,), tl.float32)
    for s in range(used):
        weight = tl.math.exp2(tl.load(PartLse + row * n_split + s) - top)
        total += weight
        out += weight * tl.load(PartOut + (row * n_split + s) * HEAD_DIM + dims)
    tl.store(Out + row * HEAD_DIM + dims, (out / tl.maximum(total, 1e-30)).to(Out.dtype.element_ty))


@functools.cache
def sm_count(device: torch.device) -> int:
    return 4 if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count


def n_splits(programs: int, cache_len: int, device: torch.device) -> int:
    """Key-range splits per (sequence, kv head): enough programs for PROGRAMS_PER_SM per SM, but no
    split shorter than KEYS_PER_SPLIT slots of the cache."""
    wanted = math.ceil(PROGRAMS_PER_SM * sm_count(device) / programs)
    return max(1, min(wanted, cache_len // KEYS_PER_SPLIT))


def _launch(q, k_cache, v_cache, slots, start, scale: float, window: int, k_new=None, v_new=None, cos=None, sin=None,
            rope: int = ROPE_NONE.value, norm_x=None, eps: float = 0.0, split_keys: int = 0) -> torch.Tensor:
    """The kernel (and the split combine) for either op below; k_new/v_new None: this step's keys are cached;
    norm_x (batch, S, width): the rows q, k_new and v_new were projected from, before their RMSNorm scale;
    split_keys > 0: fixed splits of that many slots (batch-invariant)."""
    batch, n_heads, s, head_dim = q.shape
    n_kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split = triton.cdiv(cache_len, split_keys) if split_keys else n_splits(batch * n_kv_heads, cache_len, q.device)
    part_out = part_lse = out  # unused without a split
    if split > 1:
        part_out = torch.empty((batch, n_heads, s, split, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, n_heads, s, split), dtype=torch.float32, device=q.device)
    new_kv = k_new is not None
    k_new, v_new = (k_new, v_new) if new_kv else (q, q)  # unused without new keys
    cos, sin = (cos, sin) if rope != ROPE_NONE.value else (out, out)  # unused without RoPE
    x = out if norm_x is None else norm_x  # unused without a norm
    _decode_kernel[(batch * n_kv_heads, split)](
        q, k_cache, v_cache, slots, start, out, part_out, part_lse, k_new, v_new, cos, sin, x,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_new.stride(0), k_new.stride(1), k_new.stride(2),
        v_new.stride(0), v_new.stride(1), v_new.stride(2), x.stride(0), x.stride(1),
        n_kv_heads, n_heads, scale * LOG2E, window, split, eps,
        S=s, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=max(16, triton.next_power_of_2(group * s)),
        BLOCK_N=BLOCK_N, HAS_WINDOW=window > 0, SPLIT=split > 1,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", NEW_KV=new_kv, BLOCK_S=max(16, triton.next_power_of_2(s)),
        ROPE=rope, NORM_WIDTH=0 if norm_x is None else norm_x.shape[-1], NORM_BLOCK=triton.next_power_of_2(x.shape[-1]),
        SPLIT_KEYS=split_keys, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if split > 1 and split_keys:
        combine_in_order[(batch * n_heads * s,)](part_out, part_lse, out, slots, start, split, n_heads, split_keys,
                                                 S=s, HEAD_DIM=head_dim)
    elif split > 1:
        combine_splits[(batch * n_heads * s,)](part_out, part_lse, out, split, HEAD_DIM=head_dim,
                                                BLOCK_SPLIT=triton.next_power_of_2(split))
    return out


@torch.library.custom_op("lmlab::decode_attention", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
               start: torch.Tensor, scale: float, window: int, split_keys: int = 0) -> torch.Tensor:
    """window 0: none. Returns a contiguous (batch, heads, S, head_dim) tensor in q's dtype."""
    return _launch(q, k_cache, v_cache, slots, start, scale, window, split_keys=split_keys)


@_decode_op.register_fake
def _(q, k_cache, v_cache, slots, start, scale, window, split_keys=0):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("lmlab::decode_attention_appending", mutates_args=("k_cache", "v_cache"))
def _appending_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  start: torch.Tensor, scale: float, window: int, k_new: torch.Tensor, v_new: torch.Tensor,
                  cos: torch.Tensor | None, sin: torch.Tensor | None, rope: int, norm_x: torch.Tensor | None = None,
                  eps: float = 0.0, split_keys: int = 0) -> torch.Tensor:
    """_decode_op that also rotates q and k_new (rope), scales q, k_new and v_new by the RMSNorm scale of norm_x's
    rows (when given) and writes k_new and v_new to the caches at `slots`."""
    return _launch(q, k_cache, v_cache, slots, start, scale, window, k_new, v_new, cos, sin, rope, norm_x, eps, split_keys)


@_appending_op.register_fake
def _(q, k_cache, v_cache, slots, start, scale, window, k_new, v_new, cos, sin, rope, norm_x=None, eps=0.0, split_keys=0):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def unsupported(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why these shapes cannot run here (None: they can)."""
    if not INTERPRET and not q.is_cuda:
        return "q must be a CUDA tensor"
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype:
        return f"dtype {q.dtype} with a {k_cache.dtype} cache (supported: float16, bfloat16, float32 caches of q's dtype)"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={q.shape[-1]} (supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    if q.shape[1] % k_cache.shape[1]:
        return f"{q.shape[1]} query heads are not divisible by {k_cache.shape[1]} kv heads"
    if q.shape[1] // k_cache.shape[1] * q.shape[2] > MAX_QUERY_ROWS:
        return f"{q.shape[1] // k_cache.shape[1]} query heads per kv head x {q.shape[2]} tokens > {MAX_QUERY_ROWS} rows"
    return None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     start: torch.Tensor, scale: float | None = None, window: int | None = None,
                     new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None,
                     rotary: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
                     norm: tuple[torch.Tensor, float] | None = None, split_keys: int = 0) -> torch.Tensor:
    """Attention of q (batch, heads, S, head_dim) at cache slots `slots` over the caches; with new_keys and
    new_values (batch, kv_heads, S, head_dim), those are this step's keys and values, stored here, and
    `rotary` (cos, sin, interleaved) rotates them and q. `norm` (x, eps), with new keys: q, k and v were
    projected from the rows x (batch, S, width) before their RMSNorm (whose gain the projection folded in), and
    are scaled here by each token's 1 / sqrt(mean(x^2) + eps). `split_keys` > 0 (a multiple of BLOCK_N): fixed
    splits, so that each row's result is independent of the step's shape. See the module docstring. Returns
    (batch, heads, S, head_dim) in q's dtype."""
    problem = unsupported(q, k_cache)
    if problem:
        raise ValueError(f"decode_attention: {problem}")
    if split_keys < 0 or split_keys % BLOCK_N:
        raise ValueError(f"decode_attention: split_keys={split_keys} must be 0 or a positive multiple of {BLOCK_N}")
    new = [t for t in (new_keys, new_values) if t is not None]
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, *new)):
        raise ValueError("decode_attention: q, the caches and the new keys and values need a contiguous head_dim")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not new:
        if rotary is not None or norm is not None:
            raise ValueError("decode_attention: rotary and norm act on new_keys and q; without new keys, apply them "
                             "before")
        return _decode_op(q, k_cache, v_cache, slots, start, scale, window or 0, split_keys)
    expected = (q.shape[0], k_cache.shape[1], q.shape[2], q.shape[3])
    if len(new) == 1 or any(tuple(t.shape) != expected or t.dtype != k_cache.dtype for t in new):
        raise ValueError(f"decode_attention: new_keys and new_values must both be {expected} tensors of the "
                         f"caches' dtype, got {[None if t is None else tuple(t.shape) for t in (new_keys, new_values)]}")
    cos, sin, rope = None, None, ROPE_NONE.value
    if rotary is not None:
        cos, sin, interleaved = rotary
        if cos.shape != sin.shape or cos.shape[-1] * 2 != q.shape[-1] or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"decode_attention: rotary tables must be contiguous (positions, {q.shape[-1] // 2}), "
                             f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
        rope = (ROPE_INTERLEAVED if interleaved else ROPE_HALF).value
    norm_x, eps = (None, 0.0) if norm is None else norm
    if norm_x is not None and (norm_x.shape[:2] != (q.shape[0], q.shape[2]) or norm_x.stride(-1) != 1):
        raise ValueError(f"decode_attention: norm's rows must be a ({q.shape[0]}, {q.shape[2]}, width) tensor with a "
                         f"contiguous last dimension, got {tuple(norm_x.shape)}")
    return _appending_op(q, k_cache, v_cache, slots, start, scale, window or 0, new_keys, new_values, cos, sin, rope,
                         norm_x, float(eps), split_keys)
