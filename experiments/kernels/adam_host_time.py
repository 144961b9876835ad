"""How long the reference AdamW's step takes, and how much of it the host spends issuing it, on float32 and on bf16
tensors (bf16: updated in float32, packed a run of tensors at a time, and rounded back stochastically).

    python experiments/kernels/adam_host_time.py [--device cuda] [--small]

The tensors have the ~400M config's matrix shapes (q/k/v fused, o, gate/up fused, down, 24 layers), its norms and a
byte vocabulary's embedding and head: 147 tensors, 309M elements; with --small, 219 tensors of 64 x 64 (what a CPU
steps in reasonable time). Medians of 10 steps after 3.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmlab.optim.adam import AdamW

SHAPES = [(3072, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 24 + [(1024,)] * 49 + [(256, 1024)] * 2
SMALL = [(64, 64)] * 219


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: str, steps: int = 10) -> tuple[float, float]:
    """(median step, median host time to issue it), in ms."""
    params = [torch.nn.Parameter(torch.randn(*shape, device=device).to(dtype)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = AdamW(params, lr=1e-3)
    for _ in range(3):
        optimizer.step()
    sync(device)
    total, host = [], []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        host.append(time.perf_counter() - start)
        sync(device)
        total.append(time.perf_counter() - start)
    return statistics.median(total) * 1e3, statistics.median(host) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="219 tensors of 64 x 64")
    args = parser.parse_args()
    shapes = SMALL if args.small else SHAPES
    elements = sum(torch.Size(shape).numel() for shape in shapes)
    for dtype in (torch.float32, torch.bfloat16):
        step, host = time_steps(shapes, dtype, args.device)
        print(f"{dtype}: {len(shapes)} tensors, {elements / 1e6:.1f}M elements; step {step:.1f} ms, host {host:.1f} ms")


if __name__ == "__main__":
    main()
