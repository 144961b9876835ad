"""RMSNorm forward layouts on a GPU, each next to a copy of the same layout.

Times, at 16384 x 4096 bf16 under `lmlab bench kernels`' cold-L2 timing (`median_seconds`), a torch
copy, and Triton copies and RMSNorm forwards of two shapes: a tile of ROWS rows per program, and a
persistent loop over rows whose loads Triton pipelines STAGES deep. Each copy twin shows what its
layout can move at all, so the norm's gap to it is what the reduction between load and store costs.
Then times and profiles the shipped kernel's forward+backward.

It was written to find why `lmlab bench kernels` read RMSNorm near 2 TB/s. The answer was the bench,
not the kernel: the case's inputs were built by a closure that saw a later case's row count (32768,
not 16384), so its rows timed twice the work they counted.

    python experiments/kernels/rmsnorm_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from lmlab.kernels.bench import copy_seconds, median_seconds


@triton.jit
def _tile(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, eps, D: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr,
          STREAM: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    ok = rows[:, None] < n_rows
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0, eviction_policy="evict_first" if STREAM else "")
    if NORM:
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
        w = tl.load(w_ptr + cols).to(tl.float32)
        y = ((xf * rstd[:, None]).to(x.dtype).to(tl.float32) * w[None, :]).to(y_ptr.dtype.element_ty)
        tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)
    else:
        y = x
    tl.store(y_ptr + offs, y, mask=ok, cache_modifier=".cs" if STREAM else "")


@triton.jit
def _persistent(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, eps, D: tl.constexpr, NORM: tl.constexpr,
                STAGES: tl.constexpr):
    cols = tl.arange(0, D)
    w = tl.load(w_ptr + cols).to(tl.float32)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0), num_stages=STAGES):
        x = tl.load(x_ptr + row.to(tl.int64) * D + cols)
        if NORM:
            xf = x.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
            y = ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(y_ptr.dtype.element_ty)
            tl.store(rstd_ptr + row, rstd)
        else:
            y = x
        tl.store(y_ptr + row.to(tl.int64) * D + cols, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    n, d = args.rows, args.dim
    x = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    w = torch.randn(d, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rstd = torch.empty(n, device=dev, dtype=torch.float32)
    moved = 2 * x.numel() * x.element_size()
    copy = moved / copy_seconds(moved // 2, args.repeats, dev)
    rows = [{"name": "torch copy_ (256 MiB)", "gbps": copy / 1e9}]

    def record(name: str, fn, **params) -> None:
        seconds = median_seconds(fn, args.repeats, 3, dev)
        rows.append({"name": name, **params, "us": seconds * 1e6, "gbps": moved / seconds / 1e9,
                     "of_copy": moved / seconds / copy})
        print(f"{name:12} {params} {seconds * 1e6:8.1f} us {moved / seconds / 1e9:6.0f} GB/s "
              f"{moved / seconds / copy:5.0%}", flush=True)

    record("clone", lambda: x.clone())
    reference = ((x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w)
    for norm, rows_per, warps, stream in itertools.product((0, 1), (1, 2, 4, 8, 16), (4, 8, 16, 32), (0, 1)):
        if stream and not norm:
            continue
        try:
            launch = lambda: _tile[(triton.cdiv(n, rows_per),)](x, w, y, rstd, n, 1e-6, D=d, ROWS=rows_per,
                                                                 NORM=norm, STREAM=stream, num_warps=warps)
            launch()
        except Exception as err:  # out of registers or shared memory: reported, not fatal
            print(f"tile rows={rows_per} warps={warps}: {type(err).__name__}")
            continue
        if norm:
            torch.testing.assert_close(y, reference, atol=2e-2, rtol=2e-2)
        record("tile-norm" if norm else "tile-copy", launch, rows=rows_per, warps=warps, stream=stream)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for norm, per_sm, warps, stages in itertools.product((0, 1), (1, 2, 4, 8), (4, 8, 16), (1, 2, 3, 4)):
        try:
            launch = lambda: _persistent[(min(n, per_sm * sms),)](x, w, y, rstd, n, 1e-6, D=d, NORM=norm,
                                                                 STAGES=stages, num_warps=warps)
            launch()
        except Exception as err:
            print(f"persistent per_sm={per_sm} warps={warps} stages={stages}: {type(err).__name__}")
            continue
        if norm:
            torch.testing.assert_close(y, reference, atol=2e-2, rtol=2e-2)
        record("pers-norm" if norm else "pers-copy", launch, per_sm=per_sm, warps=warps, stages=stages)

    # Where the shipped kernel's forward+backward spends its time.
    from lmlab.kernels.rmsnorm_triton import rms_norm_triton
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn_like(x)

    def fwd_bwd() -> None:
        xl.grad = wl.grad = None
        rms_norm_triton(xl, wl, 1e-6).backward(dy)

    fwd_bwd()
    seconds = median_seconds(fwd_bwd, args.repeats, 3, dev)
    print(f"shipped fwd+bwd {seconds * 1e6:.1f} us")
    rows.append({"name": "shipped fwd+bwd", "us": seconds * 1e6})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fwd_bwd()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    print(table)
    rows.append({"name": "profile", "table": table})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "copy_gbps": copy / 1e9, "shape": [n, d]}, f, indent=1)


if __name__ == "__main__":
    main()
