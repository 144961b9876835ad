"""Verifiers and rewards (registry `reward`): `reward(response, ground_truth)` returns a dict of named
components, "reward" among them, the shape `compute_group_normalized_rewards` reads.

    reward = REWARDS.build("r1_zero")
    reward("<think>2+2 is 4</think> <answer>4</answer>", "4")
    # {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}

Math answers are compared by math-verify (`pip install 'lmlab[alignment]'`): LaTeX, fractions,
decimals, percentages and sets are parsed and checked for equivalence, not compared as strings.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from lmlab.registry import Registry

REWARDS = Registry("reward", group="reward", doc="verifiers and rewards of responses: math, format, language")

# DeepSeek-R1-Zero's template: the reasoning in <think>, then the answer in <answer>.
R1_ZERO_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>(.*?)</answer>", re.DOTALL)


def answer_tag(response: str) -> str | None:
    """The text inside the last <answer>...</answer> pair, if any."""
    found = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
    return found[-1].strip() if found else None


def math_equal(answer: str, ground_truth: str) -> bool:
    """Whether two math answers are equivalent: math-verify parses each, as written and as LaTeX inside
    $...$ (sets such as \\{1, 2\\} parse only so), and compares the values."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("reward=math and reward=r1_zero need math-verify: pip install 'lmlab[alignment]'") from None

    def forms(text: str) -> tuple[str, str]:
        return text, text if "$" in text else f"${text}$"

    return any(verify(parse(gold), parse(given)) for gold, given in zip(forms(ground_truth), forms(answer)))


class Reward:
    """Base of the entries: `reward(response, ground_truth)` -> {"reward": ..., other components}."""

    def __init__(self, cfg=None):
        self.cfg = cfg

    def __call__(self, response: str, ground_truth: str) -> dict[str, float]:
        raise NotImplementedError


@REWARDS.register("exact_match")
class ExactMatch(Reward):
    """1 when the answer (inside <answer> if present, else the whole response) equals the ground truth,
    whitespace stripped."""

    @dataclass
    class Config:
        ignore_case: bool = False

    def __call__(self, response: str, ground_truth: str) -> dict[str, float]:
        answer, truth = (answer_tag(response) or response).strip(), ground_truth.strip()
        if self.cfg.ignore_case:
            answer, truth = answer.casefold(), truth.casefold()
        return {"reward": float(answer == truth)}


@REWARDS.register("math")
class MathAnswer(Reward):
    """1 when the answer (inside <answer> if present, else the whole response) is mathematically equal to
    the ground truth."""

    def __call__(self, response: str, ground_truth: str) -> dict[str, float]:
        return {"reward": float(math_equal(answer_tag(response) or response, ground_truth))}


@REWARDS.register("r1_zero")
class R1Zero(Reward):
    """The R1-Zero reward: format (the response is "<think>...</think> <answer>...</answer>") and answer
    (math-equal to the ground truth); the reward is the answer's, and 0 without the format."""

    def __call__(self, response: str, ground_truth: str) -> dict[str, float]:
        match = R1_ZERO_FORMAT.search(response)
        if match is None:
            return {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}
        correct = float(math_equal(match.group(1).strip(), ground_truth))
        return {"format_reward": 1.0, "answer_reward": correct, "reward": correct}


@REWARDS.register("format")
class Format(Reward):
    """1 when the response follows the R1-Zero template, whatever its answer."""

    def __call__(self, response: str, ground_truth: str) -> dict[str, float]:
        return {"reward": float(R1_ZERO_FORMAT.search(response) is not None)}


@REWARDS.register("language_consistency")
class LanguageConsistency(Reward):
    """The share of the response's letters written in one script (DeepSeek-R1's language-consistency
    reward, which keeps reasoning from switching languages): "LATIN", "CJK", "CYRILLIC", ... as the
    Unicode character names begin. A response without letters scores 0."""

    @dataclass
    class Config:
        script: str = "LATIN"

    def __call__(self, response: str, ground_truth: str = "") -> dict[str, float]:
        letters = [ch for ch in response if ch.isalpha()]
        if not letters:
            return {"reward": 0.0}
        inside = sum(unicodedata.name(ch, "").startswith(self.cfg.script.upper()) for ch in letters)
        return {"reward": inside / len(letters)}
