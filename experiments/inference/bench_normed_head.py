"""Time the fused final norm + head (lmlab.kernels.normed_head_triton) against what the compiled engine runs.

    python experiments/inference/bench_normed_head.py --out bench-normed-head.json

llama400m's head (50,304 x 1,024, bf16, random weights), 1, 2 and 4 input rows: `normed_head` at each setting of
vocabulary rows per program and warps, and `model._head(model.norm(x)).float()` through torch.compile (Inductor, as the
compiled engine's step), each replayed from a CUDA graph (medians of 200 replays after 20), with the bandwidth each
reaches against a device-to-device copy of the head's weight measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model
from lmlab.inference.engine import COMPILE_OPTIONS
from lmlab.kernels import normed_head_triton as nh
from lmlab.timing import graph_replay_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-normed-head.json")
    args = parser.parse_args()
    model, _ = build_model(DEFAULT_OVERRIDES, None, torch.device("cuda"), torch.bfloat16)
    head, norm = model.output_head(), model.norm
    weight_bytes = head.weight.numel() * head.weight.element_size()
    copy = torch.empty_like(head.weight)
    copy_us = graph_replay_us(lambda: copy.copy_(head.weight), replays=200, skip=20)
    copy_tbs = 2 * weight_bytes / copy_us / 1e6  # read and written
    print(f"device copy of the head's weight: {copy_us:.1f} us, {copy_tbs:.2f} TB/s", flush=True)
    reference = torch.compile(lambda x: model._head(model.norm(x)).float(), dynamic=False, options=COMPILE_OPTIONS)
    rows = []
    for n in (1, 2, 4):
        x = torch.randn(n, head.weight.shape[1], device="cuda", dtype=torch.bfloat16)
        want = reference(x)
        us = graph_replay_us(lambda: reference(x), replays=200, skip=20)
        rows.append({"rows": n, "kernel": "inductor", "us": us, "tb_s": weight_bytes / us / 1e6})
        print(f"rows {n}  inductor: {us:6.1f} us  {rows[-1]['tb_s']:.2f} TB/s", flush=True)
        for per_program, warps in itertools.product((8, 16, 32), (4, 8)):
            nh.ROWS, nh.NUM_WARPS = per_program, warps
            got = nh.normed_head(x, norm.weight, norm.eps, head)
            torch.testing.assert_close(got, want, atol=0.1, rtol=0.02)  # bf16: a neighbour's rounding at most
            us = graph_replay_us(lambda: nh.normed_head(x, norm.weight, norm.eps, head), replays=200, skip=20)
            rows.append({"rows": n, "kernel": "normed_head", "ROWS": per_program, "NUM_WARPS": warps, "us": us,
                         "tb_s": weight_bytes / us / 1e6})
            print(f"rows {n}  normed_head ROWS={per_program:2d} warps={warps}: {us:6.1f} us  "
                  f"{rows[-1]['tb_s']:.2f} TB/s ({rows[-1]['tb_s'] / copy_tbs:.0%} of the copy's)", flush=True)
    with open(args.out, "w") as f:
        json.dump({"copy_us": copy_us, "copy_tb_s": copy_tbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
