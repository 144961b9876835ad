"""Attention's forward and backward timed apart, at the training steps' shapes as well as the issue's.

The training benches run SDPA (cuDNN on an H200) because lmlab's Triton attention is slower forward and
backward together at the issue's shapes. This asks which pass loses, and where: at the ~400M step's
shape (16 x 2048 tokens, 16 heads of 64) and the ~1.4B step's (16 heads of 128), each implementation's
forward alone and its backward alone (`autograd.grad` of a forward made before timing, so the timed
calls run only the backward's kernels). A backward faster than cuDNN's at a training shape would be
worth pairing with cuDNN's forward.

    python experiments/kernels/attention_passes_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmlab.kernels.bench import median_seconds
from lmlab.kernels.flash_triton import FlashAttentionTriton

SHAPES = [(16, 16, 2048, 64), (16, 16, 2048, 128), (4, 16, 4096, 128), (1, 16, 16384, 64)]


def _sdpa(backend: SDPBackend):
    def attend(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attend


IMPLS = {"sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION),
         "triton": lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True)}


def causal_flops(b: int, h: int, s: int, d: int) -> float:
    return 4 * b * h * s * s * d / 2  # two seq x seq x d products, half of them masked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for b, h, s, d in SHAPES:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        d_out = torch.randn_like(q)
        fwd_flops = causal_flops(b, h, s, d)
        for name, attend in IMPLS.items():
            # with autograd on, as in training: the forward also stores its LSE for the backward
            forward = median_seconds(lambda: attend(q, k, v), args.repeats, 3, device)
            out = attend(q, k, v)
            backward = median_seconds(lambda: torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True),
                                      args.repeats, 3, device)
            row = {"shape": f"B{b} H{h} S{s} D{d}", "impl": name, "forward_ms": forward * 1e3,
                   "backward_ms": backward * 1e3, "forward_tflops": fwd_flops / forward / 1e12,
                   "backward_tflops": 2.5 * fwd_flops / backward / 1e12}
            rows.append(row)
            print(f"{row['shape']:<20} {name:<11} forward {row['forward_ms']:7.3f} ms ({row['forward_tflops']:5.0f} TFLOP/s)"
                  f"  backward {row['backward_ms']:7.3f} ms ({row['backward_tflops']:5.0f} TFLOP/s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
