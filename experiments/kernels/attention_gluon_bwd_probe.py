"""The tile settings of lmlab's Gluon backward (`lmlab.kernels.flash_gluon`, the Hopper path) against the
portable Triton backward and cuDNN.

The backward runs a dQ kernel (which also stores delta = rowsum(dO * O)), then a dK/dV kernel. Each
program of the dK/dV kernel holds one block of keys and walks the query blocks below the diagonal:
S^T = K Q^T and dP^T = V dO^T, then P^T = exp(S^T - LSE) and dS^T = P^T (dP^T - delta) on the CUDA
cores, then dV += P^T dO and dK += dS^T Q. The dQ kernel holds a query block and walks the key
blocks: S and dP, then dS, then dQ += dS K. Triton waits for every wgmma group as soon as it is
issued, so the tensor cores idle while the exponentials run; the Gluon kernels issue block i's two
score products, then block i-1's updates, wait for the first two alone, and compute block i's P and
dS while the tensor cores run the updates.

Timed as whole backwards, medians with L2 emptied, at the training steps' and the issue's shapes,
against the portable Triton backward (`flash_triton.GLUON` off) and cuDNN's: the Triton dQ kernel
with the Gluon dK/dV kernel at each setting, then the Gluon dQ kernel at each setting with the
fastest of those, the fused kernel (`flash_gluon_fused`: dQ reduced from the dK/dV pass) at each
setting, then lmlab's backward as it ships (each kernel's setting picked by timing). Every result's
dQ, dK and dV are checked against the Triton kernels' first.

Limits: causal self-attention, sequence a multiple of 128, head_dim 64 or 128, bf16, Hopper. --kv-heads N gives
every shape N K/V heads (GQA).

    python experiments/kernels/attention_gluon_bwd_probe.py [--kv-heads 4] --json OUT.json
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch
import triton

from lmlab.kernels import flash_gluon, flash_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_gluon_probe import measure, parse_args, portable, worst, write_rows  # noqa: E402  (a sibling script)


def _triton_dq(q, k, v, out, lse, d_out, dq, delta) -> None:
    """flash_triton's dQ kernel (autotuned) into dq and delta (rowsum(dO * O), as the dK/dV kernel reads it), for
    contiguous bf16 (batch, heads, seq, head_dim) tensors."""
    b, h, s, d = q.shape
    strides = [t.stride()[:3] for t in (q, k, v, out, d_out, dq)]
    grid = lambda meta: (triton.cdiv(s, meta["BLOCK_M"]) * b * h,)  # noqa: E731
    flash_triton._bwd_dq_kernel[grid](q, k, v, out, d_out, lse, delta, dq, *(x for st in strides for x in st), h,
                                      h // k.shape[1], s, s, math.log2(math.e) / math.sqrt(d), 1 / math.sqrt(d),
                                      torch.cuda.get_device_properties(q.device).multi_processor_count,
                                      HEAD_DIM=d, CAUSAL=True, PREC="tf32")


def gluon_backward(q, k, v, out, lse, d_out, dkdv_setting: tuple | None = None, dq_setting: tuple | str = "triton",
                   fused_setting: tuple | None = None):
    """flash_gluon's backward at these tile settings: (dq, dk, dv); dq_setting "triton" runs the Triton dQ,
    fused_setting the fused kernel instead of the two."""
    scale = 1 / math.sqrt(q.shape[-1])
    triton_dq = functools.partial(_triton_dq, q, k, v, out, lse, d_out)
    if fused_setting is not None:
        return flash_gluon.backward(q, k, v, out, lse, d_out, scale, fused_setting=fused_setting)
    return flash_gluon.backward(q, k, v, out, lse, d_out, scale, triton_dq, dq_setting, dkdv_setting)


def dkdv_settings(head_dim: int) -> list[tuple]:
    """flash_gluon's dK/dV candidates at this head_dim, and two it leaves out."""
    return [*flash_gluon.DKDV_SETTINGS[head_dim], (64, 128, 2, 8, False), (32, 64, 2, 4, False)]


