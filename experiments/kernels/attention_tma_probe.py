"""Does loading attention tiles through Hopper's TMA (tensor descriptors) speed up lmlab's forward?

A variant of `lmlab.kernels.flash_triton`'s forward kernel: the same online softmax, causal split
(unmasked key blocks, then the diagonal) and heavy-first 1-D schedule, but Q, K, V are read and O is
written through host-made `TensorDescriptor`s (TMA copies into shared memory, no per-thread address
arithmetic), optionally with Triton's automatic warp specialisation of the key loop. Every tile
setting is timed on its own at the issue's two shapes, forward only, beside the shipped kernel
(autotuned) and SDPA; each variant's output is checked against SDPA first.

Probe limits: causal self-attention, as many K/V heads as query heads, sequence a multiple of 128.

    python experiments/kernels/attention_tma_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lmlab.kernels.bench import median_seconds
from lmlab.kernels.flash_triton import _schedule, flash_attention_triton_forward


@triton.jit
def _tma_inner(acc, m_i, l_i, q, desc_k, desc_v, row0, start, end, offs_m, offs_n, qk_scale,
               MASKED: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr):
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([row0 + start_n, 0])
        s = tl.dot(q, k.T)
        if MASKED:
            s = tl.where((start_n + offs_n)[None, :] <= offs_m[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([row0 + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _tma_fwd(desc_q, desc_k, desc_v, desc_o, LSE, SEQ, qk_scale, N_SMS,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr):
    n_blocks = tl.cdiv(SEQ, BLOCK_M)
    pid_m, bh = _schedule(n_blocks, tl.num_programs(0) // n_blocks, N_SMS, True, True)
    start_m = pid_m * BLOCK_M
    row0 = bh * SEQ  # this head's first row in the (batch * heads * seq, head_dim) view; TMA offsets are int32
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([row0 + start_m, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, m_i, l_i = _tma_inner(acc, m_i, l_i, q, desc_k, desc_v, row0, 0, start_m, offs_m, offs_n, qk_scale,
                               False, BLOCK_N, WS)
    acc, m_i, l_i = _tma_inner(acc, m_i, l_i, q, desc_k, desc_v, row0, start_m, start_m + BLOCK_M, offs_m, offs_n,
                               qk_scale, True, BLOCK_N, False)
    desc_o.store([row0 + start_m, 0], (acc / l_i[:, None]).to(desc_o.dtype))
    tl.store(LSE + bh.to(tl.int64) * SEQ + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)


def tma_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int, block_n: int, warps: int,
                stages: int, ws: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of contiguous (batch, heads, seq, head_dim) q, k, v -> (out, lse)."""
    b, h, s, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    flat = [t.view(b * h * s, d) for t in (q, k, v, out)]
    descs = [TensorDescriptor.from_tensor(t, [block, d]) for t, block in zip(flat, (block_m, block_n, block_n, block_m))]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
    _tma_fwd[(s // block_m * b * h,)](*descs, lse, s, math.log2(math.e) / math.sqrt(d), sms, HEAD_DIM=d,
                                      BLOCK_M=block_m, BLOCK_N=block_n, WS=ws, num_warps=warps, num_stages=stages)
    return out, lse


SETTINGS = [  # (BLOCK_M, BLOCK_N, warps, stages, warp specialisation)
    (128, 64, 8, 3, False), (128, 64, 8, 4, False), (128, 128, 8, 2, False), (128, 128, 8, 3, False),
    (128, 64, 4, 3, False), (64, 64, 4, 4, False), (128, 64, 8, 3, True), (128, 128, 8, 2, True),
    (128, 128, 8, 3, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = []
    for b, h, s, d in ((4, 16, 4096, 128), (1, 16, 16384, 64)):
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d / 2
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        candidates = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      "shipped": lambda: flash_attention_triton_forward(q, k, v, True)}
        for setting in SETTINGS:
            candidates[f"tma {setting}"] = lambda setting=setting: tma_forward(q, k, v, *setting)
        for name, fn in candidates.items():
            try:
                got = fn()
                got = got[0] if isinstance(got, tuple) else got
                err = (got.float() - expected.float()).abs().max().item()
                seconds = median_seconds(fn, args.repeats, 3, dev)
            except Exception as exc:  # a setting that does not compile or fit: reported, not fatal
                print(f"B{b} H{h} S{s} D{d} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
                      flush=True)
                continue
            row = {"shape": f"B{b} H{h} S{s} D{d}", "impl": name, "ms": seconds * 1e3,
                   "tflops": flops / seconds / 1e12, "max_abs_err": err}
            rows.append(row)
            print(f"{row['shape']:20} {name:34} {row['ms']:7.3f} ms {row['tflops']:6.1f} TFLOP/s err {err:.1e}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
