"""The tile settings of lmlab's Gluon forward (`lmlab.kernels.flash_gluon`, the Hopper path) against the
portable Triton forward and cuDNN.

lmlab's Triton forward waits for each block's scores right after issuing them: Triton 3.6 keeps a
wgmma in flight across loop iterations only when its result is the next wgmma's accumulator, so
scores that the softmax reads never are. `flash_gluon`'s forward, written in Gluon, takes
FlashAttention-3's order: it issues block j's scores, then block j-1's P V, waits for the scores alone
and runs block j's softmax on the CUDA cores while the tensor cores compute P V. Compiled offline for
sm_90a (`attention_sass.py`), it has no serialized wgmmas and no spills.

Each setting is timed beside the portable Triton forward (autotuned; `flash_triton.GLUON` off) and
SDPA (cuDNN), forward only, medians with L2 emptied, at the training steps' and the issue's shapes;
every output and LSE is checked against SDPA and the Triton kernel first, and the worst error's
(batch, head, row) is reported (a wrong mask, ring slot or barrier phase shows as whole blocks).

Limits: causal self-attention, sequence a multiple of 128, head_dim 64 or 128, bf16, Hopper.

    python experiments/kernels/attention_gluon_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from lmlab.kernels import flash_gluon, flash_triton
from lmlab.kernels.bench import median_seconds
from lmlab.kernels.flash_triton import flash_attention_triton_forward


def portable(fn):
    """fn run with flash_triton's portable Triton kernels, its Hopper path off."""
    def run(*args, **kwargs):
        flash_triton.GLUON = False
        try:
            return fn(*args, **kwargs)
        finally:
            flash_triton.GLUON = True
    return run


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  setting: flash_gluon.FwdSetting | flash_gluon.WsSetting) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_gluon's forward at one tile setting: (out, lse)."""
    return flash_gluon.forward(q, k, v, 1 / math.sqrt(q.shape[-1]), setting)


SHAPES = [(16, 16, 2048, 64), (16, 16, 2048, 128), (4, 16, 4096, 128), (1, 16, 16384, 64)]


def shape_arg(text: str) -> tuple[int, int, int, int]:
    """--shapes B,H,S,D (a small one, say 1,2,512,64, checks a kernel in a second)."""
    b, h, s, d = (int(x) for x in text.split(","))
    return b, h, s, d


def worst(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, str]:
    """The largest absolute error, and where: (batch, head, row) of a (batch, heads, rows, ...) tensor. A mask, ring
    slot or barrier phase that is off shows as errors in whole blocks of rows."""
    err = (got.float() - expected.float()).abs()
    per_row = err.reshape(*err.shape[:3], -1).amax(-1)
    b, h, row = (int(i) for i in torch.unravel_index(per_row.argmax(), per_row.shape))
    return per_row.max().item(), f"b{b} h{h} row {row}"


def measure(name: str, fn, check, shape: str, flops: float, repeats: int, dev: torch.device) -> dict | None:
    """check(fn()) -> its error fields (the first two printed), then fn timed; a setting that fails to compile or
    launch is reported, not fatal."""
    try:
        errors = check(fn())
        seconds = median_seconds(fn, repeats, 3, dev)
    except Exception as exc:
        print(f"{shape} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
        return None
    row = {"shape": shape, "impl": name, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12, **errors}
    err, where = list(errors.values())[:2]
    print(f"{shape:20} {name:44} {row['ms']:7.3f} ms {row['tflops']:6.1f} TFLOP/s err {err:.1e} ({where})",
          flush=True)
    return row


# (BLOCK_M, BLOCK_N, NUM_BUF, num_warps, Q_IN_REGS: Q as the register operand of Q K^T)
SETTINGS = [(*tiles, q_in_regs) for q_in_regs in (False, True)
            for tiles in ((128, 64, 3, 8), (128, 128, 2, 8), (64, 64, 2, 4), (64, 64, 3, 4))]


def parse_args(description: str, kv_heads: bool = False) -> argparse.Namespace:
    """The probes' options; `kv_heads` adds --kv-heads (K/V heads, for GQA: the query heads' by default)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", type=shape_arg, nargs="+", default=SHAPES, help="B,H,S,D ...")
    if kv_heads:
        parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads of every shape (GQA)")
    return parser.parse_args()


def write_rows(path: str | None, dev: torch.device, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    dev = torch.device("cuda")
    rows = []
    for b, h, s, d in args.shapes:
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d / 2
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        expected_lse = portable(flash_attention_triton_forward)(q, k, v, True)[1]

        def check(result: tuple) -> dict:
            out, lse = result
            err, where = worst(out, expected)
            lse_err = 0.0 if lse is None else (lse - expected_lse).abs().max().item()
            return {"max_abs_err": err, "worst_at": where, "lse_max_abs_err": lse_err}

        candidates = {"sdpa": lambda: (F.scaled_dot_product_attention(q, k, v, is_causal=True), None),
                      "triton, autotuned": lambda: portable(flash_attention_triton_forward)(q, k, v, True)}
        for setting in SETTINGS:
            candidates[f"gluon {setting}"] = lambda setting=setting: gluon_forward(q, k, v, setting)
        for setting in flash_gluon.FWD_WS_SETTINGS[d]:
            candidates[f"gluon {setting}"] = lambda setting=setting: gluon_forward(q, k, v, setting)
        candidates["lmlab forward (setting timed)"] = lambda: flash_attention_triton_forward(q, k, v, True)
        measured = (measure(name, fn, check, f"B{b} H{h} S{s} D{d}", flops, args.repeats, dev)
                    for name, fn in candidates.items())
        rows += [row for row in measured if row is not None]
    write_rows(args.json, dev, rows)


if __name__ == "__main__":
    main()
