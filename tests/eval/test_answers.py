"""Answer parsers on real-looking completions (GSM8K numbers, multiple-choice letters) and pass@k
against its closed form and against counting k-subsets."""

import itertools
import math
from decimal import Decimal

import pytest

from lmlab.eval.answers import choice_letter, gsm8k_answer, gsm8k_reference, numbers_equal, pass_at_k

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize("text, expected", [
    # With the marker: the number after the last one, whatever follows it.
    (GSM8K_SOLUTION, "72"),
    ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $10.\n#### 10",
     "10"),
    ("He pays 3 * 400 = 1,200 dollars.\n#### $1,200", "1200"),
    ("#### 18\nSo she makes $18 every day, and 126 in a week.", "18"),
    ("A first try: #### 5. No, recount: 3 + 4 = 7.\n#### 7 apples", "7"),
    ("The temperature falls 4 + 3 = 7 degrees below zero.\n#### -7", "-7"),
    ("####72", "72"),
    # Without it: the last number in the text.
    ("She has 3 apples and buys 4 more, so she has 3 + 4 = 7 apples.", "7"),
    ("The answer is 42.", "42"),
    ("So the total cost is $1,234,567.", "1234567"),
    ("Each ticket costs $3.50, so four cost $14.00.", "14"),
    ("They drive at 5 km/h.", "5"),
    ("The discount is 45%.", "45"),
    ("Half of one cup is .5", "0.5"),
    ("The final balance is -12.25 dollars.", "-12.25"),
    ("The lake is 3 metres below sea level, so its height is −3 m.", "-3"),
    ("She is 2 years older: 8 + 2 = 10 years old.", "10"),
    ("Children aged 3-5 go free.", "5"),  # a range, not minus five
    ("The numbers are 1,2,3", "3"),  # commas that do not group thousands separate numbers
    ("He owes -$40 after paying.", "-40"),
])
def test_gsm8k_answer_reads_the_final_number(text, expected):
    assert gsm8k_answer(text) == Decimal(expected)


@pytest.mark.parametrize("text", [
    "I don't know how many apples there are.",
    "",
    "Adding them up: 3 + 4 = 7.\n####",  # the marker decides, and nothing numeric follows it
    "#### seven",
])
def test_gsm8k_answer_is_none_without_a_number(text):
    assert gsm8k_answer(text) is None


def test_gsm8k_answers_are_normalised():
    """42, 42.0 and 42.00 are the same answer and print the same way, with no exponent or -0."""
    assert {gsm8k_answer(text) for text in ("42", "42.0", "#### 42.00")} == {Decimal(42)}
    assert [str(gsm8k_answer(text)) for text in ("42.00", "1,000", "3.50", "-0", "0.10")] == ["42", "1000", "3.5", "0",
                                                                                               "0.1"]
    assert gsm8k_answer("-" + "9" * 40) == Decimal("-" + "9" * 40)  # exact, not rounded to Decimal's 28 digits


def test_gsm8k_reference_reads_the_dataset_answer():
    assert gsm8k_reference(GSM8K_SOLUTION) == Decimal(72)
    assert gsm8k_reference("3 * 1000 = <<3*1000=3000>>3000\n#### 3,000") == Decimal(3000)
    assert gsm8k_reference("It falls to -3 degrees.\n#### -3") == Decimal(-3)
    assert gsm8k_reference("#### 2.5\n") == Decimal("2.5")


@pytest.mark.parametrize("field, message", [
    ("Natalia sold 72 clips altogether.", "no '#### ' marker"),
    ("She sold 72 clips.\n#### seventy-two", "not a number: 'seventy-two'"),
    ("#### ", "not a number"),
])
def test_gsm8k_reference_rejects_a_malformed_answer(field, message):
    with pytest.raises(ValueError, match=message):
        gsm8k_reference(field)


