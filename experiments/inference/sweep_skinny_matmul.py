"""Tile sweep of the skinny matmul (`skinny_matmul.py`, beside this script) against cuBLAS and Inductor on llama400m's decode matmuls (CUDA).

    python experiments/inference/sweep_skinny_matmul.py --rows 1 8 32 --out sweep.json

For each weight shape of llama400m (q/k/v fused, o_proj, gate/up fused, down_proj, the head) and each
row count: F.linear (cuBLAS), the same under torch.compile with coordinate-descent tuning (Inductor's
matmul-as-reduction at one row), the kernel with its default tiles (`choose_launch`), and a grid of
tiles. Each is timed as a CUDA graph of calls on distinct weights (more bytes than the L2 holds, as
the layers of a model are), replayed after warm-up; medians per call, and the weight bytes per second
against a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from skinny_matmul import Launch, choose_launch, launch_skinny, sm_count  # beside this script

SHAPES = {"qkv": (3072, 1024), "o_proj": (1024, 1024), "gate_up": (5504, 1024), "down": (1024, 2752),
          "head": (50304, 1024)}
L2_MULTIPLE = 200 << 20  # weights cycled per graph: several times the L2


def graph_time(fn, calls: int, replays: int = 20) -> float:
    """Median seconds per call of `fn(i)` for i in range(calls), captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(replays + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times[3:])


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_time(lambda i: dst.copy_(src), 1)


def candidates(m: int) -> list[Launch]:
    tiles = [(8, 512), (16, 256), (16, 512), (32, 128), (32, 256), (64, 128)] if m == 1 else \
        [(16, 128), (16, 256), (32, 64), (32, 128), (32, 256), (64, 64), (64, 128)]
    return [Launch(n, k, split, warps, stages) for (n, k), split, warps, stages
            in itertools.product(tiles, (1, 2, 4, 8), (4,), (3, 4, 6))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--budget-s", type=float, default=25.0, help="sweep seconds per (shape, rows)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch._inductor.config.coordinate_descent_tuning = True
    copy = copy_bandwidth()
    sms = sm_count(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e9:,.0f} GB/s, {sms} SMs", flush=True)
    results = []
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(2, L2_MULTIPLE // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, weights[0])
            linear = torch.compile(F.linear, dynamic=False)
            row = {"shape": name, "n": n, "k": k, "rows": m, "bytes": n * k * 2,
                   "cublas_s": graph_time(lambda i: F.linear(x, weights[i]), copies),
                   "inductor_s": graph_time(lambda i: linear(x, weights[i]), copies)}
            default = choose_launch(m, n, k, sms)
            err = (launch_skinny(x, weights[0], default).float() - want.float()).abs().max().item()
            row["default"] = {**default.__dict__, "s": graph_time(lambda i: launch_skinny(x, weights[i], default), copies),
                              "max_abs_err": err}
            sweep, began = [], time.perf_counter()
            for launch in candidates(m):
                if time.perf_counter() - began > args.budget_s:
                    break
                try:
                    sweep.append({**launch.__dict__, "s": graph_time(lambda i: launch_skinny(x, weights[i], launch), copies)})
                except Exception as failure:  # a tile that does not fit (shared memory): skip it
                    print(f"  skip {launch}: {type(failure).__name__}", flush=True)
            sweep.sort(key=lambda r: r["s"])
            row["best"], row["swept"] = sweep[:5], len(sweep)
            results.append(row)
            gbs = lambda s: row["bytes"] / s / 1e9  # noqa: E731
            best = sweep[0]
            print(f"{name:8} m={m:<3} cuBLAS {row['cublas_s'] * 1e6:6.2f} us ({gbs(row['cublas_s']):5,.0f} GB/s)  "
                  f"Inductor {row['inductor_s'] * 1e6:6.2f} ({gbs(row['inductor_s']):5,.0f})  "
                  f"default {row['default']['s'] * 1e6:6.2f} ({gbs(row['default']['s']):5,.0f})  "
                  f"best {best['s'] * 1e6:6.2f} ({gbs(best['s']):5,.0f}) n{best['block_n']} k{best['block_k']} "
                  f"split{best['split_k']} w{best['num_warps']} s{best['num_stages']}  [{len(sweep)} swept, err {err:.1e}]",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps({"copy_bytes_per_s": copy, "results": results}, indent=1))


if __name__ == "__main__":
    main()
