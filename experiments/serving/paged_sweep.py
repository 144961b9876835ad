"""Sweep the paged decode kernel's launch settings and pool layout against the contiguous kernel.

    python experiments/serving/paged_sweep.py --json OUT.json [--batch 32] [--context 384 2048]

For each setting (keys per step, warps, pipeline stages, the split rule's programs per SM, and the
pool layout: token-major (num_blocks, block_size, kv_heads, head_dim) or head-major (num_blocks,
kv_heads, block_size, head_dim), which the kernel reads through strides), times the paged kernel
and reports its speed as a fraction of the contiguous kernel's (timed once per shape, in the same
run, with its own tuned settings). Medians of cold-L2 CUDA-event times (lmlab.kernels.bench).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

import lmlab.kernels.decode_attention_triton as contiguous
import lmlab.kernels.paged_decode_attention_triton as paged
from lmlab.kernels.bench import median_seconds
from lmlab.serving.attention_bench import decode_inputs


def head_major(pool: torch.Tensor) -> torch.Tensor:
    """The same (num_blocks, block_size, kv_heads, head_dim) view, stored head-major."""
    return pool.transpose(1, 2).contiguous().transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[32])
    parser.add_argument("--context", type=int, nargs="+", default=[384, 2048])
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    shapes = [(b, c) for c in args.context for b in args.batch]
    inputs, base, head_pools = {}, {}, {}
    for batch, context in shapes:
        inputs[batch, context] = x = decode_inputs(batch, context, 16, 16, 64, device)
        slots, start = torch.tensor([context - 1], device=device), torch.zeros(batch, dtype=torch.long, device=device)
        base[batch, context] = median_seconds(lambda: contiguous.decode_attention(x.q[:, :, None], x.k, x.v, slots, start),
                                              args.repeats, 10, device)
        head_pools[batch, context] = head_major(x.k_pool), head_major(x.v_pool)
        print(f"contiguous batch {batch} context {context}: {base[batch, context] * 1e6:.1f} us", flush=True)
    defaults = (paged.BLOCK_N, paged.NUM_WARPS, paged.NUM_STAGES, contiguous.PROGRAMS_PER_SM)
    rows = []
    grid = itertools.product(("token", "head"), args.block_n, args.warps, args.stages, args.programs_per_sm)
    for layout, block_n, warps, stages, per_sm in grid:
        paged.BLOCK_N, paged.NUM_WARPS, paged.NUM_STAGES, contiguous.PROGRAMS_PER_SM = block_n, warps, stages, per_sm
        row = {"layout": layout, "block_n": block_n, "warps": warps, "stages": stages, "programs_per_sm": per_sm}
        for (batch, context), x in inputs.items():
            k_pool, v_pool = (x.k_pool, x.v_pool) if layout == "token" else head_pools[batch, context]
            t = median_seconds(lambda: paged.paged_decode_attention(x.q, k_pool, v_pool, x.tables, x.lens),
                               args.repeats, 10, device)
            row[f"b{batch}_c{context}_us"] = t * 1e6
            row[f"b{batch}_c{context}_of_contiguous"] = base[batch, context] / t
        row["geomean_of_contiguous"] = statistics.geometric_mean(
            row[f"b{b}_c{c}_of_contiguous"] for b, c in shapes)
        rows.append(row)
        print(json.dumps(row), flush=True)
    (paged.BLOCK_N, paged.NUM_WARPS, paged.NUM_STAGES, contiguous.PROGRAMS_PER_SM) = defaults
    rows.sort(key=lambda r: -r["geomean_of_contiguous"])
    print("best settings (speed as a fraction of the contiguous kernel's):")
    for r in rows[:10]:
        print(f"  {r['layout']:>5} block_n={r['block_n']:>3} warps={r['warps']} stages={r['stages']} "
              f"per_sm={r['programs_per_sm']}: " + "  ".join(f"b{b} c{c} {r[f'b{b}_c{c}_of_contiguous']:.0%}"
                                                         for b, c in shapes))
    args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "contiguous_us": {
        f"b{b}_c{c}": t * 1e6 for (b, c), t in base.items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
