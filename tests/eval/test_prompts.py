from pathlib import Path

import pytest

from lmlab.errors import ConfigError
from lmlab.eval.datasets import GSM8KProblem, MMLUQuestion, read_gsm8k, read_mmlu
from lmlab.eval.prompts import (GSM8K_STOP, MMLU_CONTINUATIONS, few_shot, gsm8k_prompt, mmlu_continuation_prompt,
                                mmlu_generative_prompt, mmlu_option_continuations, mmlu_prompt)

FIXTURES = Path(__file__).parent / "fixtures"
SHOT = MMLUQuestion("high_school_geography", "Which river flows through Cairo?",
                    ("The Amazon", "The Nile", "The Danube", "The Ganges"), "B")
# The stray spaces and newline around the question are stripped, as in the harness.
QUESTION = MMLUQuestion("high_school_geography", "  Which continent has the most countries?\n",
                        ("Asia", "Europe", "Africa", "South America"), "C")


def test_mmlu_prompt_is_the_standard_format():
    assert mmlu_prompt(QUESTION, [SHOT]) == (
        "The following are multiple choice questions (with answers) about high school geography.\n\n"
        "Which river flows through Cairo?\nA. The Amazon\nB. The Nile\nC. The Danube\nD. The Ganges\nAnswer: B\n\n"
        "Which continent has the most countries?\nA. Asia\nB. Europe\nC. Africa\nD. South America\nAnswer:")
    assert MMLU_CONTINUATIONS == (" A", " B", " C", " D")


def test_mmlu_zero_shot_prompt_is_the_header_and_the_question():
    assert mmlu_prompt(QUESTION, []) == (
        "The following are multiple choice questions (with answers) about high school geography.\n\n"
        "Which continent has the most countries?\nA. Asia\nB. Europe\nC. Africa\nD. South America\nAnswer:")


def test_mmlu_continuation_prompt_answers_shots_with_the_option_text_and_lists_no_options():
    assert mmlu_continuation_prompt(QUESTION, [SHOT]) == (
        "The following are questions (with answers) about high school geography.\n\n"
        "Question: Which river flows through Cairo?\nAnswer: The Nile\n\n"
        "Question: Which continent has the most countries?\nAnswer:")
    assert mmlu_option_continuations(QUESTION) == (" Asia", " Europe", " Africa", " South America")


def test_mmlu_generative_prompt_asks_for_the_letter_after_the_shots():
    assert mmlu_generative_prompt(QUESTION, [SHOT]) == (
        "The following are multiple choice questions (with answers) about high school geography.\n\n"
        "Which river flows through Cairo?\nA. The Amazon\nB. The Nile\nC. The Danube\nD. The Ganges\nAnswer: B\n\n"
        "Which continent has the most countries?\nA. Asia\nB. Europe\nC. Africa\nD. South America\n"
        "Answer with the letter of the correct option.\nAnswer:")


def test_few_shot_takes_the_first_k_dev_questions_of_the_subject():
    dev = read_mmlu(FIXTURES / "mmlu", "dev")
    shots = few_shot(dev, "abstract_algebra", 2)
    assert shots == dev["abstract_algebra"][:2] and few_shot(dev, "abstract_algebra", 0) == []
    question = read_mmlu(FIXTURES / "mmlu", "test")["abstract_algebra"][0]
    assert mmlu_prompt(question, few_shot(dev, "abstract_algebra", 5)).count("Answer:") == 6


@pytest.mark.parametrize("subject, k, message", [
    ("abstract_algebra", 6, "6-shot MMLU needs 6 dev questions of 'abstract_algebra', but the dev split has 5; "
                            "use a few-shot count from 0 to 5"),
    ("virology", 1, "1-shot MMLU needs 1 dev questions of 'virology', but the dev split has 0"),
    ("abstract_algebra", -1, "-1-shot MMLU needs"),
])
def test_few_shot_count_beyond_the_dev_split_is_an_error(subject, k, message):
    with pytest.raises(ConfigError, match=message):
        few_shot(read_mmlu(FIXTURES / "mmlu", "dev"), subject, k)


def test_gsm8k_prompt_is_question_answer_shots_with_worked_solutions():
    shot = GSM8KProblem("Maya has 3 apples and buys 2. How many?", "3 + 2 = <<3+2=5>>5\n#### 5")
    problem = GSM8KProblem("Sam has 4 pens and loses 1. How many?", "4 - 1 = <<4-1=3>>3\n#### 3")
    assert gsm8k_prompt(problem, [shot, shot]) == (
        "Question: Maya has 3 apples and buys 2. How many?\nAnswer: 3 + 2 = <<3+2=5>>5\n#### 5\n\n" * 2
        + "Question: Sam has 4 pens and loses 1. How many?\nAnswer:")
    assert gsm8k_prompt(problem, []) == "Question: Sam has 4 pens and loses 1. How many?\nAnswer:"


def test_gsm8k_stop_cuts_a_completion_that_starts_the_next_question():
    train = read_gsm8k(FIXTURES / "gsm8k" / "train.jsonl")
    completion = f" {train[0].answer}\n\nQuestion: {train[1].question}"
    cut = min(completion.find(stop) for stop in GSM8K_STOP if stop in completion)
    assert completion[:cut].strip() == train[0].answer
