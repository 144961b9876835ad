"""Does the overlap of FlashAttention-3 speed up lmlab's attention backward? A Gluon probe of both kernels.

lmlab's backward runs a dQ kernel (which also stores delta = rowsum(dO * O)), then a dK/dV kernel.
Each program of the dK/dV kernel holds one block of keys and walks the query blocks below the
diagonal: S^T = K Q^T and dP^T = V dO^T, then P^T = exp(S^T - LSE) and dS^T = P^T (dP^T - delta) on
the CUDA cores, then dV += P^T dO and dK += dS^T Q. The dQ kernel holds a query block and walks the
key blocks: S and dP, then dS, then dQ += dS K. Triton waits for every wgmma group as soon as it is
issued (the sm_90 PTX: `wgmma.wait_group 0` after each; `attention_sass.py`), so the tensor cores
idle while the exponentials run. These Gluon kernels (causal, bf16, sm_90) issue block i's two
score products, then block i-1's updates (dV and dK, or dQ), wait for the first two alone (wgmma
groups complete in order), and compute block i's P and dS while the tensor cores run the updates.
The streamed tiles (Q and dO, or K and V) arrive by TMA in a ring of NUM_BUF slots; block
i-1+NUM_BUF loads into the slot that block i-1 frees. Programs follow `flash_triton`'s schedule.

Timed as whole backwards, medians with L2 emptied, at the training steps' and the issue's shapes,
against the shipped backward and cuDNN's: the shipped dQ kernel with the Gluon dK/dV kernel at each
setting, then the Gluon dQ kernel at each setting with the fastest of those. Every result's dQ, dK
and dV are checked against the shipped kernels' first.

Probe limits: causal self-attention, as many K/V heads as query heads, sequence a multiple of 128,
head_dim 64 or 128, bf16, Hopper.

    python experiments/kernels/attention_gluon_bwd_probe.py --json OUT.json
"""

from __future__ import annotations

import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from lmlab.kernels import flash_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_gluon_probe import (_schedule, descriptors, load_block, load_pair, measure,  # noqa: E402
                                   parse_args, release, resident_pair, ring, wgmma_layout, worst,
                                   write_rows)  # (a sibling script, not a package)