DQ_SETTINGS = [(128, 64, 2, 8), (128, 64, 3, 8), (128, 128, 2, 8), (64, 64, 2, 4), (64, 64, 3, 4)]
# the fused kernel's (at 64 also one that flash_gluon leaves out; at 128 one more that ptxas serializes)
FUSED_SETTINGS = {64: [(64, 64, 2, 4), (64, 64, 3, 4), (64, 128, 2, 8), (64, 128, 3, 8)],
                  128: [(64, 128, 2, 8), (64, 64, 2, 4)]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], kv_heads=True)
    dev = torch.device("cuda")
    rows = []
    for b, h, s, d in args.shapes:
        kv = args.kv_heads or h
        shape = f"B{b} H{h} S{s} D{d}" + (f" KV{kv}" if kv != h else "")
        q = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(b, kv, s, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        d_out = torch.randn_like(q)
        out, lse = portable(flash_triton.flash_attention_triton_forward)(q, k, v, True)
        triton_backward = functools.partial(flash_triton._backward_op, q, k, v, out, lse, d_out, True, 1 / math.sqrt(d))
        expected = portable(triton_backward)()
        flops = 2.5 * 4 * b * h * s * s * d / 2  # the backward's matmuls: 2.5 times the causal forward's
        qc, kc, vc = (t.detach().clone().requires_grad_() for t in (q, k, v))
        cudnn_out = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=kv != h)

        def check(grads: tuple) -> dict:
            errors = {grad: worst(g, e) for grad, g, e in zip(("dq", "dk", "dv"), grads, expected)}
            grad = max(errors, key=lambda g: errors[g][0])
            return {"max_abs_err_vs_triton": errors[grad][0], "worst_at": f"{grad} {errors[grad][1]}"}

        measured = [measure(name, fn, check, shape, flops, args.repeats, dev) for name, fn in (
            ("sdpa backward", lambda: torch.autograd.grad(cudnn_out, (qc, kc, vc), d_out, retain_graph=True)),
            ("triton backward", portable(triton_backward)))]
        dkdv = {}
        for setting in (*dkdv_settings(d), *flash_gluon.DKDV_WS_SETTINGS[d]):
            row = measure(f"triton dQ + gluon dK/dV {setting}", lambda setting=setting: gluon_backward(
                q, k, v, out, lse, d_out, setting), check, shape, flops, args.repeats, dev)
            measured.append(row)
            if row is not None:
                dkdv[setting] = row["ms"]
        if dkdv:  # Gluon's dQ beside the fastest Gluon dK/dV
            best = min(dkdv, key=dkdv.get)
            for setting in (*DQ_SETTINGS, *flash_gluon.DQ_WS_SETTINGS[d]):
                measured.append(measure(f"gluon dQ {setting} + dK/dV {best}", lambda setting=setting: gluon_backward(
                    q, k, v, out, lse, d_out, best, setting), check, shape, flops, args.repeats, dev))
        for setting in (*FUSED_SETTINGS[d], *flash_gluon.FUSED_WS_SETTINGS[d]):
            measured.append(measure(f"gluon fused dK/dV/dQ {setting}", lambda setting=setting: gluon_backward(
                q, k, v, out, lse, d_out, fused_setting=setting), check, shape, flops, args.repeats, dev))
        measured.append(measure("lmlab backward (settings timed)", triton_backward, check, shape, flops, args.repeats,
                                dev))
        picks = [pick for key, pick in flash_gluon._FASTEST.items() if key[0] == "bwd" and key[3] == s]
        print(f"{shape:20} the picker's (dQ, dK/dV): {picks}", flush=True)
        rows += [row for row in measured if row is not None]
    write_rows(args.json, dev, rows)


if __name__ == "__main__":
    main()
