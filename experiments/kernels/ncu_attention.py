"""One launch of each attention pass, for Nsight Compute's counters: lmlab's Gluon kernels against cuDNN's.

Every pass runs three times first (Triton compiles, cuDNN plans); then each runs once between
cudaProfilerStart and cudaProfilerStop, so `ncu --profile-from-start off` measures those launches alone:

    ncu --clock-control none --profile-from-start off --set full -o attn python experiments/kernels/ncu_attention.py
    ncu -i attn.ncu-rep --page details

Passes per shape (bf16, causal, random inputs): cuDNN's forward and backward (SDPA), the Gluon forward, the Gluon
dQ and dK/dV kernels, and the fused dK/dV/dQ kernel, each at the setting the probes found fastest on an H100
(experiments/kernels/README.md, 2026-12-06; the first ncu run, `h100-2026-12-06b/ncu-*`, had dK/dV (32, 64, 3, 4)
at D64, then the fastest).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmlab.kernels import flash_gluon
from lmlab.timing import under_profiler

# (batch, heads, seq, head_dim): forward setting, dQ setting, dK/dV setting, fused setting
SHAPES = {(1, 16, 16384, 64): ((64, 64, 2, 4, True), (64, 64, 3, 4), (64, 64, 4, 4, True), (64, 128, 2, 8)),
          (4, 16, 4096, 128): ((64, 64, 3, 4, True), (64, 64, 2, 4), (64, 64, 2, 4, False), (64, 128, 2, 8))}


def passes(b: int, h: int, s: int, d: int, fwd, dq, dkdv, fused) -> dict:
    """name -> a callable running that pass once on fresh random inputs of this shape."""
    q, k, v, d_out = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    out, lse = flash_gluon.forward(q, k, v, scale, fwd)
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn_out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)

    def cudnn_forward() -> None:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {"cudnn forward": cudnn_forward,
            "cudnn backward": lambda: torch.autograd.grad(cudnn_out, (qc, kc, vc), d_out, retain_graph=True),
            f"gluon forward {fwd}": lambda: flash_gluon.forward(q, k, v, scale, fwd),
            f"gluon dQ {dq} + dK/dV {dkdv}": lambda: flash_gluon.backward(q, k, v, out, lse, d_out, scale,
                                                                         dq_setting=dq, dkdv_setting=dkdv),
            f"gluon fused {fused}": lambda: flash_gluon.backward(q, k, v, out, lse, d_out, scale,
                                                                 fused_setting=fused)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES],
                        help="B,H,S,D of SHAPES")
    args = parser.parse_args()
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        for name, run in passes(*shape, *SHAPES[shape]).items():
            under_profiler(run, warmup=3)
            print(f"B{shape[0]} H{shape[1]} S{shape[2]} D{shape[3]}: {name}", flush=True)


if __name__ == "__main__":
    main()
