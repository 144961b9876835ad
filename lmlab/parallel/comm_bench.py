"""Benchmark: bandwidth of the collectives data parallelism uses, for several message sizes.

    python -m lmlab.parallel.comm_bench [--world-size N] [--sizes 1K 1M 64M] [--ops all_reduce broadcast]
    lmlab bench comm ...

Starts N processes: NCCL on N GPUs when this machine has two or more, else gloo on the CPU.
Every size is timed for each collective (median of --repeats after --warmup calls, the slowest
rank's), and the table shows the time, the algorithm bandwidth (buffer bytes / time) and the bus
bandwidth (what each rank's link carries: see lmlab/parallel/comm.py for the formulas).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import torch

from lmlab.atomic import atomic_write_text
from lmlab.parallel.comm import COLLECTIVES, CommResult, time_collective
from lmlab.parallel.launch import device_for, run_processes

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
# Default sizes, 4x apart: up to what fits a test machine's memory on CPU, up to 1 GiB on GPUs.
DEFAULT_SIZES = {"gloo": ["1K", "4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M"],
                 "nccl": ["64K", "256K", "1M", "4M", "16M", "64M", "256M", "1G"]}


def parse_size(text: str) -> int:
    """'64K' -> 65536: bytes, with an optional binary K, M or G."""
    match = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not match or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size; write bytes like 4096, 64K, 16M or 1G")
    return int(match[1]) * UNITS[match[2]]


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
    return str(nbytes)


def _bench_rank(rank: int, world_size: int, backend: str, sizes: list[int], ops: list[str], repeats: int,
                warmup: int) -> list[CommResult]:
    device = device_for(backend, rank)
    return [time_collective(op, nbytes, device, repeats, warmup) for nbytes in sizes for op in ops]


def report(results: list[CommResult], backend: str, world_size: int, repeats: int) -> str:
    lines = [f"{backend}, {world_size} ranks, float32, median of {repeats} (slowest rank)",
             f"{'size':>8}  {'op':<15}{'time_us':>12}{'algbw_GB/s':>13}{'busbw_GB/s':>13}"]
    lines += [f"{format_size(r.nbytes):>8}  {r.op:<15}{r.seconds * 1e6:12.1f}{r.algbw / 1e9:13.3f}{r.busbw / 1e9:13.3f}"
              for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus >= 2 else "gloo"
    parser = argparse.ArgumentParser(prog="lmlab bench comm", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=gpus if backend == "nccl" else 2,
                        help="processes (under NCCL, at most the number of GPUs)")
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[parse_size(s) for s in DEFAULT_SIZES[backend]],
                        help=f"buffer sizes in bytes, e.g. 4096 64K 16M (default {DEFAULT_SIZES[backend][0]} "
                             f"to {DEFAULT_SIZES[backend][-1]})")
    parser.add_argument("--ops", nargs="+", choices=list(COLLECTIVES), default=list(COLLECTIVES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the whole run is given up")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be >= 2: a collective among one rank moves nothing")
    if backend == "nccl" and args.world_size > gpus:
        parser.error(f"--world-size {args.world_size} exceeds the {gpus} GPUs of this machine")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    per_rank = run_processes(_bench_rank, args.world_size, backend,
                             args=(backend, args.sizes, args.ops, args.repeats, args.warmup), timeout=args.timeout)
    results = per_rank[0]  # every rank holds the same numbers: each time is reduced to the slowest rank's
    print(report(results, backend, args.world_size, args.repeats))
    if args.json:
        record = {"backend": backend, "world_size": args.world_size, "repeats": args.repeats, "warmup": args.warmup,
                  "device": torch.cuda.get_device_name() if backend == "nccl" else "cpu",
                  "results": [dataclasses.asdict(r) for r in results]}
        atomic_write_text(args.json, json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
