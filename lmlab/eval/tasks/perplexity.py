"""Perplexity and bits per byte of a text, with sliding windows over texts longer than the context."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from lmlab.errors import ConfigError
from lmlab.eval.registry import EVAL_TASKS, EvalTask, TaskResult
from lmlab.eval.scoring import Scorer


@EVAL_TASKS.register("perplexity")
class Perplexity(EvalTask):
    """Perplexity and bits per byte of a text file, or of the checkpoint's own validation split."""

    @dataclass
    class Config:
        path: str | None = None  # a UTF-8 text file; None: the validation split of the checkpoint's training data
        stride: int | None = None  # tokens between window starts; None: half the model's context

    def __init__(self, cfg: Config):
        self.check_settings(cfg)
        self.cfg = cfg

    @staticmethod
    def check_settings(cfg: Config) -> None:
        if cfg.path is not None and not Path(cfg.path).is_file():
            raise ConfigError(f"eval.perplexity.path={cfg.path} is not a file")
        if cfg.stride is not None and cfg.stride <= 0:
            raise ConfigError(f"eval.perplexity.stride must be > 0, got {cfg.stride}")

    @classmethod
    def check(cls, cfg: Config, max_len: int) -> None:
        cls.check_settings(cfg)

    def run(self, scorer: Scorer, limit: int | None) -> TaskResult:
        """`limit`: score at most this many blocks of the model's context (the text's first)."""
        if self.cfg.path is not None:
            tokens = scorer.tokenizer.encode(Path(self.cfg.path).read_text(encoding="utf-8"))
            what = self.cfg.path
        elif scorer.validation is not None:
            tokens = list(map(int, scorer.validation()))
            what = "the checkpoint's validation split"
        else:
            raise ConfigError("eval=perplexity needs eval.perplexity.path=FILE: this model names no training data")
        tokens = tokens[:limit * scorer.max_len + 1] if limit else tokens
        if len(tokens) < 2:
            raise ConfigError(f"{what} has {len(tokens)} tokens; perplexity needs at least 2")
        started = time.perf_counter()
        nll, count = scorer.rolling_nll(tokens, self.cfg.stride)
        text_bytes = scorer.tokenizer.text_bytes(tokens[1:])  # the scored tokens' text, as val/bpb counts it
        metrics = {"nll": nll / count, "ppl": math.exp(nll / count), "bpb": nll / math.log(2) / max(text_bytes, 1),
                   "tokens": count}
        return TaskResult("perplexity", metrics, examples=count, seconds=time.perf_counter() - started,
                          notes=[f"scored {count:,} tokens of {what}"], unit="tokens")
