"""MMLU (Hendrycks et al., 2021): by log-likelihood of the answer letter, as a cloze over the options' own
text, and in a generative form whose answer letter is parsed from free text. Accuracy per subject, macro
(mean over subjects) and micro; the log-likelihood forms also length-normalised accuracy."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from lmlab.errors import ConfigError
from lmlab.eval.answers import choice_letter
from lmlab.eval.datasets import MMLU_LETTERS, MMLUQuestion, check_mmlu_source, load_mmlu
from lmlab.eval.prompts import (MMLU_CONTINUATIONS, MMLU_GENERATIVE_STOP, few_shot, mmlu_continuation_prompt,
                                mmlu_generative_prompt, mmlu_option_continuations, mmlu_prompt)
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
        self.check(cfg, task)
        self.by_subject = load_mmlu(cfg.path, cfg.split, cfg.subjects)
        dev = load_mmlu(cfg.path, "dev", list(self.by_subject)) if cfg.shots else {}
        shots = {subject: few_shot(dev, subject, cfg.shots) if cfg.shots else [] for subject in self.by_subject}
        self.prompt = lambda q: prompt(q, shots[q.subject])

    @staticmethod
    def check(cfg: MMLUConfig, task: str) -> None:
        """The settings on their own, and that the data's split folders are there (nothing read)."""
        if cfg.path is None:
            raise ConfigError(f"eval={task} needs eval.{task}.path: the MMLU release's folder (dev/ and {cfg.split}/ "
                              "of <subject>_<split>.csv files), or hf to download it")
        if cfg.shots < 0:
            raise ConfigError(f"eval.{task}.shots must be >= 0, got {cfg.shots}")
        check_mmlu_source(cfg.path, [cfg.split, "dev"] if cfg.shots else [cfg.split])

    def limited(self, limit: int | None) -> list[MMLUQuestion]:
        """The first `limit` questions of each subject (all without a limit)."""
        return [q for questions in self.by_subject.values() for q in questions[:limit]]


def accuracy_table(questions: list[MMLUQuestion],
                   correct: dict[str, list[bool]]) -> tuple[dict[str, float], list[dict]]:
    """For each metric of `correct` (name -> one bool per question): macro (the mean over subjects) and
    micro (`<name>_micro`) accuracy, and one row per subject."""
    rows: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        rows.setdefault(q.subject, []).append(i)
    table = [{"subject": s, "questions": len(idx),
              **{name: sum(ok[i] for i in idx) / len(idx) for name, ok in correct.items()}} for s, idx in rows.items()]
    metrics = {}
    for name, ok in correct.items():
        metrics[name] = sum(r[name] for r in table) / len(table)
        metrics[f"{name}_micro"] = sum(ok) / len(ok)
    return metrics, table


@EVAL_TASKS.register("mmlu")
class MMLU(EvalTask):
    """MMLU by the log-likelihood of each answer letter after the question (0- or k-shot)."""

    task = "mmlu"
    prompt = staticmethod(mmlu_prompt)

    @dataclass
    class Config(MMLUConfig):
        pass

    def __init__(self, cfg: MMLUConfig):
        self.data = MMLUQuestions(cfg, self.task, self.prompt)

    @classmethod
    def check(cls, cfg: MMLUConfig, max_len: int) -> None:
        MMLUQuestions.check(cfg, cls.task)

    @staticmethod
    def continuations(question: MMLUQuestion) -> tuple[str, ...]:
        return MMLU_CONTINUATIONS

    def run(self, scorer: Scorer, limit: int | None) -> TaskResult:
        """`limit`: questions per subject. The choice of highest log-likelihood is `predicted`; of highest
        log-likelihood per character (the harness's acc_norm), `predicted_norm`."""
        questions = self.data.limited(limit)
        started = time.perf_counter()
        encode = scorer.tokenizer.encode
        options = [self.continuations(q) for q in questions]
        requests = []
        for q, texts in zip(questions, options):
            prompt = encode(self.data.prompt(q))
            requests += [(prompt, encode(text)) for text in texts]
        truncated = scorer.truncated
        scored = 0  # options; the bar counts whole questions (a fraction reads "64.0/285" in a log)

        def progress(n: int) -> None:
            nonlocal scored
            scored += n
            bar.update(scored // len(MMLU_LETTERS) - bar.n)

        with tqdm(total=len(questions), desc=self.task, unit="q") as bar:
            scores = iter(scorer.loglikelihoods(requests, progress=progress))
        correct, correct_norm, records = [], [], []
        for q, texts in zip(questions, options):
            logprobs = [next(scores).logprob for _ in texts]
            best = MMLU_LETTERS[max(range(len(texts)), key=logprobs.__getitem__)]
            best_norm = MMLU_LETTERS[max(range(len(texts)), key=lambda i: logprobs[i] / len(texts[i]))]
            correct.append(best == q.answer)
            correct_norm.append(best_norm == q.answer)
            records.append({"subject": q.subject, "question": q.question, "answer": q.answer, "predicted": best,
                            "predicted_norm": best_norm, "logprobs": logprobs, "correct": correct[-1],
                            "correct_norm": correct_norm[-1]})
        metrics, table = accuracy_table(questions, {"acc": correct, "acc_norm": correct_norm})
        return TaskResult(self.task, metrics, len(questions), time.perf_counter() - started, table, records,
                          truncation_notes(scorer.truncated - truncated))


@EVAL_TASKS.register("mmlu_continuation")
class MMLUContinuation(MMLU):
    """MMLU as a cloze (the harness's `mmlu_continuation`): no lettered options, each option's text scored
    after "Answer:". Small models rank answers above chance this way long before they can map a letter to
    an option; options differ in length, so acc_norm matters here."""

    task = "mmlu_continuation"
    prompt = staticmethod(mmlu_continuation_prompt)
    continuations = staticmethod(mmlu_option_continuations)

    @dataclass
    class Config(MMLUConfig):
        pass


@EVAL_TASKS.register("mmlu_generative")
class MMLUGenerative(EvalTask):
    """MMLU answered in free text, its letter parsed ("The correct answer is B"); unparsed answers count wrong."""

    @dataclass
    class Config(MMLUConfig):
        max_new_tokens: int = 32

    def __init__(self, cfg: Config):
        self.check_tokens(cfg)
        self.cfg = cfg
        self.data = MMLUQuestions(cfg, "mmlu_generative", mmlu_generative_prompt)

    @staticmethod
    def check_tokens(cfg: Config) -> None:
        if cfg.max_new_tokens <= 0:
            raise ConfigError(f"eval.mmlu_generative.max_new_tokens must be > 0, got {cfg.max_new_tokens}")

    @classmethod
    def check(cls, cfg: Config, max_len: int) -> None:
        cls.check_tokens(cfg)
        MMLUQuestions.check(cfg, "mmlu_generative")
        check_generation_room("eval.mmlu_generative.max_new_tokens", cfg.max_new_tokens, max_len)

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
        metrics, table = accuracy_table(questions, {"acc": correct})
        metrics["unparsed"] = sum(p is None for p in parsed) / len(parsed)
        return TaskResult("mmlu_generative", metrics, len(questions), time.perf_counter() - started, table, records,
                          truncation_notes(scorer.truncated - truncated))
