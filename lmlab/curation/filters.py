"""Document filters, each a registry entry (`FILTERS`, config group `curation/filter`) that returns a Decision:
keep or drop, the reason, and for a filter that edits the text (C4's line rules) the text it keeps.

- `gopher`: Gopher's quality rules (Rae et al. 2021, appendix A): word count, mean word length, lines ending in
  an ellipsis, words with a letter.
- `repetition`: Gopher's repetition rules: duplicate lines and paragraphs, the most frequent n-grams'
  share of the characters, the share in duplicated n-grams.
- `c4`: C4's line and page rules (Raffel et al. 2020).
- `language`: keeps documents whose language (py3langid) is one of a list, at a minimum probability.
- `pii`: masks e-mail addresses, phone numbers and IPv4 addresses (keeps every document, edited).
- `classifier`: keeps documents that a text classifier (lmlab's fastText-style model or a fastText `.bin`, e.g. a
  quality or toxicity model) labels as one of a list, at a minimum probability.

The corpus-level filters (`exact_dedup`, `line_dedup`, `minhash`) are entries too: lmlab.curation.corpus_filters.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lmlab.checks import at_least
from lmlab.curation.langid import LANGUAGE_IDS
from lmlab.curation.pii import MASKS
from lmlab.errors import ConfigError
from lmlab.registry import Registry

FILTERS = Registry("filter", group="curation/filter", doc="document filters: keep or drop, with the reason")

KEEP_REASON = "kept"


@dataclass(frozen=True)
class Decision:
    keep: bool
    reason: str  # why it was dropped, with the measured value ("kept" when it was not)
    text: str | None = None  # the text kept, for a filter that edits it
    rule: str = KEEP_REASON  # the rule that dropped it, a short stable name: what a pipeline's statistics count

    @classmethod
    def kept(cls, text: str | None = None) -> Decision:
        return cls(True, KEEP_REASON, text)

    @classmethod
    def dropped(cls, rule: str, reason: str) -> Decision:
        return cls(False, reason, rule=rule)


def check_fraction(key: str, value: float, low_open: bool = False) -> None:
    """A share or probability is in [0, 1] ((0, 1] with `low_open`); otherwise one ConfigError naming its key, raised
    when the stage is built, before any document is read."""
    if not (0 < value <= 1 if low_open else 0 <= value <= 1):
        raise ConfigError(f"{key} must be in {'(' if low_open else '['}0, 1], got {value}")


# a whitespace-separated word with at least one letter, counted by the regex engine rather than a loop per character
_WORD_WITH_LETTER = re.compile(r"\S*[^\W\d_]\S*")


def words_of(text: str) -> list[str]:
    return text.split()


@FILTERS.register("gopher")
class GopherQuality:
    """Gopher's quality rules: word count, mean word length, ellipsis lines, words with a letter.

    At the published thresholds: 50 to 100,000 words, mean word length 3 to 10, at most 30% of lines ending in an
    ellipsis, at least 80% of words with a letter."""

    @dataclass
    class Config:
        min_words: int = 50
        max_words: int = 100_000
        min_mean_word_length: float = 3.0
        max_mean_word_length: float = 10.0
        max_ellipsis_lines: float = 0.3
        min_alphabetic_words: float = 0.8

    def __init__(self, cfg: Config | None = None):
        c = self.cfg = cfg or self.Config()
        at_least("gopher", c, 0, "min_words", "min_mean_word_length")
        for name in ("max_ellipsis_lines", "min_alphabetic_words"):
            check_fraction(f"gopher.{name}", getattr(c, name))
        for low, high in (("min_words", "max_words"), ("min_mean_word_length", "max_mean_word_length")):
            if getattr(c, low) > getattr(c, high):  # an empty range would drop every document
                raise ConfigError(f"gopher.{low} ({getattr(c, low)}) must be <= gopher.{high} ({getattr(c, high)})")

    def __call__(self, text: str) -> Decision:
        c, words = self.cfg, words_of(text)
        if not c.min_words <= len(words) <= c.max_words:
            return Decision.dropped("word_count", f"gopher: {len(words)} words, outside {c.min_words}..{c.max_words}")
        mean_length = sum(map(len, words)) / len(words)
        if not c.min_mean_word_length <= mean_length <= c.max_mean_word_length:
            return Decision.dropped("mean_word_length", f"gopher: mean word length {mean_length:.1f}, outside "
                                   f"{c.min_mean_word_length:g}..{c.max_mean_word_length:g}")
        lines = [line for line in text.splitlines() if line.strip()]
        ellipsis = sum(line.rstrip().endswith(("...", "\u2026")) for line in lines) / max(len(lines), 1)
        if ellipsis > c.max_ellipsis_lines:
            return Decision.dropped("ellipsis_lines", f"gopher: {ellipsis:.0%} of lines end in an ellipsis (> {c.max_ellipsis_lines:.0%})")
        alphabetic = len(_WORD_WITH_LETTER.findall(text)) / len(words)
        if alphabetic < c.min_alphabetic_words:
            return Decision.dropped("alphabetic_words", f"gopher: {alphabetic:.0%} of words have a letter (< {c.min_alphabetic_words:.0%})")
        return Decision.kept()


def gopher_quality_filter(text: str) -> bool:
    """True when the text passes Gopher's quality rules at their published thresholds."""
    return GopherQuality()(text).keep


