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
def _decode_kernel(Q, K, V, Slots, Start, Out, PartOut, PartLse,
                   sq_b, sq_h, sq_s, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l,
                   n_kv_heads, n_heads, qk_scale, window, n_split,
                   S: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // n_kv_heads
    kv_head = bh % n_kv_heads
    rows = tl.arange(0, BLOCK_M)  # row r: query head kv_head * GROUP + r // S, new token r % S
    row_ok = rows < GROUP * S
    head = kv_head * GROUP + rows // S
    tok = rows % S
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sq_b + head[:, None] * sq_h + tok[:, None] * sq_s + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    q_slot = tl.load(Slots + tok)
    first = tl.load(Slots)
    start = tl.load(Start + b)
    lo = tl.minimum(start, first)
    if HAS_WINDOW:
        lo = tl.maximum(lo, first - window + 1)
    hi = tl.load(Slots + S - 1) + 1
    k_lo, k_hi = key_split(lo, hi, split, n_split, BLOCK_N)

    m_i, l_i, acc = empty_state(BLOCK_M, HEAD_DIM)
    m_i, l_i, acc = attend_key_range(q, K + b * sk_b + kv_head * sk_h, V + b * sv_b + kv_head * sv_h, sk_l, sv_l,
                                     k_lo, k_hi, q_slot, start, qk_scale, window, m_i, l_i, acc,
                                     BLOCK_N, HEAD_DIM, HAS_WINDOW, PREC)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    row = (b * n_heads + head) * S + tok  # row of the (batch, heads, S) output
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


@functools.cache
def sm_count(device: torch.device) -> int:
    return 4 if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count


def n_splits(programs: int, cache_len: int, device: torch.device) -> int:
    """Key-range splits per (sequence, kv head): enough programs for PROGRAMS_PER_SM per SM, but no
    split shorter than KEYS_PER_SPLIT slots of the cache."""
    wanted = math.ceil(PROGRAMS_PER_SM * sm_count(device) / programs)
    return max(1, min(wanted, cache_len // KEYS_PER_SPLIT))


@torch.library.custom_op("lmlab::decode_attention", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
               start: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """window 0: none. Returns a contiguous (batch, heads, S, head_dim) tensor in q's dtype."""
    batch, n_heads, s, head_dim = q.shape
    n_kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split = n_splits(batch * n_kv_heads, cache_len, q.device)
    part_out = part_lse = out  # unused without a split
    if split > 1:
        part_out = torch.empty((batch, n_heads, s, split, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, n_heads, s, split), dtype=torch.float32, device=q.device)
    _decode_kernel[(batch * n_kv_heads, split)](
        q, k_cache, v_cache, slots, start, out, part_out, part_lse,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        n_kv_heads, n_heads, scale * LOG2E, window, split,
        S=s, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=max(16, triton.next_power_of_2(group * s)),
        BLOCK_N=BLOCK_N, HAS_WINDOW=window > 0, SPLIT=split > 1,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if split > 1:
        combine_splits[(batch * n_heads * s,)](part_out, part_lse, out, split, HEAD_DIM=head_dim,
                                                BLOCK_SPLIT=triton.next_power_of_2(split))
    return out


@_decode_op.register_fake
def _(q, k_cache, v_cache, slots, start, scale, window):
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
                     start: torch.Tensor, scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of q (batch, heads, S, head_dim) at cache slots `slots` over the caches; see the
    module docstring. Returns (batch, heads, S, head_dim) in q's dtype."""
    problem = unsupported(q, k_cache)
    if problem:
        raise ValueError(f"decode_attention: {problem}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention: q and the caches need a contiguous head_dim")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _decode_op(q, k_cache, v_cache, slots, start, scale, window or 0)
