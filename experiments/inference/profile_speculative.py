"""Where a speculative round's time goes: each part of `speculative_generate` timed alone, then the whole.

    python experiments/inference/profile_speculative.py TARGET_CKPT DRAFT_CKPT [--k 4] [--prompts 4]

On trained checkpoints (bf16 on CUDA, compiled engines with CUDA graphs, as `lmlab bench generate --draft`
runs them), after a warm-up generation: the median wall time, synced, of the target's one-token step, its
(k+1)-token verification step, the draft's one-token step, the sampler's probabilities and argmax for one
draft token, and the acceptance test; then greedy generation alone and speculative, with the rounds and
tokens per round, and the cost of a round those parts predict against the measured one. A profile of one
speculative generation (host and GPU time by op) follows, so a gap between the two shows where it lies.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lmlab.inference.bench import build_model
from lmlab.inference.bench_checkpoint import CheckpointData
from lmlab.inference.engine import Engine
from lmlab.inference.samplers import SAMPLERS
from lmlab.inference.speculative import accept_and_correct, speculative_generate
from lmlab.timing import sync


def timed(fn, repeats: int = 50) -> float:
    """Median seconds of fn() with the GPU synced before and after."""
    times = []
    for _ in range(repeats + 5):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new", type=int, default=256)
    args = parser.parse_args()
    device, k = torch.device("cuda" if torch.cuda.is_available() else "cpu"), args.k
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the CPU: a check of the script
    target, _ = build_model([], args.target, device, dtype)
    draft, _ = build_model([], args.draft, device, dtype)
    prompts = CheckpointData(args.target).prompts(args.prompts, 128)
    alone, target_engine, draft_engine = Engine(target, True), Engine(target, True), Engine(draft, True)
    speculative_generate(target_engine, draft_engine, prompts[0], k=k, max_new_tokens=args.new)  # compiles, captures
    alone.generate([prompts[0]], max_new_tokens=args.new)

    # the parts, on the caches as the warm-up left them (slots 300-ish of 384+)
    sampler = SAMPLERS.build("greedy")
    one, verify = torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, k + 1, dtype=torch.long, device=device)
    slot = target_engine.next_slot - k - 1
    draft_slot = draft_engine.next_slot - 1

    def target_verify():
        target_engine.next_slot = slot
        return target_engine.decode(verify)

    def draft_step():
        draft_engine.next_slot = draft_slot
        return draft_engine.decode(one)

    def target_step():
        target_engine.next_slot = slot
        return target_engine.decode(one)

    logits = draft_step()
    p = sampler.probs(target_verify()[0])
    q = sampler.probs(logits.expand(k, -1))
    drafts = q.argmax(-1)
    parts = {"target one-token step": timed(target_step), f"target {k + 1}-token verification": timed(target_verify),
             "draft one-token step": timed(draft_step),
             "sampler probs + argmax (one draft token)": timed(lambda: sampler.probs(logits).argmax(-1)),
             "acceptance test": timed(lambda: accept_and_correct(p, q, drafts))}
    for name, seconds in parts.items():
        print(f"{name:<42} {seconds * 1e3:8.3f} ms", flush=True)

    runs = {}
    for name, run in (("alone", lambda p: alone.generate([p], max_new_tokens=args.new)),
                      ("speculative", lambda p: speculative_generate(target_engine, draft_engine, p, k=k,
                                                                     max_new_tokens=args.new))):
        seconds, tokens, rounds = 0.0, 0, 0
        for prompt in prompts:
            sync()
            start = time.perf_counter()
            out = run(prompt)
            sync()
            seconds += time.perf_counter() - start
            tokens += len(out.tokens[0])
            rounds += out.extra.get("rounds", 0)
        runs[name] = {"seconds": seconds, "tokens": tokens, "rounds": rounds}
        per_round = (f", {rounds} rounds, {tokens / rounds:.2f} tokens a round, {seconds / rounds * 1e3:.3f} ms a round"
                     if rounds else "")
        print(f"{name:<12} {tokens / seconds:8,.0f} tokens/s{per_round}", flush=True)
    spec = runs["speculative"]
    predicted = (parts[f"target {k + 1}-token verification"] + parts["acceptance test"]
                 + k * (parts["draft one-token step"] + parts["sampler probs + argmax (one draft token)"]))
    print(f"a round from the parts: {predicted * 1e3:.3f} ms (k draft steps, a verification, the test) against "
          f"{spec['seconds'] / max(spec['rounds'], 1) * 1e3:.3f} ms measured", flush=True)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        speculative_generate(target_engine, draft_engine, prompts[-1], k=k, max_new_tokens=args.new)
        sync()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
