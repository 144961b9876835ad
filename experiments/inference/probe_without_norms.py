"""How much of the batch-32 decode step do its RMSNorm kernels cost? An upper bound, by taking them out.

    python experiments/inference/probe_without_norms.py --batch 32

Times the compiled step of llama400m (random weights, bf16) replayed from its CUDA graph at slot 255 of a
384-slot cache, as it is and with every pre-norm block patched to `mlp(attend(x))`: no norms and no residual
adds, so a layer runs only its matmuls, attention and the SwiGLU product. The outputs are meaningless; the
difference in time is what a step would gain if the norms and adds moved into the matmuls' prologues and
epilogues at no cost of their own. Medians of 5 timings of 50 replays each.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model
from lmlab.nn.blocks import PreNormBlock
from probe_micro_batches import engines_for, time_steps  # beside this script


def step_us(model, batch: int) -> float:
    engines, streams = engines_for(model, batch, 1), [torch.cuda.current_stream()]
    time_steps(engines, streams)  # warm-up
    return statistics.median(time_steps(engines, streams) for _ in range(5))


def without_norms(self, x, position, positions, cache=None):
    return self.mlp(self.attend(x, position, positions, cache))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32])
    args = parser.parse_args()
    model, _ = build_model(DEFAULT_OVERRIDES, None, torch.device("cuda"), torch.bfloat16)
    kept = PreNormBlock.forward
    for batch in args.batch:
        with_norms = step_us(model, batch)
        PreNormBlock.forward = without_norms
        torch._dynamo.reset()
        bare = step_us(model, batch)
        PreNormBlock.forward = kept
        torch._dynamo.reset()
        print(f"batch {batch}: {with_norms:7.1f} us a step as it is, {bare:7.1f} us without norms and residual adds "
              f"({with_norms - bare:+.1f} us, {with_norms / bare:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
