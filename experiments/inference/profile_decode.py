"""Where a compiled decode step spends its GPU time: torch.profiler over a few steps, kernels in groups.

    python experiments/inference/profile_decode.py --batch 1 32 [--steps 10] [model overrides ...]

Builds the bench's random-weight model (default llama400m, vocab 50304, bf16), prefills a 128-token
prompt per sequence and profiles `--steps` compiled decode steps run without their CUDA graph (the graph
hides its kernels from the profiler; the kernels are the same). Prints, per batch size, the GPU time per
step by kernel group (matmul, attention, Inductor-fused elementwise/reductions, other) and the top
kernels, so the next optimisation goes where the time is.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model
from lmlab.inference.engine import Engine

# Kernel name patterns -> group, first match wins.
GROUPS = (("matmul", r"gemm|gemv|cutlass|nvjet|sm90_xmma|splitK|_mm_"),
          ("attention", r"decode_kernel|combine_splits|flash|fmha|sdpa"),
          ("inductor", r"^triton_"),
          ("other", r""))


def group_of(name: str) -> str:
    return next(group for group, pattern in GROUPS if re.search(pattern, name))


def profile_batch(model, batch: int, prompt: int, steps: int, folded_norms: bool | None = None) -> None:
    engine = Engine(model, compile=True, cuda_graphs=False, folded_norms=folded_norms)
    vocab = model.embed_tokens.weight.shape[0]
    ids = torch.randint(0, vocab, (batch, prompt), device="cuda")
    engine.begin(batch, prompt + 256)  # the bench's cache: a 128-token prompt and 256 new tokens
    tokens = engine.extend(ids).argmax(-1)
    for _ in range(3):  # compile and warm
        tokens = engine.decode(tokens).argmax(-1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tokens = engine.decode(tokens).argmax(-1)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_group, by_name, launches = defaultdict(float), defaultdict(float), 0
    for e in kernels:
        by_group[group_of(e.name)] += e.device_time / steps
        by_name[e.name] += e.device_time / steps
        launches += 1
    total = sum(by_group.values())
    print(f"\n== batch {batch}: {total:.0f} us of GPU time per step, {launches / steps:.0f} kernels per step")
    for group, us in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"  {group:<10} {us:8.1f} us  {us / total:6.1%}")
    print("  top kernels (us per step):")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {us:8.1f}  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", default=DEFAULT_OVERRIDES)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--unfolded-norms", action="store_true",
                        help="the layer-by-layer step at every batch (by default batches > 1 fold the norms)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    model, _ = build_model(args.overrides, None, torch.device("cuda"), torch.bfloat16)
    for batch in args.batch:
        profile_batch(model, batch, args.prompt, args.steps, False if args.unfolded_norms else None)


if __name__ == "__main__":
    main()
