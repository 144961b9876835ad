"""Batch-1 megakernel generation under variants of its launch settings, compared in one process, in turns.

    python experiments/inference/ab_megakernel_steps.py [O_ACC_ALIGN=1 O_ACC_ALIGN=4 ...] [--rounds 9] [--out F]
    python experiments/inference/ab_megakernel_steps.py quant=none quant=int8 quant=int4 \
        GEMV_QUANT_GATE_UP_TILE_ELEMS=4096,quant=int8

A variant is `NAME=VALUE[,NAME=VALUE...]` of `lmlab.kernels.decode_layers`' module settings (those that
sweep_megakernel.py sweeps, and O_ACC_ALIGN), and optionally `quant=ENTRY`: its copy of the weights quantized by that
`quant` entry (round to nearest, int4 in the largest group dividing every width, 64 for llama400m; `none` leaves
them), and `persistent=False`: the layer stack launched stage by stage (STAGE_PDL and STAGE_PROGRAMS_PER_SM say
how). A machine or a process moves the layer stack's time by 1-2% (experiments/inference/README.md), as much as the
changes compared, so every variant runs in the
same process, on its own copy of the same weights, and the variants take turns. Each variant's engine captures its
CUDA graphs under the variant's settings (a launch reads them as it is captured), which then hold for every replay.
Per variant: decode tokens/s of a greedy generation (llama400m, random weights, bf16, 128-token prompt, 256 new
tokens, blocks of 64 steps), the median of the rounds, and one middle step's kernels from a profiled generation.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import statistics

import torch
from sweep_megakernel import middle_step  # this folder's: the step its generation profile shows

from lmlab.inference.bench import DEFAULT_OVERRIDES, QUANT_LAYOUT, build_model, quant_config
from lmlab.inference.engine import Engine
from lmlab.inference.quant import QUANTS, quantize
from lmlab.kernels import decode_layers as dl


def parse_variant(text: str) -> tuple[dict, str, bool]:
    """(decode_layers settings, quant entry or "none", persistent)."""
    settings = dict(item.split("=", 1) for item in text.split(","))
    quant = settings.pop("quant", "none")
    persistent = ast.literal_eval(settings.pop("persistent", "True"))
    if quant != "none":
        QUANTS.resolve(quant)  # an unknown entry fails here, before any model is built
    return known_settings(settings), quant, persistent


def known_settings(texts: dict[str, str]) -> dict:
    """NAME: VALUE texts -> decode_layers' module settings with their values; an unknown name fails first."""
    unknown = [name for name in texts if not hasattr(dl, name)]
    if unknown:
        raise SystemExit(f"{', '.join(unknown)} is no setting of lmlab.kernels.decode_layers")
    return {name: ast.literal_eval(value) for name, value in texts.items()}


def apply_settings(settings: dict, defaults: dict) -> None:
    """Set decode_layers' module settings: a variant's, the others compared back at their defaults."""
    for name, value in {**defaults, **settings}.items():
        setattr(dl, name, value)


def weights(model, quant: str):
    """A copy of the model's weights, quantized by `quant` (round to nearest, in the layout the megakernel reads)
    unless it is "none"."""
    copied = copy.deepcopy(model)
    if quant != "none":
        quantize(copied, {**quant_config(quant, model), "method": "rtn", **QUANT_LAYOUT["megakernel"]})
    return copied


def generate(engine: Engine, ids: torch.Tensor, new: int) -> float:
    return engine.generate(ids.tolist(), max_new_tokens=new, sync_every=64).stats.decode_tokens_per_s


def one_step(engine: Engine, ids: torch.Tensor, new: int) -> list:
    """`middle_step` of a profiled generation."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        generate(engine, ids, new)
        torch.cuda.synchronize()
    return middle_step(sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                              key=lambda e: e.time_range.start))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=["O_ACC_ALIGN=1", "O_ACC_ALIGN=4"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--out", default="ab-megakernel-steps.json")
    args = parser.parse_args()
    variants = {text: parse_variant(text) for text in args.variants}
    model, _ = build_model(DEFAULT_OVERRIDES, None, torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, model.vocab_size, (1, 128), device="cuda")
    defaults = {name: getattr(dl, name) for settings, _, _ in variants.values() for name in settings}
    engines, firsts = {}, {}
    for name, (settings, quant, persistent) in variants.items():
        apply_settings(settings, defaults)
        engines[name] = Engine(weights(model, quant), True, megakernel=True)
        engines[name].megakernel.persistent = persistent
        firsts[name] = engines[name].generate(ids.tolist(), max_new_tokens=args.new, sync_every=64)
        first = next(iter(firsts.values())).tokens[0]
        same = next((i for i, (a, b) in enumerate(zip(first, firsts[name].tokens[0])) if a != b), len(first))
        print(f"{name}: warmed up ({firsts[name].stats.decode_tokens_per_s:,.0f} tokens/s; the first {same} tokens "
              f"those of {next(iter(firsts))})", flush=True)
    runs = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            runs[name].append(generate(engine, ids, args.new))
    result = {}
    for name, engine in engines.items():
        steps = one_step(engine, ids, args.new) if engine.megakernel.persistent else []  # a step is one launch
        result[name] = {"tokens_per_s": statistics.median(runs[name]), "runs": runs[name], "one_step": steps}
        print(f"{name:<24} {result[name]['tokens_per_s']:8,.0f} tokens/s (runs {min(runs[name]):,.0f}-"
              f"{max(runs[name]):,.0f})" + ("; one step (GPU us, idle us before):" if steps else ""), flush=True)
        for kernel, us, idle in steps:
            print(f"  {us:8.1f} {idle:6.1f}  {kernel}")
        if steps:
            print(f"  {sum(r[1] + r[2] for r in steps):8.1f} us from one launch of the layer stack to the next")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
