"""Time the decode megakernel's layer stack alone over its launch settings, then generation with the best.

    python experiments/inference/sweep_megakernel.py --batch 1 32 --out sweep-megakernel.json [--only [SETTING ...]]
        [--single-steps]

llama400m (vocab 50304, random weights, bf16), one token per sequence at slot 255 of a 384-slot cache (`--slots`:
others, the mean of their times ranking the settings): the layer stack (`decode_layers`) replayed from a CUDA graph,
medians of the last 40 of 50 replays, launched stage by stage and persistent for each setting of programs per SM, tile
size (GEMV_TILE_ELEMS and GEMV_GATE_UP_TILE_ELEMS at batch 1, BLOCK_K above), warps and, at batch 1, how o_proj waits
(GEMV_O_PROJ_ON_COUNTERS), when programs arrive at a barrier and issue gate/up's first loads, whether they prefetch
their later items to L2 and which tiles are cut into chunks; with it, each stage's GPU time from the stage-by-stage
launches (torch.profiler). Then `lmlab bench generate`'s rows (128-token prompts, 256 new tokens) for the megakernel,
each batch with its fastest setting, and for the compiled engine, in the same process, and the GPU time per generated
token of each engine's kernels (torch.profiler over one more generation): what the layer stack leaves to the head,
sampling and the generation loop. `--only SETTING...` sweeps those settings alone (the others at the module's values); a
bare `--only` times the module's settings. `--single-steps` adds the rows of generation with each greedy decode step
launched from the host instead of in blocks replayed as one graph (lmlab.inference.greedy_steps).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import unittest.mock

import torch

from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model, contender, run_benchmark
from lmlab.inference.greedy_steps import GreedySteps
from lmlab.inference.megakernel import Megakernel
from lmlab.kernels import decode_layers as dl
from lmlab.timing import graph_replay_us

# Batch 1 takes the matrix-vector path, larger batches the tensor-core tiles: each has its own settings.
# (2026-12-03, experiments/inference/h200-2026-12-03/: 16384-weight tiles spill registers with 4 warps.)
SETTINGS = {True: {"GEMV_O_PROJ_ON_COUNTERS": (False, True), "GEMV_PROGRAMS_PER_SM": (1, 2),
                   "GEMV_TILE_ELEMS": (4096, 8192), "GEMV_GATE_UP_TILE_ELEMS": (4096, 8192),
                   "GEMV_GATE_UP_EARLY": (False, True), "GEMV_NUM_WARPS": (4, 8),
                   "GEMV_ARRIVE_BEFORE_LOADS": (False, True), "GEMV_PREFETCH_LATER": (False, True),
                   "GEMV_CHUNK_MIN_ROWS": (1, 4), "GEMV_PREFETCH_GATE_UP_EARLY": (False, True),
                   "GEMV_PREFETCH_DOWN_EARLY": (False, True)},
            False: {"PROGRAMS_PER_SM": (2, 3), "BLOCK_K": (256, 512), "NUM_WARPS": (4, 8)}}
STAGES = ("qkv", "attention", "o_proj", "gate_up", "down")


def stack_inputs(kernel: Megakernel, batch: int, slot: int = 255) -> tuple:
    """`decode_layers`' arguments for one decode step through the layer stack at `slot` of a 384-slot cache:
    (x, weights, k_cache, v_cache, slots, start, cos, sin, eps), random rows and caches."""
    model, w = kernel.model, kernel.weights
    shape = (len(model.layers), batch, w.n_kv_heads, 384, w.head_dim)
    k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(batch, w.o.shape[1], device="cuda")  # the float32 residual stream, updated in place
    slots, start = torch.tensor([slot], device="cuda"), torch.zeros(batch, dtype=torch.long, device="cuda")
    rope = model.position
    return x, w, k, v, slots, start, rope.cos, rope.sin, model.layers[0].input_layernorm.eps


def stack_step(kernel: Megakernel, batch: int, persistent: bool, slot: int = 255):
    """One decode step through the layer stack (`stack_inputs`), as a function of nothing."""
    inputs = stack_inputs(kernel, batch, slot)
    return lambda: dl.decode_layers(*inputs, persistent=persistent)


def time_stack(kernel: Megakernel, batch: int, persistent: bool, slot: int = 255) -> float:
    """Microseconds per replay of one decode step through the layer stack."""
    return graph_replay_us(stack_step(kernel, batch, persistent, slot), replays=50, skip=10)


def stage_profile(kernel: Megakernel, batch: int) -> dict[str, float]:
    """GPU microseconds per step that each stage takes, summed over the layers, from the stage-by-stage launches
    (torch.profiler; the launches come in (layer, stage) order, so the stage is the launch's index mod 5)."""
    step = stack_step(kernel, batch, persistent=False)
    step()
    steps = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    launches = sorted((e for e in prof.events()
                       if "layers_kernel" in e.name and e.device_type == torch.autograd.DeviceType.CUDA),
                      key=lambda e: e.time_range.start)
    totals = dict.fromkeys(STAGES, 0.0)
    for i, event in enumerate(launches):
        totals[STAGES[i % len(STAGES)]] += event.device_time / steps
    return totals


def generation_profile(model, engine: str, batch: int, prompt: int = 128, new: int = 256,
                       top: int = 12) -> tuple[list, list]:
    """(kernel, launches per token, GPU microseconds per token) of one greedy generation by `engine` (after an
    unprofiled one at this batch), the `top` kernels by time, then every kernel's total; and, where a step has one
    megakernel launch, one middle step's kernels in launch order: (name, GPU us, us idle since the previous kernel
    ended)."""
    ids = torch.randint(0, model.vocab_size, (batch, prompt), device="cuda")
    run = contender(engine, model)
    run(ids, new)  # a warm-up at this batch: the engine's graphs for it captured before the profiled run
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(ids, new)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    for e in kernels:
        entry = totals.setdefault(e.name[:60], [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time
    rows = sorted(([name, n / new, us / new] for name, (n, us) in totals.items()), key=lambda r: -r[2])
    return rows[:top] + [["all kernels", sum(r[1] for r in rows), sum(r[2] for r in rows)]], middle_step(kernels)


def middle_step(kernels: list) -> list:
    """Of a generation's GPU kernels in launch order, one step's (from a megakernel launch to the next) as (name, GPU
    us, us idle since the previous kernel ended): of the middle half, the step with the fewest kernels, not one with
    the host's look. Empty without several megakernel launches."""
    steps = [i for i, e in enumerate(kernels) if "layers_kernel" in e.name]
    if len(steps) <= 2:
        return []
    middle = min(range(len(steps) // 4, 3 * len(steps) // 4), key=lambda s: steps[s + 1] - steps[s])
    return [[kernels[i].name[:90], kernels[i].device_time, kernels[i].time_range.start - kernels[i - 1].time_range.end]
            for i in range(steps[middle], steps[middle + 1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--out", default="sweep-megakernel.json")
    parser.add_argument("--only", nargs="*", default=None, metavar="SETTING",
                        help="sweep these settings only, the others at the module's values (none: no sweep)")
    parser.add_argument("--slots", type=int, nargs="+", default=[255],
                        help="cache slots (of 384) the persistent stack is timed at; a setting's time is their mean "
                             "(generation with 128-token prompts and 256 new tokens runs slots 128-383)")
    parser.add_argument("--single-steps", action="store_true",
                        help="also time generation with each decode step launched from the host, not in blocks "
                             "replayed as one CUDA graph (lmlab.inference.greedy_steps)")
    args = parser.parse_args()
    model, _ = build_model(DEFAULT_OVERRIDES, None, torch.device("cuda"), torch.bfloat16)
    kernel = Megakernel(model)
    rows, best = [], {}
    for batch in args.batch:
        rows.append({"batch": batch, "stages": True, "us": time_stack(kernel, batch, persistent=False),
                     "profile": stage_profile(kernel, batch)})
        print(f"batch {batch:>3} stage by stage: {rows[-1]['us']:8.1f} us; GPU time per stage:",
              ", ".join(f"{k} {v:.1f} us" for k, v in rows[-1]["profile"].items()), flush=True)
        settings = SETTINGS[batch == 1]
        if args.only is not None:
            settings = {name: values if name in args.only else (getattr(dl, name),)
                        for name, values in settings.items()}
        for values in itertools.product(*settings.values()):
            setting = dict(zip(settings, values))
            for name, value in setting.items():
                setattr(dl, name, value)
            at = {slot: time_stack(kernel, batch, persistent=True, slot=slot) for slot in args.slots}
            rows.append({"batch": batch, **setting, "us": statistics.mean(at.values()), "us_at_slot": at})
            print(f"batch {batch:>3} {setting}: {rows[-1]['us']:8.1f} us",
                  "(" + ", ".join(f"slot {k}: {v:.1f}" for k, v in at.items()) + ")", flush=True)
        best[batch] = min((r for r in rows if r["batch"] == batch and "stages" not in r), key=lambda r: r["us"])
        for name in settings:
            setattr(dl, name, best[batch][name])
        print("best at batch", batch, best[batch], flush=True)
    bench = run_benchmark(model, ["megakernel", "compiled"], args.batch, [128], 256, repeats=3)
    if args.single_steps:  # the reference: each decode step and its pick launched from the host
        with unittest.mock.patch.object(GreedySteps, "applies", staticmethod(lambda *_: False)):
            bench["rows"] += run_benchmark(model, ["megakernel", "compiled"], args.batch, [128], 256, repeats=3,
                                           label=" 1by1")["rows"]
    profiles = {}
    for batch, engine in itertools.product(args.batch, ("megakernel", "compiled")):
        rows, sequence = generation_profile(model, engine, batch)
        profiles[f"{engine} batch {batch}"] = {"per_token": rows, "one_step": sequence}
        print(f"{engine}, batch {batch}: GPU time per generated token")
        for name, launches, us in rows:
            print(f"  {us:8.1f} us {launches:6.1f} launches  {name}")
        if sequence:
            print(f"{engine}, batch {batch}: one step's kernels in launch order (GPU us, idle us before)")
            for name, us, idle in sequence:
                print(f"  {us:8.1f} {idle:8.1f}  {name}")
            print(f"  {sum(r[1] + r[2] for r in sequence):8.1f} us from one launch of the layer stack to the next")
    with open(args.out, "w") as f:
        json.dump({"sweep": rows, "best": best, "bench": bench["rows"], "generation_profile": profiles}, f,
                  indent=1, default=str)


if __name__ == "__main__":
    main()
