"""Answer parsing and pass@k for generative tasks: GSM8K numbers, multiple-choice letters.

Parsers never raise on a model's text: an answer they cannot read is None, which the caller counts
as wrong and reports. Only the dataset's own reference answer (`gsm8k_reference`) raises.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache

# One number as models write it. The sign is taken only where no word or digit comes before it, so
# the range "3-5" is 3 and 5, not 3 and -5; "−" is the unicode minus. Commas count as thousands
# separators only in groups of three ("1,234,567"; "1,2,3" is three numbers). A "." counts only
# with digits after it, so the sentence's period in "is 42." stays out. Units, "%" and words after
# the number are simply not part of the match.
_NUMBER = re.compile(
    r"""
    (?<![\w.])
    (?P<sign>[-−+])?
    [$€£]?
    (?P<integer>[0-9]{1,3}(?:,[0-9]{3})+(?![0-9]) | [0-9]+ | (?=\.[0-9]))
    (?P<fraction>\.[0-9]+)?
    """,
    re.VERBOSE,
)

# GSM8K's reference solutions end in "#### <answer>"; few-shot prompts teach models the same.
GSM8K_MARKER = "####"


def _normalised(value: Decimal) -> Decimal:
    """42, 42.0 and 42.00 all become Decimal('42') (not normalize()'s '4.2E+1'); -0 becomes 0."""
    if value == value.to_integral_value():
        return Decimal(int(value))
    return value.normalize()


def _to_decimal(match: re.Match[str]) -> Decimal:
    digits = match["integer"].replace(",", "") + (match["fraction"] or "")
    sign = "-" if match["sign"] in ("-", "−") else ""
    return _normalised(Decimal(sign + digits))  # not -Decimal(...), which rounds to the context's 28 digits


def gsm8k_answer(text: str) -> Decimal | None:
    """The model's final number: the first number after the last '####' when the text has that
    marker (None when nothing numeric follows it), else the last number in the text."""
    _, marker, tail = text.rpartition(GSM8K_MARKER)
    if marker:
        first = _NUMBER.search(tail)
        return _to_decimal(first) if first else None
    numbers = list(_NUMBER.finditer(text))
    return _to_decimal(numbers[-1]) if numbers else None


def gsm8k_reference(answer_field: str) -> Decimal:
    """The number after '#### ' in a GSM8K `answer` field (commas removed), as a normalised Decimal."""
    _, marker, tail = answer_field.rpartition(GSM8K_MARKER)
    if not marker:
        raise ValueError(f"GSM8K answer has no '{GSM8K_MARKER} ' marker before its final number: "
                         f"{answer_field[-80:]!r}")
    number = _NUMBER.fullmatch(tail.strip())
    if not number:
        raise ValueError(f"GSM8K answer after '{GSM8K_MARKER}' is not a number: {tail.strip()!r}")
    return _to_decimal(number)


def numbers_equal(a: Decimal | None, b: Decimal | None) -> bool:
    """Numeric equality of two parsed answers; a missing answer (None) equals nothing, not even None."""
    return a is not None and b is not None and a == b


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]
    pick: int  # which match counts: -1 the last one (models restate their answer), 0 the first


# One-letter English words. Before another word they read as the word, not as an answer: "I think",
# "A cat is..." and, in lowercase after "answer is", "the answer is a cat". Only the article is told
# apart by its place, since it is capitalised only where a sentence starts: "it's A because" is an answer.
_WORD_LETTERS = "AIai"
_ARTICLE = "A"
# Templates around a character class "{}" of letters.
_ANYWHERE = "{}"
_NO_WORD_AFTER = r"{}(?!\s+\w)"
_MID_SENTENCE = r"(?<=[a-z,;] ){}"  # after a lowercase word or a comma


def _only(letters: str, keep: str) -> str:
    return "".join(c for c in letters if c in keep)


def _without(letters: str, drop: str) -> str:
    return "".join(c for c in letters if c not in drop)


