"""Does a decode step of B sequences run faster as micro-batches on concurrent CUDA streams?

    python experiments/inference/probe_micro_batches.py --batch 32 --splits 1 2 4

At batch 32 the compiled step of llama400m is a chain of ~9 small kernels a layer, each with its own ramp-up
and tail, and nothing in one chain can overlap. Split into n micro-batches, each with its own compiled engine
(its own caches and CUDA graph) on one shared model, the chains are independent: replayed on n streams, one
micro-batch's kernels can fill the SMs that another's leave idle, at the price of reading the weights n times
(from L2 when the streams run close together). Times graph replays at slot 255 of a 384-slot cache (random
weights, bf16), medians of 5 timings of 50 steps each, concurrent and, for contrast, one stream after another.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model
from lmlab.inference.engine import Engine

SLOT, CACHE = 255, 384


def engines_for(model, batch: int, split: int) -> list[Engine]:
    engines = []
    for _ in range(split):
        engine = Engine(model, compile=True)
        engine.begin(batch // split, CACHE)
        engines.append(engine)
    return engines


def time_steps(engines: list[Engine], streams: list[torch.cuda.Stream], steps: int = 50) -> float:
    """Microseconds per step of the whole batch: each engine's decode replayed on its stream."""
    tokens = [torch.zeros(e.shape[0], dtype=torch.long, device="cuda") for e in engines]
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for stream in streams:
        stream.wait_stream(main)
    for _ in range(steps):
        for engine, stream, token in zip(engines, streams, tokens):
            with torch.cuda.stream(stream):
                engine.next_slot = SLOT
                engine.decode(token)
    for stream in streams:
        main.wait_stream(stream)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    model, _ = build_model(DEFAULT_OVERRIDES, None, torch.device("cuda"), torch.bfloat16)
    results = {}
    for split in args.splits:
        engines = engines_for(model, args.batch, split)
        concurrent = [torch.cuda.Stream() for _ in engines]
        serial = [concurrent[0]] * len(engines)
        for streams in (concurrent, serial):
            time_steps(engines, streams)  # warm-up
        for label, streams in (("concurrent", concurrent), ("one stream", serial)):
            if split == 1 and label == "one stream":
                continue
            us = statistics.median(time_steps(engines, streams) for _ in range(5))
            results[(split, label)] = us
            print(f"batch {args.batch} as {split} x {args.batch // split} ({label}): {us:7.1f} us a step, "
                  f"{args.batch / us * 1e6:9,.0f} tokens/s", flush=True)
        del engines
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
