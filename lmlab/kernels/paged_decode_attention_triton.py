"""Decode attention over a paged KV cache in Triton (PagedAttention read by flash-decoding).

`paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale=None, window=None)` attends
one new query per sequence, q (batch, heads, head_dim), over keys and values kept in pools of blocks,
(num_blocks, block_size, kv_heads, head_dim). Sequence b's token at position p lives in block
block_tables[b, p // block_size] at offset p % block_size; it has context_lens[b] keys, and its query,
at position context_lens[b] - 1, sees every one of them (with a window, only those with
context_lens[b] - 1 - p < window). Block-table entries outside the keys a sequence sees (past its last
block, or wholly before its window) are never read, so they may hold anything.

Like lmlab.kernels.decode_attention_triton: one program per (sequence, kv head, split) loads the group's
query heads (GQA: each key and value is read once per kv head), walks only the keys its sequence sees,
looking each key's block up in the table, and when the batch gives too few programs to fill the GPU,
splits the key range across programs whose partial results (output and log-sum-exp) a second small
kernel combines. Softmax runs in base 2 with log2(e) folded into the scale. The split count comes from
shapes only (the table's capacity), never from context_lens, so a CUDA graph replays with new lengths.

The launch is a torch.library custom op, so torch.compile treats it as one opaque call and a CUDA graph
captures it. With TRITON_INTERPRET=1 it runs on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# the slot-addressed kernel's split rule (n_splits, over the table's capacity), its epilogue and its combine kernel
from lmlab.kernels.decode_attention_triton import (INTERPRET, LOG2E, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS,
                                                   attend_block, combine_splits, empty_state, n_splits,
                                                   store_output)

MAX_GROUP = 64  # query heads per kv head, one tile of rows
# Keys per loop step (whole blocks, or part of one large block), warps and pipeline stages: the fastest of
# 108 settings at batch 32 on an H200 (2026-12-02; bf16, 16 heads of 64, contexts 384 and 2048; 95% of the
# contiguous kernel's speed at both; 32 keys and 2 warps reached 75% and 71%; storing the pool head-major
# instead changed these by <= 2%): experiments/serving/h200-2026-12-02-kernel/.
BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 4, 3
INT32_OFFSETS_BELOW = 2**31  # pools with fewer elements are addressed with 32-bit offsets (cheaper arithmetic)


@triton.jit
def _paged_decode_kernel(Q, K, V, Tables, Lens, Out, PartOut, PartLse,
                         sq_b, sq_h, sk_n, sk_t, sk_h, sv_n, sv_t, sv_h, st_b, st_n,
                         n_kv_heads, n_heads, qk_scale, window, n_split,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         SPLIT: tl.constexpr, PREC: tl.constexpr, WIDE: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // n_kv_heads
    kv_head = bh % n_kv_heads
    rows = tl.arange(0, BLOCK_M)  # row r: query head kv_head * GROUP + r
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sq_b + head[:, None] * sq_h + dims[None, :], mask=row_ok[:, None], other=0.0)

    hi = tl.load(Lens + b)  # keys at positions [lo, hi); the query is at hi - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(hi - window, 0)
    lo_step = lo // BLOCK_N * BLOCK_N  # steps and splits start on block boundaries
    per_split = tl.cdiv(tl.cdiv(hi - lo_step, BLOCK_N), n_split) * BLOCK_N
    k_lo = lo_step + split * per_split
    k_hi = tl.minimum(hi, k_lo + per_split)

    m_i, l_i, acc = empty_state(BLOCK_M, HEAD_DIM)
    q_pos = tl.zeros((BLOCK_M,), tl.int32) + hi - 1
    table = Tables + b * st_b
    for k0 in range(k_lo, k_hi, BLOCK_N):
        keys = k0 + tl.arange(0, BLOCK_N)
        seen = (keys >= lo) & (keys < k_hi)  # also guards the table: entries outside are never read
        block = tl.load(table + (keys // BLOCK_SIZE) * st_n, mask=seen, other=0)
        if WIDE:
            block = block.to(tl.int64)
        offset = keys % BLOCK_SIZE
        k = tl.load(K + block[:, None] * sk_n + offset[:, None] * sk_t + kv_head * sk_h + dims[None, :],
                    mask=seen[:, None], other=0.0)
        v = tl.load(V + block[:, None] * sv_n + offset[:, None] * sv_t + kv_head * sv_h + dims[None, :],
                    mask=seen[:, None], other=0.0)
        # every key in [lo, hi) is at or before the query (hi - 1): `seen` is the whole mask
        m_i, l_i, acc = attend_block(q, k, v, keys, seen, q_pos, lo, qk_scale, 0, m_i, l_i, acc, False, PREC)

    row = b * n_heads + head  # row of the (batch, heads) output
    store_output(m_i, l_i, acc, row, row_ok, dims, split, n_split, Out, PartOut, PartLse, HEAD_DIM, SPLIT)


def _elements(pool: torch.Tensor) -> int:
    """Elements of the pool's storage: a bound on any offset the kernel computes from the pool's start."""
    return pool.untyped_storage().nbytes() // pool.element_size()


@torch.library.custom_op("lmlab::paged_decode_attention", mutates_args=())
def _paged_decode_op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """window 0: none. Returns a contiguous (batch, heads, head_dim) tensor in q's dtype."""
    batch, n_heads, head_dim = q.shape
    block_size, n_kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = n_heads // n_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split = n_splits(batch * n_kv_heads, block_tables.shape[1] * block_size, q.device)
    part_out = part_lse = out  # unused without a split
    if split > 1:
        part_out = torch.empty((batch, n_heads, split, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, n_heads, split), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(batch * n_kv_heads, split)](
        q, k_pool, v_pool, block_tables, context_lens, out, part_out, part_lse,
        q.stride(0), q.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3], *block_tables.stride(),
        n_kv_heads, n_heads, scale * LOG2E, window, split,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=BLOCK_N, HAS_WINDOW=window > 0, SPLIT=split > 1,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", WIDE=max(_elements(k_pool), _elements(v_pool)) >= INT32_OFFSETS_BELOW,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if split > 1:
        combine_splits[(batch * n_heads,)](part_out, part_lse, out, split, HEAD_DIM=head_dim,
                                           BLOCK_SPLIT=triton.next_power_of_2(split))
    return out


