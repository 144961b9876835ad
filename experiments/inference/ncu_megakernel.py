"""One launch of the decode megakernel's layer stack, for Nsight Compute's counters.

llama400m (vocab 50304, random weights, bf16), batch 1, one token at slot 255 of a 384-slot cache (sweep_megakernel's
`stack_step`), persistent, on the weights as they are or quantized by a `quant` entry as ab_megakernel_steps.py
quantizes them. Five launches first (compiles), then one between cudaProfilerStart and cudaProfilerStop:

    ncu --clock-control none --profile-from-start off --set full -k regex:layers_kernel -o mk \\
        python experiments/inference/ncu_megakernel.py [--quant int8]
"""

from __future__ import annotations

import argparse

import torch
from ab_megakernel_steps import weights  # this folder's: the same quantized copies
from sweep_megakernel import stack_step

from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model
from lmlab.inference.megakernel import Megakernel
from lmlab.timing import under_profiler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="none", help="a quant entry, or none")
    args = parser.parse_args()
    model, _ = build_model(DEFAULT_OVERRIDES, None, torch.device("cuda"), torch.bfloat16)
    step = stack_step(Megakernel(weights(model, args.quant)), batch=1, persistent=True)
    under_profiler(step, warmup=5)
    print(f"profiled one layer stack, quant={args.quant}")


if __name__ == "__main__":
    main()
