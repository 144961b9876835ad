"""The standard prompt formats of MMLU and GSM8K, as lm-evaluation-harness writes them.

MMLU (Hendrycks et al., 2021; the harness's `mmlu` task): a header naming the subject, the k shots of the
same subject's dev split each followed by "Answer: X", then the question ending in "Answer:"; the model is
scored on the continuations " A" to " D". Its cloze form (the harness's `mmlu_continuation`): no lettered
options, "Question: ...\\nAnswer:", and each option's own text as the continuation. GSM8K (the harness's
`gsm8k` task): "Question: ...\\nAnswer: <worked solution ending '#### N'>" shots, then the question; the
model writes its own solution.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lmlab.errors import ConfigError
from lmlab.eval.datasets import MMLU_LETTERS, GSM8KProblem, MMLUQuestion

# The letter follows "Answer:" after a space, so the space belongs to the scored continuation (as in the harness).
MMLU_CONTINUATIONS = tuple(f" {letter}" for letter in MMLU_LETTERS)
# Asked of the model after the last question of the generative variant (see `mmlu_generative_prompt`).
MMLU_GENERATIVE_INSTRUCTION = "Answer with the letter of the correct option."
# The generative variant's answer ends at a blank line (the harness stops at "\n", which would cut off a model
# that starts its free-text answer on the next line; the letter parser reads the rest).
MMLU_GENERATIVE_STOP = ("\n\n",)
# GSM8K generation stops where the model starts a next question, or writes a chat model's end marker as text
# (the harness's gsm8k v3 `until`); a solution may hold blank lines, so "\n\n" is no stop.
GSM8K_STOP = ("Question:", "</s>", "<|im_end|>")


def few_shot(dev: Mapping[str, Sequence[MMLUQuestion]], subject: str, k: int) -> list[MMLUQuestion]:
    """The first `k` dev questions of `subject`: the standard k-shot examples (the harness's `first_n` sampler)."""
    available = len(dev.get(subject, ()))
    if not 0 <= k <= available:
        raise ConfigError(f"{k}-shot MMLU needs {k} dev questions of '{subject}', but the dev split has {available}; "
                          f"use a few-shot count from 0 to {available}")
    return list(dev.get(subject, ())[:k])


def _mmlu_header(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def _mmlu_block(question: MMLUQuestion) -> str:
    # The harness strips the question (about 7% of MMLU's have stray spaces or newlines at either end), not the choices.
    options = "".join(f"\n{letter}. {choice}" for letter, choice in zip(MMLU_LETTERS, question.choices))
    return f"{question.question.strip()}{options}\n"


def _mmlu_shots(shots: Sequence[MMLUQuestion]) -> str:
    return "".join(f"{_mmlu_block(shot)}Answer: {shot.answer}\n\n" for shot in shots)


def mmlu_prompt(question: MMLUQuestion, shots: Sequence[MMLUQuestion]) -> str:
    """The log-likelihood prompt, ending in "Answer:"; score each of `MMLU_CONTINUATIONS` after it."""
    return f"{_mmlu_header(question.subject)}{_mmlu_shots(shots)}{_mmlu_block(question)}Answer:"


def mmlu_continuation_prompt(question: MMLUQuestion, shots: Sequence[MMLUQuestion]) -> str:
    """The cloze prompt, ending in "Answer:"; score `mmlu_option_continuations(question)` after it. Each shot
    is answered by the text of its correct option."""
    worked = "".join(f"Question: {shot.question.strip()}\nAnswer: {shot.choices[MMLU_LETTERS.index(shot.answer)]}\n\n"
                     for shot in shots)
    header = f"The following are questions (with answers) about {question.subject.replace('_', ' ')}.\n\n"
    return f"{header}{worked}Question: {question.question.strip()}\nAnswer:"


def mmlu_option_continuations(question: MMLUQuestion) -> tuple[str, ...]:
    """The cloze form's continuations: each option's text after a space."""
    return tuple(f" {choice}" for choice in question.choices)


def mmlu_generative_prompt(question: MMLUQuestion, shots: Sequence[MMLUQuestion]) -> str:
    """The free-text prompt: the shots as in `mmlu_prompt` (each answered "Answer: X", as in the harness's
    `mmlu_generative`), then the question with `MMLU_GENERATIVE_INSTRUCTION` before its "Answer:", so that a
    0-shot model also knows what to write. The answer letter is parsed from the completion."""
    return (f"{_mmlu_header(question.subject)}{_mmlu_shots(shots)}{_mmlu_block(question)}"
            f"{MMLU_GENERATIVE_INSTRUCTION}\nAnswer:")


def gsm8k_prompt(problem: GSM8KProblem, shots: Sequence[GSM8KProblem]) -> str:
    """The chain-of-thought prompt: each shot's worked solution (ending "#### N"), then the problem after "Answer:".

    The standard shots are the first k problems of the train split (the harness samples k of them at random)."""
    worked = "".join(f"Question: {shot.question}\nAnswer: {shot.answer}\n\n" for shot in shots)
    return f"{worked}Question: {problem.question}\nAnswer:"
