"""MMLU (Hendrycks et al., 2021): by log-likelihood of the answer letter, and in a generative form whose
answer letter is parsed from free text. Accuracy per subject, macro (mean over subjects) and micro."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from lmlab.errors import ConfigError
from lmlab.eval.answers import choice_letter
from lmlab.eval.datasets import MMLU_LETTERS, MMLUQuestion, load_mmlu
from lmlab.eval.prompts import (MMLU_CONTINUATIONS, MMLU_GENERATIVE_STOP, few_shot, mmlu_generative_prompt,
                                mmlu_prompt)
from lmlab.eval.registry import EVAL_TASKS, EvalTask, TaskResult, check_generation_room, truncation_notes
from lmlab.eval.scoring import Scorer
from lmlab.inference.samplers import SAMPLERS


@dataclass
class MMLUConfig:
    path: str | None = None  # the release's folder (dev/, val/, test/ of <subject>_<split>.csv), or hf
    split: str = "test"
    shots: int = 5  # examples from the dev split of the question's subject
    subjects: list[str] | None = None  # None: all


class MMLUQuestions:
    """The chosen split's questions and each one's prompt, read and checked when the task is built."""

    def __init__(self, cfg: MMLUConfig, task: str, prompt):
        if cfg.path is None:
            raise ConfigError(f"eval={task} needs eval.{task}.path: the MMLU release's folder (dev/ and {cfg.split}/ "
                              "of <subject>_<split>.csv files), or hf to download it")
        if cfg.shots < 0:
            raise ConfigError(f"eval.{task}.shots must be >= 0, got {cfg.shots}")
        self.by_subject = load_mmlu(cfg.path, cfg.split, cfg.subjects)
        dev = load_mmlu(cfg.path, "dev", list(self.by_subject)) if cfg.shots else {}
        shots = {subject: few_shot(dev, subject, cfg.shots) if cfg.shots else [] for subject in self.by_subject}
        self.prompt = lambda q: prompt(q, shots[q.subject])

    def limited(self, limit: int | None) -> list[MMLUQuestion]:
        """The first `limit` questions of each subject (all without a limit)."""
        return [q for questions in self.by_subject.values() for q in questions[:limit]]


def accuracy_table(questions: list[MMLUQuestion], correct: list[bool]) -> tuple[dict[str, float], list[dict]]:
    """Macro and micro accuracy, and one row per subject."""
    rows: dict[str, list[bool]] = {}
    for q, ok in zip(questions, correct):
        rows.setdefault(q.subject, []).append(ok)
    table = [{"subject": s, "questions": len(v), "acc": sum(v) / len(v)} for s, v in rows.items()]
    metrics = {"acc": sum(r["acc"] for r in table) / len(table), "acc_micro": sum(correct) / len(correct)}
    return metrics, table


@EVAL_TASKS.register("mmlu")
class MMLU(EvalTask):
    """MMLU by the log-likelihood of each answer letter after the question (0- or k-shot)."""

    @dataclass
    class Config(MMLUConfig):
        pass

    def __init__(self, cfg: Config):
        self.data = MMLUQuestions(cfg, "mmlu", mmlu_prompt)

    def run(self, scorer: Scorer, limit: int | None) -> TaskResult:
        """`limit`: questions per subject."""
        questions = self.data.limited(limit)
        started = time.perf_counter()
        encode = scorer.tokenizer.encode
        letters = [encode(c) for c in MMLU_CONTINUATIONS]
        requests = [(encode(self.data.prompt(q)), letter) for q in questions for letter in letters]
        truncated = scorer.truncated
        with tqdm(total=len(questions), desc="mmlu", unit="q") as bar:
            scores = scorer.loglikelihoods(requests, progress=lambda n: bar.update(n / len(letters)))
        correct, records = [], []
        for i, q in enumerate(questions):
            logprobs = [s.logprob for s in scores[4 * i:4 * i + 4]]
            predicted = MMLU_LETTERS[max(range(4), key=logprobs.__getitem__)]
            correct.append(predicted == q.answer)
            records.append({"subject": q.subject, "question": q.question, "answer": q.answer,
                            "predicted": predicted, "logprobs": logprobs, "correct": predicted == q.answer})
        metrics, table = accuracy_table(questions, correct)
        return TaskResult("mmlu", metrics, len(questions), time.perf_counter() - started, table, records,
                          truncation_notes(scorer.truncated - truncated))


@EVAL_TASKS.register("mmlu_generative")
class MMLUGenerative(EvalTask):
    """MMLU answered in free text, its letter parsed ("The correct answer is B"); unparsed answers count wrong."""

    @dataclass
    class Config(MMLUConfig):
        max_new_tokens: int = 32

    def __init__(self, cfg: Config):
        if cfg.max_new_tokens <= 0:
            raise ConfigError(f"eval.mmlu_generative.max_new_tokens must be > 0, got {cfg.max_new_tokens}")
        self.cfg = cfg
        self.data = MMLUQuestions(cfg, "mmlu_generative", mmlu_generative_prompt)

    def check(self, max_len: int) -> None:
        check_generation_room("eval.mmlu_generative.max_new_tokens", self.cfg.max_new_tokens, max_len)

    def run(self, scorer: Scorer, limit: int | None) -> TaskResult:
        """`limit`: questions per subject."""
        questions = self.data.limited(limit)
        started = time.perf_counter()
        prompts = [self.data.prompt(q) for q in questions]
        truncated = scorer.truncated
        completions = scorer.generate([scorer.tokenizer.encode(p) for p in prompts], SAMPLERS.build("greedy"),
                                      self.cfg.max_new_tokens, stop_strings=MMLU_GENERATIVE_STOP, desc="mmlu_generative")
        parsed = [choice_letter(c) for c in completions]
        correct = [p == q.answer for p, q in zip(parsed, questions)]
        records = [{"subject": q.subject, "prompt": prompt, "completion": c, "answer": q.answer, "parsed": p,
                    "correct": ok} for q, prompt, c, p, ok in zip(questions, prompts, completions, parsed, correct)]
        metrics, table = accuracy_table(questions, correct)
        metrics["unparsed"] = sum(p is None for p in parsed) / len(parsed)
        return TaskResult("mmlu_generative", metrics, len(questions), time.perf_counter() - started, table, records,
                          truncation_notes(scorer.truncated - truncated))
