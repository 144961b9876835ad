"""Document filters: each rule's threshold, the reason it gives, and the registry entries."""

import pytest

from lmlab.curation import FILTERS, c4_rules, gopher_quality_filter, gopher_repetition, identify_language
from lmlab.curation.classifier import ClassifierConfig
from lmlab.curation.executors import EXECUTORS
from lmlab.curation.langid import LANGUAGE_IDS
from lmlab.curation.readers import READERS
from lmlab.errors import ConfigError

PROSE = ("The committee met on Tuesday to discuss the budget for the coming year, and after a long debate it agreed "
         "to fund the new library, repair the bridge over the river and hire two more teachers for the school. "
         "Several residents spoke in favour of the plan, while others asked how the town would pay for it without "
         "raising taxes again. The vote is next week.")


def test_gopher_keeps_ordinary_prose():
    assert len(PROSE.split()) >= 50 and gopher_quality_filter(PROSE)


@pytest.mark.parametrize("text, reason", [
    ("too few words here", "words"),
    (" ".join(["a"] * 60), "mean word length"),
    (" ".join(["incomprehensibilities"] * 60), "mean word length"),
    ("\n".join(["and then the story went on and on ..."] * 10), "ellipsis"),
    (PROSE + " " + " ".join(["1234", "--", "5678"] * 40), "letter"),
])
def test_gopher_drops_each_rule_with_its_reason(text, reason):
    decision = FILTERS.build("gopher")(text)
    assert not decision.keep and reason in decision.reason
    assert not gopher_quality_filter(text)


def test_gopher_thresholds_are_config():
    assert FILTERS.build({"name": "gopher", "min_words": 3})("too few words here").keep


def test_repetition_drops_repeated_lines_and_ngrams_and_keeps_prose():
    assert gopher_repetition(PROSE)
    lines = "\n".join(["Home", "About us", "Contact"] * 5 + ["A line of its own."])
    decision = FILTERS.build("repetition")(lines)
    assert not decision.keep and "duplicate lines" in decision.reason
    spam = PROSE + " buy cheap pills now" * 30
    assert not gopher_repetition(spam)


def test_c4_keeps_sentences_and_drops_menus_and_code():
    page = "Menu\nHome | About\n" + PROSE + "\nThis site uses cookies to improve your experience.\nShort line."
    kept = c4_rules(page)
    assert kept == PROSE
    assert c4_rules("function f() { return 1; }\n" + PROSE) is None
    assert c4_rules("Lorem ipsum dolor sit amet.\n" + PROSE) is None
    assert c4_rules("One sentence only.") is None


def test_language_identification_and_filter():
    assert identify_language(PROSE)[0] == "en" and identify_language(PROSE)[1] > 0.9
    german = "Der Ausschuss traf sich am Dienstag, um über den Haushalt für das kommende Jahr zu beraten."
    assert identify_language(german)[0] == "de"
    keep_en = FILTERS.build({"name": "language", "languages": ["en"]})
    assert keep_en(PROSE).keep
    decision = keep_en(german)
    assert not decision.keep and decision.reason.startswith("language: de")
    assert FILTERS.build({"name": "language", "languages": ["de", "en"], "min_probability": 0.5})(german).keep


def test_an_unknown_filter_is_a_registry_error():
    from lmlab.registry import RegistryError

    with pytest.raises(RegistryError, match="gopher"):
        FILTERS.build("gopehr")


def test_long_texts_are_identified_on_three_windows():
    from lmlab.curation.langid import sample_windows

    text = "a" * 5000 + "MIDDLE" + "z" * 5000
    sample = sample_windows(text, 3000)
    assert len(sample) <= 3002 and sample.startswith("a" * 1000) and sample.endswith("z" * 1000)
    assert "MIDDLE" in sample and sample_windows("short", 3000) == "short" and sample_windows(text, 0) == text
    german = "Der Fluss lief an der alten Mühle vorbei, wo die Kinder spielten und die Bauern ihr Korn verkauften. "
    assert identify_language(PROSE * 40)[0] == "en" and identify_language(german * 60)[0] == "de"


def test_gopher_counts_words_with_any_letter_unicode_included():
    from lmlab.curation.filters import GopherQuality

    letters = ["word", "x1", "é", "ünïcode", "日本語", "(see"] * 13  # 78 words with a letter
    kept = " ".join(letters + ["123", "--", "42%"] * 6)  # 78 of 96: 81%
    dropped = " ".join(letters + ["123", "--", "42%"] * 8)  # 78 of 102: 76%
    assert GopherQuality()(kept).keep
    assert GopherQuality()(dropped).rule == "alphabetic_words"


@pytest.mark.parametrize("registry, cfg, message", [
    (FILTERS, {"name": "minhash", "jaccard_threshold": 2}, r"minhash.jaccard_threshold must be in \(0, 1\], got 2"),
    (FILTERS, {"name": "minhash", "jaccard_threshold": 0}, r"minhash.jaccard_threshold must be in \(0, 1\]"),
    (FILTERS, {"name": "minhash", "num_hashes": 0}, "minhash.num_hashes must be >= 1"),
    (FILTERS, {"name": "minhash", "ngrams": 0}, "minhash.ngrams must be >= 1"),
    (FILTERS, {"name": "gopher", "min_alphabetic_words": 80}, r"gopher.min_alphabetic_words must be in \[0, 1\]"),
    (FILTERS, {"name": "gopher", "max_ellipsis_lines": -0.1}, "gopher.max_ellipsis_lines must be in"),
    (FILTERS, {"name": "gopher", "min_words": 500, "max_words": 100}, r"gopher.min_words \(500\) must be <="),
    (FILTERS, {"name": "repetition", "max_duplicate_lines": 30}, "repetition.max_duplicate_lines must be in"),
    (FILTERS, {"name": "repetition", "max_top_ngram_chars": {2: 1.2}}, "repetition.max_top_ngram_chars.2 must be in"),
    (FILTERS, {"name": "repetition", "max_duplicate_ngram_chars": {0: 0.1}}, "n-gram sizes must be >= 1"),
    (FILTERS, {"name": "c4", "max_word_length": 0}, "c4.max_word_length must be >= 1"),
    (FILTERS, {"name": "c4", "min_sentences": -1}, "c4.min_sentences must be >= 0"),
    (FILTERS, {"name": "language", "min_probability": 65}, "language.min_probability must be in"),
    (FILTERS, {"name": "classifier", "model": "none.pt", "min_probability": 1.5}, "classifier.min_probability"),
    (LANGUAGE_IDS, {"name": "py3langid", "max_chars": -1}, "py3langid.max_chars must be >= 0"),
    (READERS, {"name": "parquet", "batch_size": 0}, "reader.batch_size must be >= 1"),
    (EXECUTORS, {"name": "ray", "cpus_per_task": 0}, "executor.cpus_per_task must be > 0"),
])
def test_out_of_range_settings_fail_when_built_naming_the_field(registry, cfg, message):
    with pytest.raises(ConfigError, match=message):
        registry.build(cfg)


def test_classifier_training_settings_are_checked():
    with pytest.raises(ConfigError, match="classifier.batch_size must be >= 1, got 0"):
        ClassifierConfig(batch_size=0)
    with pytest.raises(ConfigError, match="classifier.lr must be > 0"):
        ClassifierConfig(lr=0.0)