@gluon.jit
def _products(x_smem, y_smem, a_smem, b_smem, a_bars, b_bars, i, first, layout: gl.constexpr, NUM_BUF: gl.constexpr):
    """Issue X A_i^T and Y B_i^T for ring block i (A_i, B_i; `first` the ring's first block) once each has landed: two
    wgmma groups. dK/dV: S^T = K Q^T and dP^T = V dO^T; dQ: S = Q K^T and dP = dO V^T."""
    slot = i % NUM_BUF
    phase = ((i - first) // NUM_BUF) & 1
    ROWS: gl.constexpr = x_smem.shape[0]
    COLS: gl.constexpr = a_smem.shape[1]
    zero = gl.zeros([ROWS, COLS], gl.float32, layout)
    mbarrier.wait(a_bars.index(slot), phase)
    xa = warpgroup_mma(x_smem, a_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
    mbarrier.wait(b_bars.index(slot), phase)
    yb = warpgroup_mma(y_smem, b_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
    return xa, yb


@gluon.jit
def _query_stats(LSE, DELTA, stat0, i, st_layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """Query block i's positions, base-2 LSE and delta, along the columns of S^T (loaded while wgmmas run)."""
    cols = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    return cols, gl.load(LSE + stat0 + cols) * 1.4426950408889634, gl.load(DELTA + stat0 + cols)


@gluon.jit
def _softmax_grad(st, dpt, cols, lse2, delta, i, start_n, qk_scale, st_layout: gl.constexpr,
                  kv_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Query block i's P^T and dS^T (the causal mask where the block reaches the diagonal) as the next
    wgmmas' register operands."""
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    if i * BLOCK_M < start_n + BLOCK_N:
        rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))  # key positions
        pt = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(rows, 1), pt, 0.0)
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    return gl.convert_layout(pt.to(gl.bfloat16), operand), gl.convert_layout(dst.to(gl.bfloat16), operand)


@gluon.jit
def _updates(pt, dst, dv, dk, q_smem, do_smem, i, NUM_BUF: gl.constexpr):
    """Issue dV += P^T dO and dK += dS^T Q for query block i: two wgmma groups."""
    slot = i % NUM_BUF
    dv = warpgroup_mma(pt, do_smem.index(slot), dv, is_async=True)
    dk = warpgroup_mma(dst, q_smem.index(slot), dk, is_async=True)
    return dv, dk


@gluon.jit
def _bwd_dkdv(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, SEQ, qk_scale, scale, N_SMS,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
              NUM_WARPS: gl.constexpr):
    st_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_M)
    kv_layout: gl.constexpr = wgmma_layout(NUM_WARPS, HEAD_DIM)
    n_blocks = SEQ // BLOCK_N
    pid_n, bh = _schedule(n_blocks, gl.num_programs(0) // n_blocks, N_SMS, False)
    start_n = pid_n * BLOCK_N
    row0 = bh * SEQ  # this head's first row in the (batch * heads * seq, head_dim) views
    stat0 = bh.to(gl.int64) * SEQ  # its first LSE and delta
    first = start_n // BLOCK_M  # queries before start_n see none of these keys
    end = SEQ // BLOCK_M

    k_smem, v_smem, kv_bar = resident_pair(k_desc, v_desc)
    q_smem, do_smem, q_bars, do_bars = ring(q_desc, do_desc, NUM_BUF)
    fence_async_shared()

    load_pair(k_desc, v_desc, k_smem, v_smem, kv_bar, row0 + start_n)
    for s in gl.static_range(NUM_BUF):
        load_block(q_desc, do_desc, q_smem, do_smem, q_bars, do_bars, row0, first + s, end, NUM_BUF)
    mbarrier.wait(kv_bar, 0)

    # The first query block on its own: nothing to overlap yet.
    st, dpt = _products(k_smem, v_smem, q_smem, do_smem, q_bars, do_bars, first, first, st_layout, NUM_BUF)
    cols, lse2, delta = _query_stats(LSE, DELTA, stat0, first, st_layout, BLOCK_M)
    st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
    pt, dst = _softmax_grad(st, dpt, cols, lse2, delta, first, start_n, qk_scale, st_layout, kv_layout, BLOCK_M,
                            BLOCK_N)
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    # Then block i's S^T and dP^T, block i-1's updates, a wait for the former alone, block i's P^T and dS^T
    # while the updates run. Each register written while a wgmma is in flight is a new one (the previous
    # P^T and dS^T stay alive until their updates are waited for), so ptxas has no reason to serialize.
    for i in range(first + 1, end):
        st, dpt = _products(k_smem, v_smem, q_smem, do_smem, q_bars, do_bars, i, first, st_layout, NUM_BUF)
        dv, dk = _updates(pt, dst, dv, dk, q_smem, do_smem, i - 1, NUM_BUF)
        cols, lse2, delta = _query_stats(LSE, DELTA, stat0, i, st_layout, BLOCK_M)
        st, dpt = warpgroup_mma_wait(2, deps=[st, dpt])
        pt_next, dst_next = _softmax_grad(st, dpt, cols, lse2, delta, i, start_n, qk_scale, st_layout, kv_layout,
                                          BLOCK_M, BLOCK_N)
        dv, dk, pt, dst = warpgroup_mma_wait(0, deps=[dv, dk, pt, dst])
        # query block i-1's Q and dO are no longer read: its slot takes block i - 1 + NUM_BUF
        load_block(q_desc, do_desc, q_smem, do_smem, q_bars, do_bars, row0, i - 1 + NUM_BUF, end, NUM_BUF)
        dv = warpgroup_mma_init(dv)
        dk = warpgroup_mma_init(dk)
        pt = pt_next
        dst = dst_next
    dv, dk = _updates(pt, dst, dv, dk, q_smem, do_smem, end - 1, NUM_BUF)
    dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])

    # K and V are no longer read: their buffers stage dK and dV for the TMA stores.
    k_smem.store((dk * scale).to(dk_desc.dtype))
    v_smem.store(dv.to(dv_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [row0 + start_n, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [row0 + start_n, 0], v_smem)
    tma.store_wait(0)
    release(kv_bar, q_bars, do_bars, NUM_BUF)


@gluon.jit
def _score_grad(s, dp, lse2, delta, j, start_m, qk_scale, s_layout: gl.constexpr, dq_layout: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key block j's dS = P (dP - delta), P = exp(S - LSE) with the causal mask where the block reaches the
    diagonal, as the dQ wgmma's register operand."""
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    if j * BLOCK_N + BLOCK_N > start_m:
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), p, 0.0)
    ds = p * (dp - gl.expand_dims(delta, 1))
    return gl.convert_layout(ds.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2))