@_paged_decode_op.register_fake
def _(q, k_pool, v_pool, block_tables, context_lens, scale, window):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def unsupported(q: torch.Tensor, k_pool: torch.Tensor) -> str | None:
    """Why a query q (batch, heads, head_dim) over a pool (num_blocks, block_size, kv_heads, head_dim)
    cannot run here (None: it can)."""
    if not INTERPRET and not q.is_cuda:
        return "q must be a CUDA tensor"
    if q.dim() != 3 or k_pool.dim() != 4:
        return f"q of shape {tuple(q.shape)} and a pool of shape {tuple(k_pool.shape)} (want (batch, heads, " \
               "head_dim) and (num_blocks, block_size, kv_heads, head_dim))"
    if q.dtype not in SUPPORTED_DTYPES or k_pool.dtype != q.dtype:
        return f"dtype {q.dtype} with a {k_pool.dtype} pool (supported: float16, bfloat16, float32 pools of q's dtype)"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS or k_pool.shape[-1] != q.shape[-1]:
        return f"head_dim={q.shape[-1]} with a pool of head_dim {k_pool.shape[-1]} " \
               f"(supported: one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))} for both)"
    block_size = k_pool.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        return f"block_size={block_size} is not a power of two"
    if q.shape[1] % k_pool.shape[2]:
        return f"{q.shape[1]} query heads are not divisible by {k_pool.shape[2]} kv heads"
    if q.shape[1] // k_pool.shape[2] > MAX_GROUP:
        return f"{q.shape[1] // k_pool.shape[2]} query heads per kv head > {MAX_GROUP}"
    return None


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float | None = None,
                           window: int | None = None) -> torch.Tensor:
    """Attention of q (batch, heads, head_dim), one query per sequence at position context_lens - 1, over
    the keys and values its block table points to; see the module docstring. Returns (batch, heads,
    head_dim) in q's dtype."""
    problem = unsupported(q, k_pool)
    if problem:
        raise ValueError(f"paged_decode_attention: {problem}")
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"paged_decode_attention: v_pool {tuple(v_pool.shape)} {v_pool.dtype} differs from "
                         f"k_pool {tuple(k_pool.shape)} {k_pool.dtype}")
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"paged_decode_attention: block_tables {tuple(block_tables.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} should be ({batch}, max_blocks) and ({batch},)")
    if block_tables.dtype not in (torch.int32, torch.int64) or context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"paged_decode_attention: block_tables ({block_tables.dtype}) and context_lens "
                         f"({context_lens.dtype}) must be int32 (or int64)")
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("paged_decode_attention: q and the pools need a contiguous head_dim")
    if window is not None and window < 1:
        raise ValueError(f"paged_decode_attention: window={window}; it must be >= 1 (None: no window)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _paged_decode_op(q, k_pool, v_pool, block_tables, context_lens, scale, window or 0)
