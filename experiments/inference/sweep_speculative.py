"""Speculative decoding's batch-1 speed-up over the target alone, across drafts, draft engines and k.

    python experiments/inference/sweep_speculative.py TARGET_CKPT --drafts D1 [D2 ...] [--k 4 6]
        [--draft-engines compiled megakernel] [--prompts 8] [--new 256] [--budget-s 300] [--batch-invariant] [--json F]

In one process, greedy, on prompts from the target's validation split (as `lmlab bench generate --draft`):
the target alone is timed once on its compiled engine, then speculative decoding with each draft on each
draft engine (`compiled`: torch.compile and a CUDA graph; `megakernel`: its one-token steps in the decode
megakernel) and each k, the target on one compiled engine throughout. Each row reports tokens/s and the
speed-up over whole generations and over decoding alone (after the target's prefill and first token), the
acceptance rate, tokens and milliseconds (of the whole generation) per round, whether the rounds replayed
one captured CUDA graph each (`lmlab.inference.greedy_rounds`), and how many outputs equal the target's
own, with the first differing token of the others and the target's top-1 minus top-2 logit there. Rows left when
`--budget-s` runs out are skipped and named. `--batch-invariant`: the target's engines (alone and speculative) are
batch-invariant (lmlab.inference.batch_invariant), and the compiled target alone is timed too, for reference, and on a
GPU the target alone in the decode megakernel (lmlab's fastest batch-1 engine, not batch-invariant).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lmlab.inference.bench import build_model
from lmlab.inference.bench_checkpoint import CheckpointData, SpeculativeComparison
from lmlab.inference.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("--drafts", nargs="+", required=True)
    parser.add_argument("--k", type=int, nargs="+", default=[4])
    parser.add_argument("--draft-engines", nargs="+", default=["compiled"], choices=["compiled", "megakernel"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--budget-s", type=float, default=None, help="skip the rows left after this many seconds")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the target's engines batch-invariant: outputs identical to the target's in bf16 too")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    began = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    compile = device.type == "cuda"  # the CPU: a check of the script
    target, _ = build_model([], args.target, device, dtype)
    prompts = CheckpointData(args.target).prompts(args.prompts, args.prompt_len)
    comparison = SpeculativeComparison(target, prompts, args.new, compile, args.batch_invariant)
    kind = "batch-invariant" if args.batch_invariant else "compiled" if compile else "eager: no CUDA"
    print(f"target alone ({target.num_parameters() / 1e6:.1f}M, {args.dtype}, {kind}): "
          f"{comparison.alone_tokens_per_s:,.0f} tokens/s", flush=True)
    print(f"  decode alone, after the prefill and first token: {comparison.alone_decode_tokens_per_s:,.0f} tokens/s",
          flush=True)
    references = {}  # the target alone on engines without the invariance, for comparison
    if args.batch_invariant:
        kinds = {"compiled": {}, **({"megakernel": {"megakernel": True}} if device.type == "cuda" else {})}
        for name, options in kinds.items():
            _, references[name], decode = comparison.time_alone(Engine(target, compile=compile, **options))
            print(f"  the {name} target alone, for reference: {references[name]:,.0f} tokens/s (decode {decode:,.0f})",
                  flush=True)
    print(f"{'draft':<40} {'engine':<11} {'k':>2} {'tok/s':>7} {'speed-up':>8} {'decode':>7} {'speed-up':>8} "
          f"{'accept':>7} {'tok/round':>9} {'ms/round':>8} {'graph':>5} {'identical':>9}", flush=True)
    engines = [(path, kind, Engine(build_model([], path, device, dtype)[0], compile=compile,
                                   megakernel=kind == "megakernel"))
               for path in args.drafts for kind in args.draft_engines]
    rows, skipped = [], []
    for k in args.k:  # outermost: each k reshapes the target's caches and step, compiled once per k
        for path, kind, engine in engines:
            if args.budget_s is not None and time.perf_counter() - began > args.budget_s:
                skipped.append(f"{path} {kind} k={k}")
                continue
            row = {"draft": path, "draft_engine": kind, **comparison.measure(engine, k)}
            rows.append(row)
            margins = ", ".join(f"{d['at']} ({d['target_margin']:.3f})" for d in row["divergences"])
            print(f"{path[-40:]:<40} {kind:<11} {k:>2} {row['speculative_tokens_per_s']:>7,.0f} "
                  f"{row['speedup']:>7.2f}x {row['speculative_decode_tokens_per_s']:>7,.0f} {row['decode_speedup']:>7.2f}x "
                  f"{row['acceptance_rate']:>7.0%} {row['tokens_per_round']:>9.2f} "
                  f"{row['ms_per_round']:>8.3f} {'yes' if row['round_graph'] else 'no':>5} "
                  f"{row['identical_outputs']:>4}/{row['prompts']}" + (f"  first differences: {margins}" if margins else ""),
                  flush=True)
            for name, reference in references.items():
                row[f"speedup_over_{name}_alone"] = row["speculative_tokens_per_s"] / reference
                print(f"{'':<40} against the {name} target alone: {row[f'speedup_over_{name}_alone']:.2f}x", flush=True)
    if skipped:
        print(f"skipped after the {args.budget_s:.0f} s budget: {'; '.join(skipped)}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                         "torch": torch.__version__, "dtype": args.dtype, "target": args.target,
                                         "batch_invariant": args.batch_invariant,
                                         "target_alone_tokens_per_s": comparison.alone_tokens_per_s,
                                         **{f"{name}_target_alone_tokens_per_s": tokens_per_s
                                            for name, tokens_per_s in references.items()},
                                         "rows": rows, "skipped": skipped}, indent=2))


if __name__ == "__main__":
    main()
