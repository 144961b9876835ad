"""Multi-step arithmetic for the alignment experiment: a pre-training corpus of worked solutions, SFT chat
examples, and held-out prompt/answer pairs for RL and evaluation (no problem appears in two sets).

    python experiments/alignment/make_data.py OUT_DIR [--seed 0] [--corpus 40000] [--sft 4000] [--rl 4000]

A problem is "a op b op c" (op in + - *) with operands 1..max; a solution evaluates the multiplications
first, then left to right, one step per sentence, and ends with <answer>N</answer>.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def problem(rng: random.Random, max_operand: int, n_ops: int) -> tuple[str, list[str], int]:
    """(question, solution steps, answer)."""
    values = [rng.randint(1, max_operand) for _ in range(n_ops + 1)]
    ops = [rng.choice("+-*") for _ in range(n_ops)]
    question = " ".join(f"{v} {o}" for v, o in zip(values, ops)) + f" {values[-1]}"
    steps = []
    for stage in ("*", "+-"):  # precedence: products first, then sums and differences left to right
        i = 0
        while i < len(ops):
            if ops[i] in stage:
                result = OPS[ops[i]](values[i], values[i + 1])
                steps.append(f"{values[i]} {ops[i]} {values[i + 1]} = {result}.")
                values[i:i + 2], ops[i:i + 1] = [result], []
            else:
                i += 1
    return question, steps, values[0]


def solution(steps: list[str], answer: int) -> str:
    return " ".join(steps) + f" <answer>{answer}</answer>"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--corpus", type=int, default=40000, help="worked problems in the pre-training corpus")
    parser.add_argument("--sft", type=int, default=4000, help="SFT chat examples")
    parser.add_argument("--rl", type=int, default=4000, help="RL prompts (the stage holds out its val_fraction)")
    parser.add_argument("--test", type=int, default=500, help="held-out test prompts")
    args = parser.parse_args()
    rng, seen = random.Random(args.seed), set()

    def fresh(n: int):
        made = []
        while len(made) < n:
            q, steps, answer = problem(rng, args.max_operand, rng.choice((2, 3)))
            if q not in seen:
                seen.add(q)
                made.append((q, steps, answer))
        return made

    args.out.mkdir(parents=True, exist_ok=True)
    # The corpus writes solutions in its own "Q:/A:" form; SFT teaches the chat template and the answer tag.
    corpus = [f"Q: {q}\nA: {' '.join(steps)} The answer is {a}.\n" for q, steps, a in fresh(args.corpus)]
    (args.out / "corpus.txt").write_text("\n".join(corpus), encoding="utf-8")
    with (args.out / "sft.jsonl").open("w") as f:
        for q, steps, a in fresh(args.sft):
            f.write(json.dumps({"turns": [{"role": "user", "content": q},
                                          {"role": "assistant", "content": solution(steps, a)}]}) + "\n")
    for name, n in (("rl.jsonl", args.rl), ("test.jsonl", args.test)):
        with (args.out / name).open("w") as f:
            for q, _, a in fresh(n):
                f.write(json.dumps({"prompt": q, "answer": str(a)}) + "\n")
    print(f"{args.out}: corpus {args.corpus} problems ({sum(map(len, corpus)):,} characters), sft {args.sft}, "
          f"rl {args.rl}, test {args.test}")


if __name__ == "__main__":
    main()
