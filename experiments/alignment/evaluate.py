"""Held-out accuracy of a checkpoint on prompt/answer JSONL (greedy by default), as lmlab's RL stages score
rollouts; with --samples N --temperature T --pairs FILE it also writes DPO pairs from its own samples
(a correct response chosen over an incorrect one to the same prompt).

    python experiments/alignment/evaluate.py CKPT DATA.jsonl --json OUT.json [--samples 4 --temperature 1 --pairs P.jsonl]
        [--stop '</answer>']
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from lmlab.alignment.chat import CHAT_TEMPLATES, Turn
from lmlab.alignment.grpo import rollout
from lmlab.alignment.tasks.rl import read_prompts_jsonl
from lmlab.alignment.verifiers import REWARDS
from lmlab.inference.engine import Engine
from lmlab.inference.samplers import SAMPLERS
from lmlab.training.checkpoints import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("data", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--stop", action="append", default=[],
                        help="a stop string besides the template's end of turn (repeatable), as the RL run's task.stop")
    parser.add_argument("--batch", type=int, default=512, help="responses generated together")
    parser.add_argument("--pairs", type=Path, help="write DPO pairs from the samples here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, _ = load(args.ckpt, device)
    template, reward = CHAT_TEMPLATES.build("plain"), REWARDS.build("exact_match")
    sampler = SAMPLERS.build({"name": "temperature", "temperature": args.temperature} if args.temperature > 0
                             else "greedy")
    items = read_prompts_jsonl(args.data, "prompt", "answer")
    engine, per_batch = Engine(model, cuda_graphs=True), max(1, args.batch // args.samples)  # as the RL rollouts
    texts, rewards, tokens, start = [], [], 0, time.perf_counter()
    for i in range(0, len(items), per_batch):
        chunk = items[i:i + per_batch]
        prompts = [template.render([Turn("user", q)], add_generation_prompt=True) for q, _ in chunk]
        batch = rollout(model, tokenizer, prompts, [a for _, a in chunk], reward, args.samples, sampler,
                        args.max_new_tokens, [template.stop, *args.stop], normalize_by_std=False, engine=engine)
        texts += batch.texts
        rewards += batch.raw_rewards.tolist()
        tokens += int(batch.tensors["response_mask"].sum())
    seconds = time.perf_counter() - start
    correct = [r > 0 for r in rewards]
    result = {"ckpt": args.ckpt, "data": str(args.data), "problems": len(items), "samples": args.samples,
              "temperature": args.temperature, "stop": args.stop, "batch": args.batch, "accuracy": sum(correct) / len(correct),
              # pass@N: the prompts with at least one correct sample among N, what RL can sharpen toward
              f"pass@{args.samples}": sum(any(correct[k * args.samples:(k + 1) * args.samples])
                                          for k in range(len(items))) / len(items),
              "response_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if args.pairs:
        rng, pairs = random.Random(args.seed), []
        for k, (question, answer) in enumerate(items):
            group = range(k * args.samples, (k + 1) * args.samples)
            good = [texts[j].strip() for j in group if correct[j]]
            bad = [texts[j].strip() for j in group if not correct[j]]
            if good and bad:
                pairs.append({"prompt": question, "chosen": rng.choice(good), "rejected": rng.choice(bad)})
        args.pairs.write_text("".join(json.dumps(p) + "\n" for p in pairs))
        result["pairs"] = len(pairs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
