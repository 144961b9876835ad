"""Batch-1 megakernel generation in variants, compared in one process, in turns.

    python experiments/inference/ab_megakernel_steps.py [--rounds 9] [--out ab.json]

A machine or a process moves the layer stack's time by 1-2% (experiments/inference/README.md), more than the
changes compared here, so every variant runs in the same process, on its own copy of the same weights, and the
variants take turns. Each variant's engine captures its CUDA graphs with the variant's settings, which then hold
for every replay:
  fill      before each step a fill zeroes the kernel's counters, and the embedding is a kernel of its own (what the
            thirteenth session measured)
  reset     the kernel leaves its counters zeroed for the next step (no fill); the embedding is still a kernel
  gather    as reset, and the kernel reads the token's embedding row itself (the default code)
  +aligned  o_proj's float32 sums 16-byte aligned (decode_layers.O_ACC_ALIGN = 4, against 1)
Per variant: decode tokens/s of a greedy generation (llama400m, random weights, bf16, 128-token prompt, 256 new
tokens, blocks of 64 steps), the median of the rounds, and one middle step's kernels from a profiled generation.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch

from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model
from lmlab.inference.engine import Engine
from lmlab.inference.megakernel import Megakernel
from lmlab.kernels import decode_layers as dl

# name: (the kernel leaves its counters zeroed, the kernel reads the embedding, O_ACC_ALIGN)
VARIANTS = {"fill": (False, False, 1), "reset": (True, False, 1), "gather": (True, True, 1),
            "gather+aligned": (True, True, 4)}


def variant_engine(model, reset: bool, gather: bool) -> Engine:
    engine = Engine(model, True, megakernel=True)
    kernel = engine.megakernel
    if not reset:  # no buffer kept between steps: decode_layers fills a fresh one
        kernel.bind = lambda caches: (Megakernel.bind(kernel, caches), setattr(kernel, "sync", None))
    if not gather:
        kernel.step_tokens = lambda ids, state: kernel.step(model.embed_tokens(ids), state)
    return engine


def generate(engine: Engine, ids: torch.Tensor, new: int) -> float:
    return engine.generate(ids.tolist(), max_new_tokens=new, sync_every=64).stats.decode_tokens_per_s


def one_step(engine: Engine, ids: torch.Tensor, new: int) -> list:
    """A middle step's kernels of a profiled generation: (name, GPU us, us idle since the previous kernel ended)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        generate(engine, ids, new)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    steps = [i for i, e in enumerate(kernels) if "layers_kernel" in e.name]
    middle = min(range(len(steps) // 4, 3 * len(steps) // 4), key=lambda s: steps[s + 1] - steps[s])
    return [[kernels[i].name[:60], kernels[i].device_time, kernels[i].time_range.start - kernels[i - 1].time_range.end]
            for i in range(steps[middle], steps[middle + 1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--out", default="ab-megakernel-steps.json")
    args = parser.parse_args()
    model, _ = build_model(DEFAULT_OVERRIDES, None, torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, model.vocab_size, (1, 128), device="cuda")
    engines = {}
    for name, (reset, gather, align) in VARIANTS.items():
        dl.O_ACC_ALIGN = align  # read as the step's graphs are captured, by the first generation
        engines[name] = variant_engine(copy.deepcopy(model), reset, gather)
        first = generate(engines[name], ids, args.new)
        print(f"{name}: warmed up ({first:,.0f} tokens/s)", flush=True)
    runs = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            runs[name].append(generate(engine, ids, args.new))
    result = {}
    for name, engine in engines.items():
        steps = one_step(engine, ids, args.new)
        result[name] = {"tokens_per_s": statistics.median(runs[name]), "runs": runs[name], "one_step": steps}
        print(f"{name:<16} {result[name]['tokens_per_s']:8,.0f} tokens/s (runs {min(runs[name]):,.0f}-"
              f"{max(runs[name]):,.0f}); one step:", flush=True)
        for kernel, us, idle in steps:
            print(f"  {us:8.1f} {idle:6.1f}  {kernel}")
        print(f"  {sum(r[1] + r[2] for r in steps):8.1f} us from one launch of the layer stack to the next")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
