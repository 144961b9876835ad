"""`lmlab bench paged-attention`: decode attention through block tables against a contiguous cache.

    lmlab bench paged-attention [--batch 1 8 32 128] [--context 384 2048] [--heads 16 --kv-heads 16 --head-dim 64]

One decode step's attention of one layer, bf16, at each batch and context length: the Triton paged
kernel (lmlab.kernels.paged_decode_attention_triton) reading 16-token blocks scattered through a
pool, against the inference engine's flash-decoding kernel on a contiguous per-sequence cache
(lmlab.kernels.decode_attention_triton), and the paged cache's portable path (gather the blocks,
then SDPA). Medians of CUDA-event times after warm-up, each call from a cold L2 cache (as
`lmlab bench kernels` times). The serving issue's target: paged >= 80% of the contiguous speed at
batch 32. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lmlab.kernels.bench import median_seconds
from lmlab.kernels.registry import triton_unavailable

BLOCK_SIZE = 16
CACHE_MULTIPLE = 128  # the inference engine rounds its contiguous caches up to this


@dataclass
class DecodeInputs:
    """One decode step's query and the same keys and values in both layouts."""

    q: torch.Tensor  # (batch, heads, head_dim)
    k: torch.Tensor  # (batch, kv_heads, cache_len, head_dim): the contiguous caches
    v: torch.Tensor
    k_pool: torch.Tensor  # (num_blocks, BLOCK_SIZE, kv_heads, head_dim): blocks scattered through a pool
    v_pool: torch.Tensor
    tables: torch.Tensor  # (batch, blocks per sequence) int32
    lens: torch.Tensor  # (batch,) int32


def decode_inputs(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, device,
                  dtype=torch.bfloat16) -> DecodeInputs:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, head_dim, device=device, generator=g).to(dtype)
    length = CACHE_MULTIPLE * math.ceil(context / CACHE_MULTIPLE)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, device=device, generator=g).to(dtype) for _ in range(2))
    per_seq = math.ceil(context / BLOCK_SIZE)
    order = torch.randperm(batch * per_seq, device=device, generator=g)
    tables = order.view(batch, per_seq).to(torch.int32)
    pools = []
    for cache in (k, v):
        pool = torch.empty(batch * per_seq, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype)
        blocks = cache[:, :, :per_seq * BLOCK_SIZE].reshape(batch, kv_heads, per_seq, BLOCK_SIZE, head_dim)
        pool[tables.long().flatten()] = blocks.permute(0, 2, 3, 1, 4).reshape(-1, BLOCK_SIZE, kv_heads, head_dim)
        pools.append(pool)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return DecodeInputs(q, k, v, *pools, tables, lens)


def case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, device) -> dict:
    """The three implementations as calls over the same inputs."""
    from lmlab.kernels.decode_attention_triton import decode_attention
    from lmlab.kernels.paged_decode_attention_triton import paged_decode_attention

    x = decode_inputs(batch, context, heads, kv_heads, head_dim, device)
    slots = torch.tensor([context - 1], device=device)
    start = torch.zeros(batch, dtype=torch.long, device=device)
    key_slots = (x.tables.long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).flatten(1)
    visible = (torch.arange(key_slots.shape[1], device=device) < context)[None, None, None]

    def gathered():
        keys, values = (p.flatten(0, 1)[key_slots].transpose(1, 2) for p in (x.k_pool, x.v_pool))
        return F.scaled_dot_product_attention(x.q[:, :, None], keys, values, attn_mask=visible,
                                              enable_gqa=heads != kv_heads)

    return {"contiguous": lambda: decode_attention(x.q[:, :, None], x.k, x.v, slots, start),
            "paged": lambda: paged_decode_attention(x.q, x.k_pool, x.v_pool, x.tables, x.lens),
            "paged_gather_sdpa": gathered}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmlab bench paged-attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, nargs="+", default=[384, 2048], help="keys per sequence")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    missing = "no CUDA device" if not torch.cuda.is_available() else triton_unavailable()
    if missing:
        print(f"lmlab bench paged-attention: error: it times Triton kernels on a GPU, and there is {missing}",
              file=sys.stderr)
        return 2
    if min(args.batch) < 1 or min(args.context) < 1 or args.heads % args.kv_heads:
        parser.error("batches and contexts must be >= 1, and --heads a multiple of --kv-heads")
    device = torch.device("cuda")
    rows = []
    print(f"{'batch':>5} {'context':>7} {'contiguous us':>13} {'paged us':>9} {'gather+SDPA us':>14} {'paged/contig':>12}")
    for context in args.context:
        for batch in args.batch:
            impls = case(batch, context, args.heads, args.kv_heads, args.head_dim, device)
            times = {name: median_seconds(fn, args.repeats, 10, device) for name, fn in impls.items()}
            row = {"batch": batch, "context": context, **{f"{k}_us": v * 1e6 for k, v in times.items()},
                   "paged_speed_of_contiguous": times["contiguous"] / times["paged"]}
            rows.append(row)
            print(f"{batch:>5} {context:>7} {row['contiguous_us']:>13.1f} {row['paged_us']:>9.1f} "
                  f"{row['paged_gather_sdpa_us']:>14.1f} {row['paged_speed_of_contiguous']:>11.0%}")
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "heads": args.heads,
                                         "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                         "block_size": BLOCK_SIZE, "rows": rows}, indent=1))
    return 0
