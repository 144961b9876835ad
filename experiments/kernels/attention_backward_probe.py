"""The attention backward with dQ added by atomics (five block matmuls) against the dQ kernel (seven), and SDPA.

For each shape (causal, bf16): the shipped backward op timed on its own in both modes (`deterministic` false:
atomic dQ; true: the separate dQ kernel), each with its autotuned dK/dV setting, then (`--sweep`) the atomic mode
pinned to every dK/dV tile setting in turn, and forward + backward through autograd against SDPA pinned to cuDNN. Then a
dK/dV kernel that reads q and dO, and adds dQ, through TMA tensor descriptors (no per-thread address tensors:
fewer registers and spills; probe limits: as many K/V heads as query heads, contiguous inputs, sequence a
multiple of the blocks), with atomic dQ and with the shipped dQ kernel. Every variant's gradients are checked
against SDPA's first.

    python experiments/kernels/attention_backward_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmlab.kernels import flash_triton as ft
from lmlab.kernels.bench import median_seconds
from lmlab.kernels.flash_triton import _schedule

@triton.jit
def _tma_inner(dk, dv, k, v, dq_desc, q_desc, do_desc, lse_base, delta_base, b, h, start, end, offs_n, SEQ_Q, qk_scale, scale,
           MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < SEQ_Q
        q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        lse2 = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        do = do_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t), k) * scale
            dq_desc.atomic_add([b, h, start_m, 0], dq.reshape(1, 1, BLOCK_M, HEAD_DIM))
    return dk, dv

@triton.jit
def _tma_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, B, H, SEQ, qk_scale, scale, N_SMS,
         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    pid_n, bh = _schedule(tl.cdiv(SEQ, BLOCK_N), tl.num_programs(0) // tl.cdiv(SEQ, BLOCK_N), N_SMS, True, False)
    b = bh // H; h = bh % H
    q_desc = tl.make_tensor_descriptor(Q, shape=[B, H, SEQ, HEAD_DIM], strides=[H * SEQ * HEAD_DIM, SEQ * HEAD_DIM, HEAD_DIM, 1], block_shape=[1, 1, BLOCK_M, HEAD_DIM])
    do_desc = tl.make_tensor_descriptor(DO, shape=[B, H, SEQ, HEAD_DIM], strides=[H * SEQ * HEAD_DIM, SEQ * HEAD_DIM, HEAD_DIM, 1], block_shape=[1, 1, BLOCK_M, HEAD_DIM])
    dq_desc = tl.make_tensor_descriptor(DQ, shape=[B, H, SEQ, HEAD_DIM], strides=[H * SEQ * HEAD_DIM, SEQ * HEAD_DIM, HEAD_DIM, 1], block_shape=[1, 1, BLOCK_M, HEAD_DIM])
    kv_desc = tl.make_tensor_descriptor(K, shape=[B, H, SEQ, HEAD_DIM], strides=[H * SEQ * HEAD_DIM, SEQ * HEAD_DIM, HEAD_DIM, 1], block_shape=[1, 1, BLOCK_N, HEAD_DIM])
    vv_desc = tl.make_tensor_descriptor(V, shape=[B, H, SEQ, HEAD_DIM], strides=[H * SEQ * HEAD_DIM, SEQ * HEAD_DIM, HEAD_DIM, 1], block_shape=[1, 1, BLOCK_N, HEAD_DIM])
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = kv_desc.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = vv_desc.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    row = bh.to(tl.int64) * SEQ
    diag_end = tl.minimum(start_n + BLOCK_N, SEQ)
    dk, dv = _tma_inner(dk, dv, k, v, dq_desc, q_desc, do_desc, LSE + row, DELTA + row, b, h, start_n, diag_end, offs_n, SEQ,
                    qk_scale, scale, True, HEAD_DIM, BLOCK_M, ATOMIC_DQ)
    dk, dv = _tma_inner(dk, dv, k, v, dq_desc, q_desc, do_desc, LSE + row, DELTA + row, b, h, diag_end, SEQ, offs_n, SEQ,
                    qk_scale, scale, False, HEAD_DIM, BLOCK_M, ATOMIC_DQ)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(DK + (row + offs_n[:, None]) * HEAD_DIM + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + (row + offs_n[:, None]) * HEAD_DIM + offs_d[None, :], dv.to(DV.dtype.element_ty))


def tma_backward(q, k, v, out, lse, d_out, scale: float, atomic: bool, block_m: int, block_n: int, warps: int,
                 stages: int):
    """dq, dk, dv through `_tma_dkdv`: delta (and zeroed float32 dQ) from the shipped delta kernel with atomic dQ,
    else delta and dQ from the shipped dQ kernel."""
    b, h, s, d = q.shape
    delta = torch.empty_like(lse)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if atomic:
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        ft._bwd_delta_kernel[(triton.cdiv(s, 64), b * h)](out, d_out, delta, dq, *ft._strides(out), *ft._strides(d_out),
                                                          h, s, HEAD_DIM=d, BLOCK_M=64)
    else:
        dq = torch.empty_like(q)
        ft._bwd_dq_kernel[lambda meta: (triton.cdiv(s, meta["BLOCK_M"]) * b * h,)](
            q, k, v, out, d_out, lse, delta, dq, *ft._strides(q), *ft._strides(k), *ft._strides(v), *ft._strides(out),
            *ft._strides(d_out), *ft._strides(dq), h, 1, s, s, scale * ft._LOG2E, scale, ft._sm_count(q.device),
            HEAD_DIM=d, CAUSAL=True, PREC="tf32")
    _tma_dkdv[(s // block_n * b * h,)](q, k, v, d_out, lse, delta, dk, dv, dq, b, h, s, scale * ft._LOG2E, scale,
                                       ft._sm_count(q.device), HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
                                       ATOMIC_DQ=atomic, num_warps=warps, num_stages=stages)
    return dq.to(q.dtype), dk, dv


SHAPES = ((4, 16, 4096, 128), (1, 16, 16384, 64), (16, 16, 2048, 64))  # the two, the 400M step's
SETTINGS = [  # dK/dV (BLOCK_M, BLOCK_N, warps, stages)
    (64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 4, 3), (32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3),
    (64, 64, 8, 2), (64, 64, 4, 3), (32, 64, 8, 3), (32, 64, 4, 3)]


TMA_SETTINGS = [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 128, 4, 3), (64, 64, 8, 3)]


def flops(b: int, h: int, s: int, d: int) -> float:
    """Forward + backward FLOPs of causal attention: 2 matmuls forward, 5 backward, half the blocks."""
    return 7 * 2 * b * h * s * s * d / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true", help="time the shipped atomic mode at every tile setting")
    args = parser.parse_args()
    dev = torch.device("cuda")
    # in-kernel tensor descriptors need global scratch memory
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    rows = []

    def report(shape: str, name: str, seconds: float, err: float | None = None, **extra) -> None:
        rows.append({"shape": shape, "impl": name, "ms": seconds * 1e3, "max_abs_err": err, **extra})
        tail = "" if err is None else f" err {err:.1e}"
        print(f"{shape:22} {name:44} {seconds * 1e3:8.3f} ms{tail} {extra or ''}", flush=True)

    tuner = ft._bwd_dkdv_kernel
    for b, h, s, d in SHAPES:
        shape = f"B{b} H{h} S{s} D{d}"
        q, k, v, d_out = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
        scale = d ** -0.5
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            expected = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True), leaves, d_out)
        out, lse = ft.flash_attention_triton_forward(q, k, v, True)

        def backward(deterministic: bool):
            return torch.ops.lmlab.flash_attention_triton_bwd(q, k, v, out, lse, d_out, True, scale, deterministic)

        def error(grads) -> float:
            return max((g.float() - e.float()).abs().max().item() for g, e in zip(grads, expected))

        for deterministic in (False, True):
            err = error(backward(deterministic))
            seconds = median_seconds(lambda: backward(deterministic), args.repeats, 3, dev)
            report(shape, f"backward, {'dQ kernel' if deterministic else 'atomic dQ'}, autotuned", seconds, err,
                   dkdv=str(tuner.best_config))

        autotuned = tuner.configs
        for m, n, w, st in SETTINGS if args.sweep else ():
            tuner.configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)]
            try:
                err = error(backward(False))
                seconds = median_seconds(lambda: backward(False), args.repeats, 3, dev)
            except Exception as exc:  # a setting that does not compile or fit: reported, not fatal
                print(f"{shape} atomic {(m, n, w, st)}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                continue
            finally:
                tuner.configs = autotuned
            report(shape, f"backward, atomic dQ, dK/dV {(m, n, w, st)}", seconds, err)

        for atomic in (True, False):
            for setting in TMA_SETTINGS:
                def tma():
                    return tma_backward(q, k, v, out, lse, d_out, scale, atomic, *setting)
                try:
                    err = error(tma())
                    seconds = median_seconds(tma, args.repeats, 3, dev)
                except Exception as exc:
                    print(f"{shape} TMA {setting}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                    continue
                report(shape, f"backward, TMA dK/dV, {'atomic dQ' if atomic else 'dQ kernel'} {setting}", seconds, err)

        def triton_step():
            return torch.autograd.grad(ft.flash_attention_triton(*leaves, causal=True), leaves, d_out)

        def cudnn_step():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True), leaves, d_out)

        for name, step in (("forward+backward, lmlab (atomic dQ)", triton_step), ("forward+backward, cuDNN", cudnn_step)):
            err = error(step())
            seconds = median_seconds(step, args.repeats, 3, dev)
            report(shape, name, seconds, err, tflops=round(flops(b, h, s, d) / seconds / 1e12, 1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
