"""What it costs every program of a persistent grid to add a d_model-wide float32 vector into one shared sum, once
a layer, before a grid barrier: the cost that down inside gate/up's stage pays (each program's share of down's
output added into the layer's sum) in place of down's own stage and its barrier.

    python experiments/inference/probe_sum_atomics.py [--programs 132 264] [--width 1024] [--layers 24]

Per layer every program adds its vector into the layer's sum (or writes it, or does nothing), arrives at a grid
barrier, waits, and reads the sum back (what the next stage does). Modes: `barrier` (no sum), `scalar` (Triton's
`tl.atomic_add`, one float a thread an instruction), `v4` (`red.global.add.v4.f32`, four floats an instruction,
sm_90), `copies C` (scalar atomics into one of C copies of the sum by program, the readers adding the C copies),
`stores` (each program writes its vector to a row of its own, no sum: the bytes without the reduction). Medians of
20 launches after 3, CUDA events; a mode's cost a layer is its time less `barrier`'s over the layers. Each sum is
checked against its exact value (small integers).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from lmlab.kernels.decode_sync_triton import grid_barrier

MODES = {"barrier": 0, "scalar": 1, "v4": 2, "stores": 3}


@triton.jit
def _red_v4(at, a, b, c, d):
    """red.global.add.v4.f32 of (a, b, c, d) at `at` (16-byte aligned)."""
    return tl.inline_asm_elementwise("red.global.add.v4.f32 [$1], {$2, $3, $4, $5}; mov.u32 $0, 0;",
                                     "=r,l,f,f,f,f", [at, a, b, c, d], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def sums_kernel(Acc, Rows, Sync, Check, layers, width, MODE: tl.constexpr, COPIES: tl.constexpr,
                KP: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    offs = tl.arange(0, KP)
    ok = offs < width
    value = (pid % 7 + 1).to(tl.float32)
    vals = tl.zeros([KP], tl.float32) + value
    seen = tl.zeros([KP], tl.float32)
    for layer in range(layers):
        acc = Acc + layer * COPIES * width
        if MODE == 1:
            tl.atomic_add(acc + (pid % COPIES) * width + offs, vals, mask=ok, sem="relaxed", scope="gpu")
        if MODE == 2:
            quads = tl.arange(0, KP // 4) * 4
            even, odd = tl.split(tl.reshape(vals, [KP // 4, 2, 2]))  # (quad, pair): elements 4q + 2i, 4q + 2i + 1
            a0, a2 = tl.split(even)
            a1, a3 = tl.split(odd)
            _red_v4((acc + quads).to(tl.int64), a0, a1, a2, a3)
        if MODE == 3:
            tl.store(Rows + (layer * n + pid) * width + offs, vals, mask=ok)
        grid_barrier(Sync, (layer + 1) * n, False)
        if MODE == 1 or MODE == 2:
            for c in range(COPIES):
                seen += tl.load(acc + c * width + offs, mask=ok, other=0.0, cache_modifier=".cg")
    tl.store(Check + pid * KP + offs, seen)


def run(mode: str, programs: int, width: int, layers: int, copies: int) -> dict:
    dev = "cuda"
    kp = triton.next_power_of_2(width)
    if mode == "v4" and (kp != width or width % 4):
        raise SystemExit("probe_sum_atomics: v4 takes a width that is a power of two")
    acc = torch.zeros(layers, copies, width, device=dev)
    rows = torch.empty(layers, programs, width, device=dev) if mode == "stores" else acc
    sync = torch.zeros(1, dtype=torch.int32, device=dev)
    check = torch.empty(programs, kp, device=dev)
    times = []
    for i in range(23):
        acc.zero_()
        sync.zero_()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        sums_kernel[(programs,)](acc, rows, sync, check, layers, width, MODE=MODES[mode], COPIES=copies, KP=kp,
                                 num_warps=4)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(begin.elapsed_time(end) * 1e3)
    if mode in ("scalar", "v4"):
        expected = float(sum(p % 7 + 1 for p in range(programs)))
        total = acc.sum(1)
        assert torch.equal(total, torch.full_like(total, expected)), f"{mode}: sums wrong"
        assert torch.equal(check[:, :width], torch.full_like(check[:, :width], expected * layers)), f"{mode}: reads"
    return dict(mode=mode if copies == 1 else f"{mode}, {copies} copies", programs=programs, width=width,
                layers=layers, us=statistics.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[132, 264])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--copies", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--out", default="sum-atomics.json")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    results = []
    for programs in args.programs:
        cases = [("barrier", 1), ("scalar", 1), ("v4", 1), ("stores", 1)] + [("scalar", c) for c in args.copies]
        for mode, copies in cases:
            results.append(run(mode, programs, args.width, args.layers, copies))
        base = results[-len(cases)]["us"]
        for r in results[-len(cases):]:
            r["us_a_layer_over_barrier"] = (r["us"] - base) / args.layers
            print(f"{r['programs']:4d} programs  {r['mode']:20s} {r['us']:8.1f} us  "
                  f"{r['us_a_layer_over_barrier']:6.2f} us a layer over the barrier", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
