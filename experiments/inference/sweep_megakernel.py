"""Time the decode megakernel's layer stack alone over its launch settings, then generation with the best.

    python experiments/inference/sweep_megakernel.py --batch 1 32 --out sweep-megakernel.json

llama400m (vocab 50304, random weights, bf16), one token per sequence at slot 255 of a 384-slot cache: the layer
stack (`decode_layers`) replayed from a CUDA graph, medians of the last 40 of 50 replays, for each setting of
programs per SM, BLOCK_K and warps, persistent and launched stage by stage. Then `lmlab bench
generate`'s rows (128-token prompts, 256 new tokens) for the megakernel with the fastest batch-1 setting and for
the compiled engine, in the same process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model, run_benchmark
from lmlab.inference.megakernel import Megakernel
from lmlab.kernels import decode_layers_triton as dl

SETTINGS = {"PROGRAMS_PER_SM": (1, 2, 3), "BLOCK_K": (256, 512), "NUM_WARPS": (4, 8)}


def time_stack(kernel: Megakernel, batch: int, persistent: bool) -> float:
    """Microseconds per replay of one decode step through the layer stack."""
    model, w = kernel.model, kernel.weights
    shape = (len(model.layers), batch, w.n_kv_heads, 384, w.head_dim)
    k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(batch, w.o.shape[1], device="cuda", dtype=torch.bfloat16)
    slots, start = torch.tensor([255], device="cuda"), torch.zeros(batch, dtype=torch.long, device="cuda")
    rope, eps = model.position, model.layers[0].input_layernorm.eps

    def step():
        return dl.decode_layers(x, w, k, v, slots, start, rope.cos, rope.sin, eps, persistent=persistent)

    for _ in range(3):
        step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times[10:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--out", default="sweep-megakernel.json")
    args = parser.parse_args()
    model, _ = build_model(DEFAULT_OVERRIDES, None, torch.device("cuda"), torch.bfloat16)
    kernel = Megakernel(model)
    rows = []
    for batch in args.batch:
        rows.append({"batch": batch, "stages": True, "us": time_stack(kernel, batch, persistent=False)})
        print(f"batch {batch:>3} stage by stage: {rows[-1]['us']:8.1f} us", flush=True)
        for values in itertools.product(*SETTINGS.values()):
            setting = dict(zip(SETTINGS, values))
            for name, value in setting.items():
                setattr(dl, name, value)
            rows.append({"batch": batch, **setting, "us": time_stack(kernel, batch, persistent=True)})
            print(f"batch {batch:>3} {setting}: {rows[-1]['us']:8.1f} us", flush=True)
    best = min((r for r in rows if r["batch"] == args.batch[0] and "BLOCK_K" in r), key=lambda r: r["us"])
    for name in SETTINGS:
        setattr(dl, name, best[name])
    print("best at batch", args.batch[0], best, flush=True)
    bench = run_benchmark(model, ["megakernel", "compiled"], args.batch, [128], 256, repeats=3)
    with open(args.out, "w") as f:
        json.dump({"sweep": rows, "best": best, "bench": bench["rows"]}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