def test_numbers_equal():
    assert numbers_equal(gsm8k_answer("The answer is 42."), gsm8k_reference("#### 42"))
    assert numbers_equal(Decimal("3.5"), Decimal("3.50"))
    assert not numbers_equal(Decimal(1), Decimal(2))
    assert not numbers_equal(None, Decimal(0))
    assert not numbers_equal(None, None)


@pytest.mark.parametrize("text, expected", [
    # Explicit phrases.
    ("The correct answer is B", "B"),
    ("Answer: (C)", "C"),
    ("answer: c", "C"),
    ("**Answer:** b", "B"),
    ("The answer is: **D**", "D"),
    ("The answer to this question is D.", "D"),
    ("answer (A)", "A"),
    ("The answer would be option C, since the others are wrong.", "C"),
    ("The best option is C.", "C"),
    ("(B) is correct: Paris is the capital of France.", "B"),
    ("A is the answer", "A"),
    ("The correct answer is A because a cat is a mammal.", "A"),
    # Several explicit answers: the last one.
    ("The answer is B. Wait, let me re-check. The answer is C.", "C"),
    # An explicit phrase beats a bare leading letter.
    ("B. Actually, on reflection the answer is D", "D"),
    # Bare letters.
    ("B. Paris", "B"),
    ("(D)", "D"),
    ("**A**", "A"),
    (" C", "C"),
    ("c", "C"),
    ("(d).", "D"),
    ("b) London", "B"),
    ("I think it's B because the others are too small.", "B"),
    ("I think it's A because it is the largest.", "A"),  # mid-sentence, a capital A is no article
    ("A. Paris is the capital of France.", "A"),
    ("A cat is an animal, so the answer is D", "D"),
])
def test_choice_letter_reads_the_answer(text, expected):
    assert choice_letter(text) == expected


@pytest.mark.parametrize("text", [
    "A cat is an animal.",  # the article, not option A
    "Bob and Carol disagree.",  # letters inside words
    "Vitamin-C deficiency causes scurvy.",
    "the answer is a cat",
    "I'm not sure.",
    "",
])
def test_choice_letter_is_none_when_unparseable(text):
    assert choice_letter(text) is None


def test_choice_letter_with_other_letters():
    ten = "ABCDEFGHIJ"
    assert choice_letter("I think the answer is J", ten) == "J"
    assert choice_letter("I believe it is G.", ten) == "G"  # the pronoun "I" is not option I
    assert choice_letter("I believe so.", ten) is None
    assert choice_letter("The answer is E", "ABCD") is None
    with pytest.raises(ValueError, match="distinct uppercase"):
        choice_letter("B", "abcd")


def test_pass_at_k_known_values():
    assert pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(7, 3, 5) == 1.0  # only 4 wrong samples: every 5 of them hold a correct one
    for n, c in [(1, 1), (10, 3), (200, 17)]:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)


@pytest.mark.parametrize("n, step", [(1, 1), (2, 1), (5, 1), (20, 1), (200, 9)])
def test_pass_at_k_matches_the_closed_form(n, step):
    for c, k in itertools.product(range(0, n + 1, step), range(1, n + 1, step)):
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_is_the_chance_that_k_samples_hold_a_correct_one(n):
    """Counted over every k-subset of n samples whose first c are correct."""
    for c, k in itertools.product(range(n + 1), range(1, n + 1)):
        subsets = list(itertools.combinations(range(n), k))
        passing = sum(any(sample < c for sample in subset) for subset in subsets)
        assert pass_at_k(n, c, k) == pytest.approx(passing / len(subsets))


@pytest.mark.parametrize("n, c, k, message", [
    (5, 2, 6, "k <= n"),
    (5, 6, 1, "c <= n"),
    (-1, 0, 1, "n >= 0"),
    (5, -1, 1, "c >= 0"),
    (5, 1, -1, "k >= 1"),
    (5, 1, 0, "k >= 1"),
])
def test_pass_at_k_rejects_impossible_counts(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)