@gluon.jit
def _bwd_dq(q_desc, k_desc, v_desc, do_desc, dq_desc, O, LSE, DELTA, SEQ, qk_scale, scale, N_SMS,
            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
            NUM_WARPS: gl.constexpr):
    """dQ for one query block, and delta = rowsum(dO * O) for the dK/dV kernel: S and dP of key block j, then
    block j-1's dQ update, a wait for the first two alone, block j's dS while the update computes."""
    s_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_N)
    dq_layout: gl.constexpr = wgmma_layout(NUM_WARPS, HEAD_DIM)
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    n_blocks = SEQ // BLOCK_M
    pid_m, bh = _schedule(n_blocks, gl.num_programs(0) // n_blocks, N_SMS, True)
    start_m = pid_m * BLOCK_M
    row0 = bh * SEQ
    end = (start_m + BLOCK_M) // BLOCK_N  # key blocks up to the diagonal's end

    q_smem, do_smem, qdo_bar = resident_pair(q_desc, do_desc)
    k_smem, v_smem, k_bars, v_bars = ring(k_desc, v_desc, NUM_BUF)
    fence_async_shared()

    load_pair(q_desc, do_desc, q_smem, do_smem, qdo_bar, row0 + start_m)
    for i in gl.static_range(NUM_BUF):
        load_block(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, row0, i, end, NUM_BUF)

    # delta = rowsum(dO * O) while the tiles load, stored for the dK/dV kernel
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_layout))
    o = gl.load(O + (row0 + gl.expand_dims(rows, 1)).to(gl.int64) * HEAD_DIM + gl.expand_dims(cols, 0))
    stat0 = bh.to(gl.int64) * SEQ
    mbarrier.wait(qdo_bar, 0)
    delta = gl.sum(o.to(gl.float32) * do_smem.load(rows_layout).to(gl.float32), 1)
    gl.store(DELTA + stat0 + rows, delta)
    delta = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))
    lse2 = gl.load(LSE + stat0 + start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)))
    lse2 = lse2 * 1.4426950408889634  # natural log -> base 2

    s, dp = _products(q_smem, do_smem, k_smem, v_smem, k_bars, v_bars, 0, 0, s_layout, NUM_BUF)
    s, dp = warpgroup_mma_wait(0, deps=[s, dp])
    ds = _score_grad(s, dp, lse2, delta, 0, start_m, qk_scale, s_layout, dq_layout, BLOCK_M, BLOCK_N)
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout))
    for j in range(1, end):
        s, dp = _products(q_smem, do_smem, k_smem, v_smem, k_bars, v_bars, j, 0, s_layout, NUM_BUF)
        dq = warpgroup_mma(ds, k_smem.index((j - 1) % NUM_BUF), dq, is_async=True)
        s, dp = warpgroup_mma_wait(1, deps=[s, dp])
        ds_next = _score_grad(s, dp, lse2, delta, j, start_m, qk_scale, s_layout, dq_layout, BLOCK_M, BLOCK_N)
        dq, ds = warpgroup_mma_wait(0, deps=[dq, ds])  # ds: kept alive until its update is done
        # key block j-1's K and V are no longer read: its slot takes block j - 1 + NUM_BUF
        load_block(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, row0, j - 1 + NUM_BUF, end, NUM_BUF)
        dq = warpgroup_mma_init(dq)
        ds = ds_next
    dq = warpgroup_mma_wait(0, deps=[warpgroup_mma(ds, k_smem.index((end - 1) % NUM_BUF), dq, is_async=True)])

    q_smem.store((dq * scale).to(dq_desc.dtype))  # Q is no longer read: its buffer stages dQ for the TMA store
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [row0 + start_m, 0], q_smem)
    tma.store_wait(0)
    release(qdo_bar, k_bars, v_bars, NUM_BUF)


def _shipped_dq(q, k, v, out, lse, d_out):
    """The shipped dQ kernel (autotuned): (dq, delta), delta = rowsum(dO * O) as the dK/dV kernel reads it."""
    b, h, s, d = q.shape
    dq = torch.empty_like(q)
    delta = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    strides = [t.stride()[:3] for t in (q, k, v, out, d_out, dq)]
    grid = lambda meta: (triton.cdiv(s, meta["BLOCK_M"]) * b * h,)  # noqa: E731
    flash_triton._bwd_dq_kernel[grid](q, k, v, out, d_out, lse, delta, dq, *(x for st in strides for x in st), h, 1,
                                      s, s, math.log2(math.e) / math.sqrt(d), 1 / math.sqrt(d),
                                      torch.cuda.get_device_properties(q.device).multi_processor_count,
                                      HEAD_DIM=d, CAUSAL=True, PREC="tf32")
    return dq, delta