def _standing_alone(*alternatives: tuple[str, str]) -> str:
    """One capturing group for a letter of any (letters, template) alternative whose letters are not
    empty, with no word character, apostrophe or hyphen right after it."""
    options = [around.format(f"[{letters}]") for letters, around in alternatives if letters]
    return "((?:" + "|".join(options) + ")(?![\\w'-]))"


@lru_cache(maxsize=16)
def _choice_rules(letters: str) -> tuple[_Rule, ...]:
    lower = letters.lower()
    # After an explicit phrase: either case.
    stated = _standing_alone((letters, _ANYWHERE), (_without(lower, _WORD_LETTERS), _ANYWHERE),
                             (_only(lower, _WORD_LETTERS), _NO_WORD_AFTER))
    # Inside "(c)": either case, no word can be meant.
    wrapped = _standing_alone((letters, _ANYWHERE), (lower, _ANYWHERE))
    # Bare: uppercase only.
    bare = _standing_alone((_without(letters, _WORD_LETTERS), _ANYWHERE),
                           (_only(letters, _WORD_LETTERS), _NO_WORD_AFTER), (_only(letters, _ARTICLE), _MID_SENTENCE))
    return (
        # An explicit statement, the last one in the text (models restate, and correct themselves).
        _Rule(re.compile(
            rf"""# "The correct answer is B", "Answer: (C)", "**Answer:** b", "answer (A)",
                 # "the answer to this question is D", "the answer would be option C"
                 (?i:\banswer\b)(?:\s+(?i:to|for)\b[^.\n]{{0,60}}?)?[\s*_]*
                 (?:[:=]|(?i:is|would\s+be|should\s+be|must\s+be)\b)?
                 [\s*_:]*(?:(?i:option|choice|letter)\s*)?[\s*(\[]*{stated}
                 # "the best option is C", "Correct choice: (b)"
               | (?i:\b(?:correct|right|best|final)\s+(?:option|choice|letter|one)\s*(?:is|:))[\s*(\[]*{stated}
                 # "(B) is correct", "C is the answer"
               | (?<![\w'-])[*(\[]*{stated}[*)\]]*\s+(?i:is\s+(?:the\s+)?(?:correct|right|best|answer)\b)""",
            re.VERBOSE), pick=-1),
        # The whole reply is one letter: " C", "c", "(d).", "**A**".
        _Rule(re.compile(rf"\A[\s*(\[]*{wrapped}[\s*)\].:]*\Z"), pick=0),
        # The first letter standing alone: "(C) ...", "b) London", "B. Paris", "I think it's B because";
        # not the article in "A cat is an animal", not the "B" of "Bob".
        _Rule(re.compile(rf"(?<!\w)\({wrapped}\)|\[{wrapped}\]|(?<!\S){wrapped}\)|(?<![\w'-]){bare}"), pick=0),
    )


def choice_letter(text: str, letters: str = "ABCD") -> str | None:
    """The uppercase answer letter in a generated multiple-choice answer, or None when none is readable.

    Rules in order, the first that matches decides: an explicit phrase ("answer is X", "Answer: X",
    the last such phrase wins), a reply that is only the letter, the first letter standing alone."""
    if not re.fullmatch(r"[A-Z]+", letters) or len(set(letters)) != len(letters):
        raise ValueError(f"letters must be distinct uppercase ASCII letters such as 'ABCD', got {letters!r}")
    for rule in _choice_rules(letters):
        matches = list(rule.pattern.finditer(text))
        if matches:
            match = matches[rule.pick]
            return match[match.lastindex].upper()
    return None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. 2021 from n samples of which c are correct: 1 - C(n-c, k) / C(n, k),
    computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which neither overflows nor cancels for large n (a factor
    is exactly 0 when fewer than k samples are wrong, so that case is exactly 1)."""
    if n < 0 or c < 0 or k < 1:
        raise ValueError(f"pass@k needs n >= 0, c >= 0 and k >= 1, got n={n}, c={c}, k={k}")
    if k > n or c > n:
        raise ValueError(f"pass@k needs k <= n and c <= n (k samples drawn out of n, c of them correct), "
                         f"got n={n}, c={c}, k={k}")
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
