"""The batch-1 layer stack launched three ways, timed in one process, in turns: the persistent megakernel (a grid
barrier a stage), launches per (layer, stage) (q/k/v through o_proj in one where STAGE_MERGE_ATTENTION), and that chain
with programmatic dependent launch (PDL: each stage's programs start while the previous stage runs, issue their first
weight loads, then wait for it in hardware).

    python experiments/inference/ab_stack_launches.py [VARIANT ...] [--rounds 7] [--slots 255 383] [--quant int8]
        [--out F]

A variant is `persistent=BOOL[,NAME=VALUE...]` with `lmlab.kernels.decode_layers`' module settings (STAGE_PDL,
STAGE_PROGRAMS_PER_SM, the tile sizes, ...). llama400m, random weights, bf16 (`--quant`: quantized by that entry
as ab_megakernel_steps.py quantizes), one token at the given slots of a
384-slot cache (their mean is a variant's time), each variant's stack replayed from a CUDA graph (median of the last
40 of 50 replays a round; the median over rounds is reported). Before timing, each variant's step is checked against
the first variant's on the same inputs: the residual stream's largest difference, relative to its largest value,
and the new keys'.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from ab_megakernel_steps import apply_settings, parse_variant, weights  # this folder's
from sweep_megakernel import stack_inputs, time_stack

from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model
from lmlab.inference.megakernel import Megakernel
from lmlab.kernels import decode_layers as dl

DEFAULT = ["persistent=True", "persistent=False,STAGE_PDL=False", "persistent=False,STAGE_PROGRAMS_PER_SM=1",
           "persistent=False"]


def stack_variant(text: str) -> tuple[bool, dict]:
    """(persistent, decode_layers settings): ab_megakernel_steps' variant, whose weights are all --quant's."""
    settings, quant, persistent = parse_variant(text)
    if quant != "none":
        raise SystemExit(f"ab_stack_launches: {text}: every variant runs on the same weights; pass --quant {quant}")
    return persistent, settings


def one_step(kernel: Megakernel, persistent: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream and layer 0's key cache after one step from seeded inputs."""
    torch.manual_seed(0)
    x, w, k, v, slots, start, cos, sin, eps = stack_inputs(kernel, 1)
    dl.decode_layers(x, w, k, v, slots, start, cos, sin, eps, persistent=persistent)
    torch.cuda.synchronize()
    return x, k[:, :, :, slots[0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=DEFAULT)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--slots", type=int, nargs="+", default=[255, 383])
    parser.add_argument("--quant", default="none")
    parser.add_argument("--out", default="ab-stack-launches.json")
    args = parser.parse_args()
    variants = {text: stack_variant(text) for text in args.variants}
    parse_variant(f"quant={args.quant}")  # an unknown entry fails here, before any model is built
    defaults = {name: getattr(dl, name) for _, settings in variants.values() for name in settings}
    model, _ = build_model(DEFAULT_OVERRIDES, None, torch.device("cuda"), torch.bfloat16)
    kernel = Megakernel(weights(model, args.quant))
    reference = None
    checks = {}
    for name, (persistent, settings) in variants.items():
        apply_settings(settings, defaults)
        x, key = one_step(kernel, persistent)
        reference = reference or (x, key)
        checks[name] = {"residual": ((x - reference[0]).abs().max() / reference[0].abs().max()).item(),
                        "keys": ((key - reference[1]).abs().max() / reference[1].abs().max()).item()}
        print(f"{name}: residual off by {checks[name]['residual']:.2e}, keys by {checks[name]['keys']:.2e} "
              f"(relative to the largest, against {next(iter(variants))})", flush=True)
    runs = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name, (persistent, settings) in variants.items():
            apply_settings(settings, defaults)
            runs[name].append(statistics.mean(time_stack(kernel, 1, persistent, slot) for slot in args.slots))
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {us[-1]:.1f}" for name, us in runs.items()), flush=True)
    result = {}
    for name, us in runs.items():
        result[name] = {"us": statistics.median(us), "runs": us, **checks[name]}
        print(f"{name:<48} {result[name]['us']:8.1f} us a step of the layer stack ({min(us):.1f}-{max(us):.1f})")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "slots": args.slots, "quant": args.quant,
                   "variants": result}, f, indent=1)


if __name__ == "__main__":
    main()
