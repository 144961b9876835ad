"""What a small host-to-GPU copy costs the host, and whether it waits for the GPU's queue: each way of copying 900
int64s, timed on the host behind ~50 ms of queued GPU work (a copy that waits takes ~50 ms). Medians of 20.

    python experiments/kernels/host_to_device_copies.py

Why: the reference Adam uploads small index tables every step (lmlab.optim.stochastic_rounding), and the step's
host time is what the GPU waits on (experiments/kernels/README.md, twelfth session).
"""

from __future__ import annotations

import statistics
import time

import torch

VALUES = list(range(900))


def host_time(copy, runs: int = 20) -> float:
    """Median host seconds of `copy()` issued behind ~50 ms of GPU work."""
    copy()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        torch.cuda._sleep(100_000_000)  # cycles: ~50 ms queued on an H100
        start = time.perf_counter()
        copy()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ways = {
        "pin_memory() then .to(non_blocking)": lambda: torch.tensor(VALUES).pin_memory().to("cuda", non_blocking=True),
        "empty(pin_memory) + copy_, .to(non_blocking)": lambda: torch.empty(
            len(VALUES), dtype=torch.int64, pin_memory=True).copy_(torch.tensor(VALUES)).to("cuda", non_blocking=True),
        "tensor(pin_memory=True).to(non_blocking)": lambda: torch.tensor(VALUES, pin_memory=True).to(
            "cuda", non_blocking=True),
        "pageable .to(non_blocking)": lambda: torch.tensor(VALUES).to("cuda", non_blocking=True),
        "pageable .to()": lambda: torch.tensor(VALUES).to("cuda"),
        "tensor(device='cuda')": lambda: torch.tensor(VALUES, device="cuda"),
    }
    for name, copy in ways.items():
        print(f"{name}: host {host_time(copy) * 1e6:,.0f} us")


if __name__ == "__main__":
    main()