def _top_ngram_share(words: list[str], n: int) -> float:
    """Characters in the most frequent n-gram's occurrences (when it occurs more than once), over all words'
    characters, as Gopher counts them."""
    total = sum(map(len, words))
    counts = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    if not counts or not total:
        return 0.0
    top, top_count = counts.most_common(1)[0]
    return sum(map(len, top)) * top_count / total if top_count > 1 else 0.0


def _duplicate_ngram_share(words: list[str], n: int) -> float:
    """Characters in words covered by n-grams that occur more than once, over all words' characters."""
    total = sum(map(len, words))
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams or not total:
        return 0.0
    counts = Counter(grams)
    covered = [False] * len(words)
    for i, gram in enumerate(grams):
        if counts[gram] > 1:
            covered[i:i + n] = [True] * n
    return sum(len(w) for w, c in zip(words, covered) if c) / total


def _duplicates(parts: list[str]) -> tuple[float, float]:
    """(fraction of parts that repeat an earlier one, fraction of characters in those repeats)."""
    seen, repeats, repeat_chars = set(), 0, 0
    for part in parts:
        if part in seen:
            repeats += 1
            repeat_chars += len(part)
        seen.add(part)
    total_chars = sum(map(len, parts))
    return repeats / max(len(parts), 1), repeat_chars / max(total_chars, 1)


@FILTERS.register("repetition")
class GopherRepetition:
    """Gopher's repetition rules: duplicate lines and paragraphs, top n-gram and duplicate n-gram character shares."""

    @dataclass
    class Config:
        max_duplicate_lines: float = 0.30
        max_duplicate_paragraphs: float = 0.30
        max_duplicate_line_chars: float = 0.20
        max_duplicate_paragraph_chars: float = 0.20
        # n -> the most frequent n-gram's largest share of the characters (n = 2, 3, 4)
        max_top_ngram_chars: dict[int, float] = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
        # n -> the largest share of characters in n-grams that occur more than once (n = 5..10)
        max_duplicate_ngram_chars: dict[int, float] = field(
            default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})

    def __init__(self, cfg: Config | None = None):
        c = self.cfg = cfg or self.Config()
        for name in ("max_duplicate_lines", "max_duplicate_paragraphs", "max_duplicate_line_chars",
                     "max_duplicate_paragraph_chars"):
            check_fraction(f"repetition.{name}", getattr(c, name))
        for name in ("max_top_ngram_chars", "max_duplicate_ngram_chars"):
            for n, limit in getattr(c, name).items():
                if n < 1:
                    raise ConfigError(f"repetition.{name}: n-gram sizes must be >= 1, got {n}")
                check_fraction(f"repetition.{name}.{n}", limit)

    def __call__(self, text: str) -> Decision:
        c = self.cfg
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
        for kind, parts, max_share, max_chars in (("lines", lines, c.max_duplicate_lines, c.max_duplicate_line_chars),
                                                  ("paragraphs", paragraphs, c.max_duplicate_paragraphs,
                                                   c.max_duplicate_paragraph_chars)):
            share, chars = _duplicates(parts)
            if share > max_share:
                return Decision.dropped(f"duplicate_{kind}", f"repetition: {share:.0%} duplicate {kind} (> {max_share:.0%})")
            if chars > max_chars:
                return Decision.dropped(f"duplicate_{kind}_chars", f"repetition: {chars:.0%} of characters in duplicate {kind} (> {max_chars:.0%})")
        words = words_of(text)
        for n, limit in sorted(c.max_top_ngram_chars.items()):
            top = _top_ngram_share(words, n)
            if top > limit:
                return Decision.dropped(f"top_{n}gram", f"repetition: the top {n}-gram holds {top:.0%} of characters (> {limit:.0%})")
        for n, limit in sorted(c.max_duplicate_ngram_chars.items()):
            duplicated = _duplicate_ngram_share(words, n)
            if duplicated > limit:
                return Decision.dropped(f"duplicate_{n}grams", f"repetition: {duplicated:.0%} of characters in duplicate {n}-grams "
                                       f"(> {limit:.0%})")
        return Decision.kept()


def gopher_repetition(text: str) -> bool:
    """True when the text passes Gopher's repetition rules at their published thresholds."""
    return GopherRepetition()(text).keep


