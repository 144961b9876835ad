"""FlashAttention-2 forward and backward in Triton, tested against `flash_reference`.

`FlashAttentionTriton.apply(q, k, v, causal, scale=None)` (or `flash_attention_triton`) takes CUDA
tensors q (batch, heads, seq_q, head_dim) and k, v (batch, kv_heads, seq_k, head_dim) with heads
divisible by kv_heads (GQA; kv_heads=1 is MQA); 3-D (batch, seq, head_dim) inputs are one head.
The output has q's shape and dtype. `scale` defaults to 1/sqrt(head_dim). Causal attention needs
seq_q == seq_k (query i sees keys j <= i); non-causal attention accepts any seq_k. Any sequence
length works (the ragged last blocks are masked). Inputs may be strided views (e.g. made by
rearranging "b s (h d) -> b h s d") as long as head_dim is contiguous; K and V are never repeated
per query head: kernels read kv head `q_head // group` directly.

Forward: one program per (query block, batch * head) walks the key blocks with an online softmax
in base 2 (log2(e) is folded into the scale so exp2 can be used), and stores the output and the
per-row log-sum-exp (float32, shape q.shape[:-1], natural log like the reference).
Backward recomputes the probabilities P = exp(S - LSE) block by block, so no seq x seq matrix is
ever stored. A dQ kernel runs first, one program per (query block, batch * head) looping over key
blocks; it also stores delta = rowsum(dO * O) for its rows. A dK/dV kernel then runs one program
per (key block, batch * kv head) that keeps its K/V tile resident and loops over the group's
query heads and their query blocks, accumulating dK and dV in registers (no atomics). Letting that kernel also
add dQ with atomics would save the dQ kernel's recomputation of P and dP (five block matmuls instead of seven),
but on an H200 it measured slower, with pointer atomics or TMA reductions (experiments/kernels/h200-2026-12-03c/,
code at commit 0803e9c). Causal attention skips
fully masked blocks and applies the mask only to the blocks on the diagonal. Each grid is 1-D and
`_schedule` orders its programs: heads' blocks together for L2 reuse, and with causal attention the
heavy blocks first so the grid ends without a tail.

Supported: head_dim in SUPPORTED_HEAD_DIMS, dtype in SUPPORTED_DTYPES (float32 uses exact IEEE
dot products so it matches the reference tightly), positive scale. Block sizes are autotuned per
(head_dim, lengths, causal, dtype). The launches live in two torch.library custom ops so
torch.compile treats them as opaque calls and autotuning keeps running eagerly.

On Hopper (sm_90), causal self-attention in 16-bit with head_dim 64 or 128 and a sequence length that is a
multiple of 128 runs `flash_gluon`'s kernels instead: written in Gluon, they overlap the softmax with the
tensor cores as FlashAttention-3 does, which Triton's compiler does not (on an H100 at head_dim 128, the forward
1.08-1.20x and the backward 1.10-1.13x these kernels; experiments/kernels/README.md). `GLUON = False` (or LMLAB_FLASH_GLUON=0) turns that
path off.

With TRITON_INTERPRET=1 the kernels run on CPU tensors through Triton's interpreter (one small
block configuration), which is how they are debugged without a GPU.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import triton
import triton.language as tl

from lmlab.kernels.flash_reference import _check as _check_shapes

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Hopper GPUs take `flash_gluon`'s kernels where they apply; False (or LMLAB_FLASH_GLUON=0) runs these everywhere.
GLUON = os.environ.get("LMLAB_FLASH_GLUON", "1") != "0"
_LOG2E = math.log2(math.e)


def _configs(blocks: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples -> configs."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in blocks]


# Forward and dQ need BLOCK_M % BLOCK_N == 0 (the causal diagonal starts on a key-block boundary),
# dK/dV needs BLOCK_N % BLOCK_M == 0. Each kernel gets a list for 16-bit inputs, one small config
# for float32 (its IEEE dots run on CUDA cores: big tiles only cost registers and compile time),
# and one for the interpreter, small so tiny test shapes still cover several blocks, ragged edges
# and the causal diagonal.
# The 16-bit lists are the fastest few of a sweep of 12 configs per kernel on an H200 (bf16, causal,
# B4 H16 S4096 D128 and B16 H16 S2048 D64).
_FWD_BLOCKS = ([(128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)], (64, 32, 4, 2), (32, 16, 4, 1))
_DKDV_BLOCKS = ([(64, 128, 8, 3), (64, 128, 8, 4), (32, 128, 4, 3), (32, 128, 4, 4), (32, 64, 4, 3)],
                (32, 64, 4, 2), (16, 32, 4, 1))
_DQ_BLOCKS = ([(128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)], (64, 32, 4, 2), (32, 16, 4, 1))


def _autotune(blocks: tuple[list, tuple, tuple], resident: str, n_resident: int, streamed: str):
    """triton.autotune over `blocks`, keyed on head_dim, lengths, causal, group and (implicitly) dtype.

    The pruner picks the float32 config for float32 inputs and drops 16-bit configs whose estimated
    shared memory won't fit: the tiles a program keeps resident (q; or k and v; or q and dO) plus two
    streamed tiles per pipeline stage. The estimate is rough; configs that still fail to compile are
    skipped by the autotuner. Interpreting, only the interpreter's config exists and nothing is tuned.
    """
    wide, fp32, interpreter = blocks
    fp32_configs = _configs([fp32])

    def prune(configs: list[triton.Config], named_args: dict, **kwargs: Any) -> list[triton.Config]:
        args = {**named_args, **kwargs}
        q = args["Q"]
        if q.dtype == torch.float32:
            return fp32_configs
        limit = torch.cuda.get_device_properties(q.device).shared_memory_per_block_optin
        row_bytes = q.element_size() * args["HEAD_DIM"]

        def need(c: triton.Config) -> int:
            return row_bytes * (n_resident * c.kwargs[resident] + 2 * c.num_stages * c.kwargs[streamed])

        return [c for c in configs if need(c) <= limit] or [min(configs, key=need)]

    configs = _configs([interpreter] if _INTERPRET else wide)
    return triton.autotune(configs=configs, key=["HEAD_DIM", "SEQ_Q", "SEQ_K", "CAUSAL", "GROUP"],
                           prune_configs_by={"early_config_prune": prune})


@triton.jit
def _schedule(n_blocks, n_heads, N_SMS, CAUSAL: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """(block, head) of this program in the 1-D grid of n_blocks * n_heads programs.

    Consecutive programs take consecutive blocks of one head, so the programs running at once share
    that head's K/V in L2. Causal blocks differ in work (the heavy end is the last block when
    HEAVY_LAST, else the first): there heads go in groups, and inside a group every head's heaviest
    block launches first, then the next heaviest. A group holds enough heads that its work per SM
    (about group * n_blocks / 2 blocks' worth) is twice its heaviest program, and the last group
    also takes the heads left over, so the last program to launch is a light one and the grid ends
    without a long tail on a few SMs. (Half, once and twice were within 3% of each other on an H200;
    twice was best or close at the three benchmarked shapes, and 1-7% faster forward+backward than
    launching each head's blocks in turn, heaviest first.)
    """
    pid = tl.program_id(0)
    if CAUSAL:
        group = tl.minimum(tl.cdiv(4 * N_SMS, n_blocks + 1), n_heads)
    else:
        group = 1
    last = n_heads // group - 1
    first = tl.minimum(pid // (group * n_blocks), last) * group
    size = tl.where(first == last * group, n_heads - first, group)
    rest = pid - first * n_blocks
    block = rest // size
    if CAUSAL and HEAVY_LAST:
        block = n_blocks - 1 - block
    return block, first + rest % size


@triton.jit
def _query_block(Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, H, GROUP, SEQ_Q, SEQ_K, N_SMS, HEAD_DIM: tl.constexpr,
                 CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The start shared by the forward and dQ kernels: the query block and head this program owns,
    its q tile, pointers to the first K/V tile of its kv head, and the key range split into
    [0, full_end), which needs no mask, and [full_end, masked_end), which does."""
    # Causal query blocks further down see more keys: they are the heavy ones.
    pid_m, bh = _schedule(tl.cdiv(SEQ_Q, BLOCK_M), tl.num_programs(0) // tl.cdiv(SEQ_Q, BLOCK_M), N_SMS,
                          CAUSAL, True)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    kvh = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < SEQ_Q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_ptrs = K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    if CAUSAL:
        # Keys before start_m are visible to every row; the block on the diagonal needs the mask.
        full_end = start_m
        masked_end = tl.minimum(start_m + BLOCK_M, SEQ_K)
    else:
        full_end = SEQ_K - SEQ_K % BLOCK_N
        masked_end = SEQ_K
    return bh, b, h, offs_m, offs_n, offs_d, row_ok, q, k_ptrs, v_ptrs, full_end, masked_end


@triton.jit
def _load_kv(k_ptrs, v_ptrs, stride_kn, stride_vn, start_n, cols, SEQ_K, MASKED: tl.constexpr):
    """The K and V tiles of the key block at start_n; masked, rows past SEQ_K read as zeros."""
    if MASKED:
        k = tl.load(k_ptrs + start_n * stride_kn, mask=cols[:, None] < SEQ_K, other=0.0)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=cols[:, None] < SEQ_K, other=0.0)
    else:
        k = tl.load(k_ptrs + start_n * stride_kn)
        v = tl.load(v_ptrs + start_n * stride_vn)
    return k, v


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, start, end, offs_m, offs_n,
               SEQ_K, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               PREC: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k, v = _load_kv(k_ptrs, v_ptrs, stride_kn, stride_vn, start_n, cols, SEQ_K, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if MASKED:
            # Causal: rows past SEQ_Q are discarded, so cols <= row is enough for the real rows.
            keep = cols[None, :] <= offs_m[:, None] if CAUSAL else cols[None, :] < SEQ_K
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            # qk_scale > 0, so scaling the row max equals the max of the scaled row (saves a multiply).
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, m_i, l_i


@_autotune(_FWD_BLOCKS, "BLOCK_M", 1, "BLOCK_N")
@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                H, GROUP, SEQ_Q, SEQ_K, qk_scale, N_SMS,
                HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh, b, h, offs_m, offs_n, offs_d, row_ok, q, k_ptrs, v_ptrs, full_end, masked_end = _query_block(
        Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        H, GROUP, SEQ_Q, SEQ_K, N_SMS, HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, 0, full_end,
                               offs_m, offs_n, SEQ_K, qk_scale, False, CAUSAL, BLOCK_N, PREC)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, full_end, masked_end,
                               offs_m, offs_n, SEQ_K, qk_scale, True, CAUSAL, BLOCK_N, PREC)

    out = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # log2 -> natural log
    tl.store(LSE + bh.to(tl.int64) * SEQ_Q + offs_m, lse, mask=row_ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom, start, end,
                offs_n, SEQ_Q, qk_scale, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, PREC: tl.constexpr):
    """Accumulates dK (unscaled) and dV of one key block over the query blocks in [start, end).

    Works in the transposed (key, query) orientation so P^T and dS^T feed the dots directly.
    Query rows past SEQ_Q load q = dO = 0 and LSE = +inf, so they contribute exactly nothing.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < SEQ_Q
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse2 = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PREC)
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@_autotune(_DKDV_BLOCKS, "BLOCK_N", 2, "BLOCK_M")
@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                     stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                     H, GROUP, SEQ_Q, SEQ_K, qk_scale, scale, N_SMS,
                     HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Early key blocks see the most (causal) queries: they are the heavy ones.
    pid_n, bkv = _schedule(tl.cdiv(SEQ_K, BLOCK_N), tl.num_programs(0) // tl.cdiv(SEQ_K, BLOCK_N), N_SMS,
                           CAUSAL, False)
    kv_heads = H // GROUP
    b = (bkv // kv_heads).to(tl.int64)
    kvh = (bkv % kv_heads).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < SEQ_K

    k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(GROUP):
        h = kvh * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * H + h) * SEQ_Q
        if CAUSAL:
            # Queries before start_n see none of these keys; those in [start_n, start_n + BLOCK_N)
            # straddle the diagonal and need the mask; later ones see the whole block.
            diag_end = tl.minimum(start_n + BLOCK_N, SEQ_Q)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                                 stride_qm, stride_dom, start_n, diag_end, offs_n, SEQ_Q, qk_scale,
                                 True, HEAD_DIM, BLOCK_M, PREC)
            lo = diag_end
        else:
            lo = 0
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                             stride_qm, stride_dom, lo, SEQ_Q, offs_n, SEQ_Q, qk_scale,
                             False, HEAD_DIM, BLOCK_M, PREC)

    tl.store(DK + b * stride_dkb + kvh * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + b * stride_dvb + kvh * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, start, end, offs_m, offs_n,
              SEQ_K, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
              PREC: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k, v = _load_kv(k_ptrs, v_ptrs, stride_kn, stride_vn, start_n, cols, SEQ_K, MASKED)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse2[:, None])
        if MASKED:
            keep = cols[None, :] <= offs_m[:, None] if CAUSAL else cols[None, :] < SEQ_K
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@_autotune(_DQ_BLOCKS, "BLOCK_M", 2, "BLOCK_N")
@triton.jit
def _bwd_dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                   stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
                   H, GROUP, SEQ_Q, SEQ_K, qk_scale, scale, N_SMS,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh, b, h, offs_m, offs_n, offs_d, row_ok, q, k_ptrs, v_ptrs, full_end, masked_end = _query_block(
        Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        H, GROUP, SEQ_Q, SEQ_K, N_SMS, HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE + bh.to(tl.int64) * SEQ_Q + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    # delta = rowsum(dO * O), the softmax backward's correction; stored for the dK/dV kernel after.
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * SEQ_Q + offs_m, delta, mask=row_ok)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, 0, full_end, offs_m, offs_n,
                   SEQ_K, qk_scale, False, CAUSAL, BLOCK_N, PREC)
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, full_end, masked_end,
                   offs_m, offs_n, SEQ_K, qk_scale, True, CAUSAL, BLOCK_N, PREC)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The SMs the launch schedule balances over. The interpreter's CPU "device" gets 8, so tiny
    test shapes still form groups of several heads."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


@functools.cache
def _gluon() -> Any:
    """`flash_gluon` where this Triton has Gluon's Hopper API (3.5 on), else None."""
    try:
        from lmlab.kernels import flash_gluon
    except ImportError:
        return None
    return flash_gluon


def _hopper_path(q: torch.Tensor, k: torch.Tensor, causal: bool) -> Any:
    """`flash_gluon` when these 4-D inputs take its kernels (sm_90, causal, 16-bit, ...; `flash_gluon.applies`),
    else None."""
    gluon = _gluon() if GLUON and not _INTERPRET else None
    return gluon if gluon is not None and gluon.applies(q, k, causal) else None


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@torch.library.custom_op("lmlab::flash_attention_triton_fwd", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """4-D q, k, v -> (out, lse); out is contiguous, lse is float32 (batch, heads, seq_q)."""
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    hopper = _hopper_path(q, k, causal)
    if hopper is not None:
        return hopper.forward(q, k, v, scale)
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(seq_q, meta["BLOCK_M"]) * batch * heads,)

    _fwd_kernel[grid](q, k, v, out, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
                      heads, heads // k.shape[1], seq_q, seq_k, scale * _LOG2E, _sm_count(q.device),
                      HEAD_DIM=head_dim, CAUSAL=causal, PREC=_precision(q.dtype))
    return out, lse


@_forward_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("lmlab::flash_attention_triton_bwd", mutates_args=())
def _backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 d_out: torch.Tensor, causal: bool, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-D tensors from the forward plus d_out -> contiguous (dq, dk, dv) in the input dtype."""
    q, k, v, out, d_out = (_last_dim_contiguous(x) for x in (q, k, v, out, d_out))
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    prec = _precision(q.dtype)
    n_sms = _sm_count(q.device)

    def dq_grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(seq_q, meta["BLOCK_M"]) * batch * heads,)

    def triton_dq(dq: torch.Tensor, delta: torch.Tensor) -> None:
        """The dQ kernel, which also stores delta = rowsum(dO * O) for the dK/dV kernel."""
        _bwd_dq_kernel[dq_grid](
            q, k, v, out, d_out, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
            *_strides(d_out), *_strides(dq), heads, group, seq_q, seq_k, scale * _LOG2E, scale, n_sms,
            HEAD_DIM=head_dim, CAUSAL=causal, PREC=prec)

    hopper = _hopper_path(q, k, causal)
    if hopper is not None:
        return hopper.backward(q, k, v, out, lse, d_out, scale, triton_dq)
    delta = torch.empty_like(lse)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    triton_dq(dq, delta)

    def dkdv_grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(seq_k, meta["BLOCK_N"]) * batch * kv_heads,)

    _bwd_dkdv_kernel[dkdv_grid](
        q, k, v, d_out, lse, delta, dk, dv, *_strides(q), *_strides(k), *_strides(v), *_strides(d_out),
        *_strides(dk), *_strides(dv), heads, group, seq_q, seq_k, scale * _LOG2E, scale, n_sms,
        HEAD_DIM=head_dim, CAUSAL=causal, PREC=prec)
    return dq, dk, dv


@_backward_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      d_out: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> None:
    _check_shapes(q, k, v, causal)
    if q.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"dtype {q.dtype} is not supported; supported dtypes: {names}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={q.shape[-1]} is not supported; supported head dims: "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    if not scale > 0:
        raise ValueError(f"scale must be positive; got {scale}")
    if not _INTERPRET and not (q.is_cuda and k.is_cuda and v.is_cuda):
        raise ValueError(f"q, k and v must be CUDA tensors; got devices {q.device}, {k.device} and {v.device}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device} and {v.device}")


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Checks the inputs and returns 4-D views (3-D inputs get a head axis) and the resolved scale."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    _check(q, k, v, causal, scale)
    if q.dim() == 3:
        q, k, v = q[:, None], k[:, None], v[:, None]
    return q, k, v, scale


def flash_attention_triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (q's shape and dtype) and per-row LSE (float32, q's shape without head_dim).

    The forward pass only; differentiate through `FlashAttentionTriton.apply` instead.
    """
    q4, k4, v4, scale = _prepare(q, k, v, causal, scale)
    out, lse = _forward_op(q4, k4, v4, causal, scale)
    return out.view(q.shape), lse.view(q.shape[:-1])


class FlashAttentionTriton(torch.autograd.Function):
    """`FlashAttentionTriton.apply(q, k, v, causal[, scale])` -> attention output (q's shape and dtype)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float | None = None) -> torch.Tensor:
        q4, k4, v4, scale = _prepare(q, k, v, causal, scale)
        out, lse = _forward_op(q4, k4, v4, causal, scale)
        out, lse = out.view(q.shape), lse.view(q.shape[:-1])
        # saved in the inputs' shapes, as FlashAttentionReference saves them: the LSE is (batch, seq) for 3-D q
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.one_head = causal, scale, q.dim() == 3
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.one_head:  # the kernels take a head axis
            q, k, v, out, lse, d_out = (t[:, None] for t in (q, k, v, out, lse, d_out))
        dq, dk, dv = _backward_op(q, k, v, out, lse, d_out, ctx.causal, ctx.scale)
        if ctx.one_head:
            dq, dk, dv = dq[:, 0], dk[:, 0], dv[:, 0]
        return dq, dk, dv, None, None


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                           scale: float | None = None) -> torch.Tensor:
    """Functional form of `FlashAttentionTriton.apply`."""
    return FlashAttentionTriton.apply(q, k, v, causal, scale)