def gluon_dq(q, k, v, out, lse, d_out, block_m: int, block_n: int, num_buf: int, warps: int):
    """The Gluon dQ kernel: (dq, delta)."""
    b, h, s, d = q.shape
    dq = torch.empty_like(q)
    delta = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    descs = descriptors(((q, block_m), (k, block_n), (v, block_n), (d_out, block_m), (dq, block_m)), d)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    _bwd_dq[(s // block_m * b * h,)](*descs, out, lse, delta, s, math.log2(math.e) / math.sqrt(d), 1 / math.sqrt(d),
                                     sms, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=num_buf,
                                     NUM_WARPS=warps, num_warps=warps)
    return dq, delta


def gluon_backward(q, k, v, out, lse, d_out, dkdv_setting: tuple, dq_setting: tuple | None = None):
    """Causal attention's (dq, dk, dv) for contiguous bf16 (batch, heads, seq, head_dim) tensors: a dQ kernel (the
    shipped one, or Gluon's at dq_setting), then the Gluon dK/dV kernel at dkdv_setting."""
    b, h, s, d = q.shape
    dq, delta = (_shipped_dq(q, k, v, out, lse, d_out) if dq_setting is None
                 else gluon_dq(q, k, v, out, lse, d_out, *dq_setting))
    block_m, block_n, num_buf, warps = dkdv_setting
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    descs = descriptors(((q, block_m), (k, block_n), (v, block_n), (d_out, block_m), (dk, block_n), (dv, block_n)), d)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    _bwd_dkdv[(s // block_n * b * h,)](*descs, lse, delta, s, math.log2(math.e) / math.sqrt(d), 1 / math.sqrt(d),
                                       sms, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=num_buf,
                                       NUM_WARPS=warps, num_warps=warps)
    return dq, dk, dv


SETTINGS = [(64, 128, 2, 8), (64, 128, 3, 8), (64, 64, 2, 4), (64, 64, 3, 4), (32, 64, 3, 4)]  # dK/dV
DQ_SETTINGS = [(128, 64, 2, 8), (128, 64, 3, 8), (128, 128, 2, 8), (64, 64, 2, 4), (64, 64, 3, 4)]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    dev = torch.device("cuda")
    rows = []
    for b, h, s, d in args.shapes:
        shape = f"B{b} H{h} S{s} D{d}"
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        d_out = torch.randn_like(q)
        out, lse = flash_triton.flash_attention_triton_forward(q, k, v, True)
        expected = flash_triton._backward_op(q, k, v, out, lse, d_out, True, 1 / math.sqrt(d))
        flops = 2.5 * 4 * b * h * s * s * d / 2  # the backward's matmuls: 2.5 times the causal forward's
        qc, kc, vc = (t.detach().clone().requires_grad_() for t in (q, k, v))
        cudnn_out = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True)

        def check(grads: tuple) -> dict:
            errors = {grad: worst(g, e) for grad, g, e in zip(("dq", "dk", "dv"), grads, expected)}
            grad = max(errors, key=lambda g: errors[g][0])
            return {"max_abs_err_vs_shipped": errors[grad][0], "worst_at": f"{grad} {errors[grad][1]}"}

        measured = [measure(name, fn, check, shape, flops, args.repeats, dev) for name, fn in (
            ("sdpa backward", lambda: torch.autograd.grad(cudnn_out, (qc, kc, vc), d_out, retain_graph=True)),
            ("shipped backward", lambda: flash_triton._backward_op(q, k, v, out, lse, d_out, True, 1 / math.sqrt(d))))]
        dkdv = {}
        for setting in SETTINGS:
            row = measure(f"shipped dQ + gluon dK/dV {setting}", lambda setting=setting: gluon_backward(
                q, k, v, out, lse, d_out, setting), check, shape, flops, args.repeats, dev)
            measured.append(row)
            if row is not None:
                dkdv[setting] = row["ms"]
        if dkdv:  # Gluon's dQ beside the fastest Gluon dK/dV
            best = min(dkdv, key=dkdv.get)
            for setting in DQ_SETTINGS:
                measured.append(measure(f"gluon dQ {setting} + dK/dV {best}", lambda setting=setting: gluon_backward(
                    q, k, v, out, lse, d_out, best, setting), check, shape, flops, args.repeats, dev))
        rows += [row for row in measured if row is not None]
    write_rows(args.json, dev, rows)


if __name__ == "__main__":
    main()
