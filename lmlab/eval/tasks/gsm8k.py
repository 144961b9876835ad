"""GSM8K (Cobbe et al., 2021): few-shot chain-of-thought generation; the final number is parsed from the
completion (after `####`, else the last number) and compared as a number. With n samples per problem,
the unbiased pass@k estimator for each k <= n."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lmlab.errors import ConfigError
from lmlab.eval.answers import gsm8k_answer, gsm8k_reference, numbers_equal, pass_at_k
from lmlab.eval.datasets import check_gsm8k_source, load_gsm8k
from lmlab.eval.prompts import GSM8K_STOP, gsm8k_prompt
from lmlab.eval.registry import EVAL_TASKS, EvalTask, TaskResult, check_generation_room, truncation_notes
from lmlab.eval.scoring import Scorer
from lmlab.inference.samplers import SAMPLERS


@EVAL_TASKS.register("gsm8k")
class GSM8K(EvalTask):
    """GSM8K by generation: the final number parsed and compared; accuracy and pass@k."""

    @dataclass
    class Config:
        path: str | None = None  # the release's folder (train.jsonl, test.jsonl), or hf
        split: str = "test"
        shots: int = 5  # worked examples from the train split (the first ones)
        n: int = 1  # samples per problem
        k: list[int] = field(default_factory=lambda: [1])  # pass@k for each k (<= n)
        temperature: float = 0.0  # 0: greedy (with n > 1, set a temperature to get different samples)
        top_p: float = 1.0
        seed: int = 0
        max_new_tokens: int = 256

    def __init__(self, cfg: Config):
        self.check_settings(cfg)
        self.cfg = cfg
        self.sampler = SAMPLERS.build({"name": "top_p", "p": cfg.top_p, "temperature": cfg.temperature,
                                       "seed": cfg.seed})
        self.problems = load_gsm8k(cfg.path, cfg.split)
        shots = load_gsm8k(cfg.path, "train")[:cfg.shots] if cfg.shots else []
        if len(shots) < cfg.shots:
            raise ConfigError(f"eval.gsm8k.shots={cfg.shots}, but the train split has {len(shots)} problems")
        self.references = [gsm8k_reference(p.answer) for p in self.problems]
        self.prompts = [gsm8k_prompt(p, shots) for p in self.problems]

    @staticmethod
    def check_settings(cfg: Config) -> None:
        """The settings on their own, and that the data's files are there (none read)."""
        if cfg.path is None:
            raise ConfigError("eval=gsm8k needs eval.gsm8k.path: the GSM8K release's folder (train.jsonl, "
                              f"{cfg.split}.jsonl), or hf to download it")
        for name in ("n", "max_new_tokens"):
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"eval.gsm8k.{name} must be > 0, got {getattr(cfg, name)}")
        if cfg.shots < 0:
            raise ConfigError(f"eval.gsm8k.shots must be >= 0, got {cfg.shots}")
        if not cfg.k or any(not 0 < k <= cfg.n for k in cfg.k):
            raise ConfigError(f"eval.gsm8k.k={list(cfg.k)}: each k must be in 1..n (n={cfg.n})")
        check_gsm8k_source(cfg.path, [cfg.split, "train"] if cfg.shots else [cfg.split])

    @classmethod
    def check(cls, cfg: Config, max_len: int) -> None:
        cls.check_settings(cfg)
        check_generation_room("eval.gsm8k.max_new_tokens", cfg.max_new_tokens, max_len)

    def run(self, scorer: Scorer, limit: int | None) -> TaskResult:
        """`limit`: the first this many problems."""
        count = min(limit or len(self.problems), len(self.problems))
        n = self.cfg.n
        started = time.perf_counter()
        truncated = scorer.truncated
        encoded = [scorer.tokenizer.encode(p) for p in self.prompts[:count]]
        completions = scorer.generate([ids for ids in encoded for _ in range(n)], self.sampler,
                                      self.cfg.max_new_tokens, GSM8K_STOP, desc="gsm8k")
        parsed = [gsm8k_answer(c) for c in completions]
        records, solved = [], []
        for i in range(count):
            mine = range(i * n, (i + 1) * n)
            right = [numbers_equal(parsed[j], self.references[i]) for j in mine]
            solved.append(sum(right))
            records.append({"question": self.problems[i].question, "reference": str(self.references[i]),
                            "completions": [completions[j] for j in mine],
                            "parsed": [None if parsed[j] is None else str(parsed[j]) for j in mine],
                            "correct": right})
        metrics = {"exact_match": sum(solved) / (count * n), "unparsed": sum(p is None for p in parsed) / len(parsed)}
        metrics |= {f"pass@{k}": sum(pass_at_k(n, c, k) for c in solved) / count for k in self.cfg.k}
        return TaskResult("gsm8k", metrics, count, time.perf_counter() - started, records=records,
                          notes=truncation_notes(scorer.truncated - truncated))