TERMINAL = ('.', '!', '?', '"', "'", '\u201d')
POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


@FILTERS.register("c4")
class C4Rules:
    """C4's rules: sentence lines only; pages with code, "lorem ipsum" or too few sentences dropped.

    Lines are kept that end in terminal punctuation, have enough words and do not mention JavaScript or the
    site's policies; a page is dropped for "lorem ipsum", a curly bracket or too few sentences in what is left."""

    @dataclass
    class Config:
        min_words_per_line: int = 3  # as in Dolma's C4 rules
        min_sentences: int = 3
        max_word_length: int = 1000

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        at_least("c4", self.cfg, 0, "min_words_per_line", "min_sentences")
        at_least("c4", self.cfg, 1, "max_word_length")

    def __call__(self, text: str) -> Decision:
        c = self.cfg
        lowered = text.lower()
        if "lorem ipsum" in lowered:
            return Decision.dropped("lorem_ipsum", "c4: lorem ipsum")
        if "{" in text:
            return Decision.dropped("curly_bracket", "c4: a curly bracket (code)")
        kept = []
        for line in (line.strip() for line in text.splitlines()):
            low = line.lower()
            words = line.split()
            if (not line.endswith(TERMINAL) or len(words) < c.min_words_per_line or "javascript" in low
                    or any(p in low for p in POLICY_PHRASES) or any(len(w) > c.max_word_length for w in words)):
                continue
            kept.append(line)
        sentences = len(re.findall(r"[.!?](?:\s|$)", "\n".join(kept)))
        if sentences < c.min_sentences:
            return Decision.dropped("few_sentences", f"c4: {sentences} sentences in kept lines (< {c.min_sentences})")
        return Decision.kept("\n".join(kept))


def c4_rules(text: str) -> str | None:
    """The lines of the text that C4's rules keep, or None when they drop the page."""
    decision = C4Rules()(text)
    return decision.text if decision.keep else None


def _label_decision(kind: str, label: str, probability: float, allowed: list[str], min_probability: float) -> Decision:
    """Keep when a model's label is one of `allowed` at `min_probability` or more."""
    if label not in allowed:
        return Decision.dropped("label", f"{kind}: {label} ({probability:.2f}), not one of {','.join(allowed)}")
    if probability < min_probability:
        return Decision.dropped("low_probability", f"{kind}: {label} at {probability:.2f} (< {min_probability:g})")
    return Decision.kept()


@FILTERS.register("language")
class LanguageFilter:
    """Keeps documents in the listed languages at a minimum probability (py3langid, or fastText's lid.176)."""

    @dataclass
    class Config:
        languages: list[str] = field(default_factory=lambda: ["en"])
        min_probability: float = 0.65
        # an entry of `lmlab list langid`: its name, or {name: fasttext, model: lid.176.bin}
        identifier: Any = "py3langid"

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        check_fraction("language.min_probability", self.cfg.min_probability)
        self.identify = LANGUAGE_IDS.build(self.cfg.identifier)

    def __call__(self, text: str) -> Decision:
        return _label_decision("language", *self.identify(text), self.cfg.languages, self.cfg.min_probability)


@FILTERS.register("classifier")
class ClassifierFilter:
    """Keeps documents a text classifier (lmlab's or a fastText .bin) labels as one of `keep`."""

    @dataclass
    class Config:
        model: str = ""  # the model file: `lmlab data train-classifier`'s output, or a fastText .bin
        keep: list[str] = field(default_factory=lambda: ["hq"])  # labels that pass (without __label__)
        min_probability: float = 0.5

    def __init__(self, cfg: Config):
        from lmlab.curation.classifier import load_classifier

        if not cfg.model:
            raise ConfigError("filter 'classifier' needs model=PATH: a model from `lmlab data train-classifier` or "
                              "a fastText .bin file")
        check_fraction("classifier.min_probability", cfg.min_probability)
        self.cfg, self.classifier = cfg, load_classifier(cfg.model)

    def __call__(self, text: str) -> Decision:
        return _label_decision("classifier", *self.classifier.predict(text), self.cfg.keep, self.cfg.min_probability)


@FILTERS.register("pii")
class PiiMask:
    """Masks e-mail addresses, US phone numbers and IPv4 addresses (|||EMAIL_ADDRESS||| ...); keeps every document."""

    @dataclass
    class Config:
        emails: bool = True
        phone_numbers: bool = True
        ips: bool = True

    def __init__(self, cfg: Config | None = None):
        c = cfg or self.Config()
        chosen = {"email": c.emails, "phone": c.phone_numbers, "ip": c.ips}
        self.masks = [mask for kind, mask in MASKS.items() if chosen[kind]]

    def __call__(self, text: str) -> Decision:
        for mask in self.masks:
            text, _ = mask(text)
        return Decision.kept(text)
