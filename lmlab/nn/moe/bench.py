"""Benchmark: one MoE layer against a dense FFN with the same active parameters, in one run.

    python -m lmlab.nn.moe.bench [--tokens N] [--d-model D] [--d-ff F] [--experts E] [--k K]
    lmlab bench moe ...

Both are SwiGLU. The MoE layer has E experts of hidden size F and routes each token to k of
them (top-k softmax router, renormalised); the dense FFN has hidden size k * F, so a token
meets the same number of expert weights in both. Each is timed for forward + backward on the
same tokens (median of --repeats after warm-up, timed in turns; bf16 autocast on CUDA, float32 on CPU), and
the ratio MoE / dense is printed. The MoE layer is timed dropless and with capacity factor 1.25;
--compile adds both under torch.compile (ratio against the compiled dense FFN).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from lmlab.nn.ffn import FFNS
from lmlab.nn.moe.layer import MoELayer
from lmlab.nn.moe.routers import TopKRouter
from lmlab.timing import interleaved_medians

# (tokens, d_model, expert d_ff). GPU: the FFN of the ~400M reference config (d_model 1024, SwiGLU
# hidden 2752, batch 16 x 2048 tokens) split into 8 experts of half its width. CPU: a small layer.
SIZES = {"cuda": (32768, 1024, 1376), "cpu": (4096, 256, 256)}


def _step(layer: torch.nn.Module, x: torch.Tensor, autocast) -> None:
    layer.zero_grad(set_to_none=True)  # as a training step does: backward writes fresh gradients
    x.grad = None
    with autocast():
        y = layer(x)
    y.float().square().mean().backward()


def _autocast(device: str):
    return (lambda: torch.autocast("cuda", torch.bfloat16)) if device == "cuda" else contextlib.nullcontext


def profile(tokens: int, d_model: int, d_ff: int, experts: int, k: int, device: str) -> str:
    """torch.profiler's table of a few dropless MoE steps, heaviest operators first."""
    layer = MoELayer(d_model, {"name": "swiglu"}, TopKRouter.Config(n_experts=experts, k=k, d_ff=d_ff)).to(device)
    x = torch.randn(tokens, d_model, device=device, requires_grad=True)
    for _ in range(3):
        _step(layer, x, _autocast(device))
    with torch.profiler.profile() as prof:
        for _ in range(5):
            _step(layer, x, _autocast(device))
    sort_by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=20)


def run(tokens: int, d_model: int, d_ff: int, experts: int, k: int, repeats: int, device: str,
        compile: bool = False) -> dict:
    autocast = _autocast(device)
    x = torch.randn(tokens, d_model, device=device, requires_grad=True)
    layers = {"dense": FFNS.build({"name": "swiglu", "d_ff": k * d_ff}, d_model)}
    for label, cf in (("moe_dropless", None), ("moe_cf1.25", 1.25)):
        cfg = TopKRouter.Config(n_experts=experts, k=k, d_ff=d_ff, capacity_factor=cf)
        layers[label] = MoELayer(d_model, {"name": "swiglu"}, cfg)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "tokens": tokens,
              "d_model": d_model, "expert_d_ff": d_ff, "dense_d_ff": k * d_ff, "experts": experts, "k": k,
              "repeats": repeats}
    if compile:  # the same layers through torch.compile, timed alongside
        layers.update({f"{label}_compiled": torch.compile(layer) for label, layer in list(layers.items())})
    steps = {label: (lambda layer=layer.to(device): _step(layer, x, autocast)) for label, layer in layers.items()}
    result["ms"] = {label: s * 1e3 for label, s in interleaved_medians(steps, repeats, warmup=3).items()}
    result["ratio"] = {label: ms / result["ms"][_dense_of(label)] for label, ms in result["ms"].items()
                       if not label.startswith("dense")}
    return result


def _dense_of(label: str) -> str:
    return "dense_compiled" if label.endswith("_compiled") else "dense"


def report(r: dict) -> str:
    lines = [f"{r['device']}: {r['tokens']} tokens, d_model {r['d_model']}, {r['experts']} experts of d_ff "
             f"{r['expert_d_ff']}, top-{r['k']}; dense d_ff {r['dense_d_ff']} (same active parameters); "
             f"forward+backward, median of {r['repeats']}"]
    for label, ms in r["ms"].items():
        ratio = f"  ({r['ratio'][label]:.2f}x {_dense_of(label)})" if label in r["ratio"] else ""
        lines.append(f"  {label:<22} {ms:9.2f} ms{ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, d_model, d_ff = SIZES[device]
    parser = argparse.ArgumentParser(prog="lmlab bench moe", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--d-model", type=int, default=d_model)
    parser.add_argument("--d-ff", type=int, default=d_ff, help="hidden size of one expert")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--compile", action="store_true", help="also time both layers under torch.compile")
    parser.add_argument("--profile", action="store_true", help="also print the top operators of a dropless MoE step")
    args = parser.parse_args(argv)
    if not 1 <= args.k <= args.experts:
        parser.error(f"--k must be between 1 and --experts ({args.experts})")
    result = run(args.tokens, args.d_model, args.d_ff, args.experts, args.k, args.repeats, device, args.compile)
    print(report(result))
    if args.profile:
        print(profile(args.tokens, args.d_model, args.d_ff, args.experts, args.k, device))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
