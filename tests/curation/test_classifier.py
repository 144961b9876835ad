"""The fastText-style classifier: it learns labels from fastText-format text, saves and loads, and filters."""

import random

import pytest

from lmlab.cli.main import main
from lmlab.curation import FILTERS
from lmlab.curation.classifier import ClassifierConfig, TextClassifier, load_classifier, read_labelled
from lmlab.errors import ConfigError

GOOD = "the theorem follows from the lemma by induction on the length of the proof and the bound is tight".split()
BAD = "click here buy now free prize winner limited offer cheap deal subscribe act fast".split()


def _examples(n, seed):
    rng = random.Random(seed)
    return [(label, " ".join(rng.choices(words, k=12) + rng.choices(GOOD + BAD, k=4)))
            for _ in range(n) for label, words in (("hq", GOOD), ("spam", BAD))]


def _write(path, examples):
    path.write_text("".join(f"__label__{label} {text}\n" for label, text in examples))
    return path


def test_it_learns_two_labels_that_words_separate_and_survives_a_save(tmp_path):
    clf = TextClassifier.train(_examples(200, 0), ClassifierConfig(buckets=1 << 12, epochs=3))
    held_out = _examples(50, 1)
    assert clf.accuracy(held_out) > 0.95
    label, probability = clf.predict("we prove the lemma by induction")
    assert label == "hq" and 0.5 < probability <= 1
    loaded = load_classifier(clf.save(tmp_path / "q.pt"))
    assert loaded.labels == ["hq", "spam"]
    assert loaded.predict_batch([t for _, t in held_out]) == clf.predict_batch([t for _, t in held_out])


def test_the_filter_keeps_the_chosen_label_and_needs_a_model_file(tmp_path):
    path = TextClassifier.train(_examples(200, 0), ClassifierConfig(buckets=1 << 12, epochs=3)).save(tmp_path / "q.pt")
    keep_hq = FILTERS.build({"name": "classifier", "model": str(path), "keep": ["hq"]})
    assert keep_hq("the proof of the theorem is by induction").keep
    decision = keep_hq("buy now, free prize, click here")
    assert not decision.keep and decision.reason.startswith("classifier: spam")
    with pytest.raises(ConfigError, match="does not exist"):
        FILTERS.build({"name": "classifier", "model": str(tmp_path / "missing.pt")})
    with pytest.raises(ConfigError, match="model=PATH"):
        FILTERS.build("classifier")


def test_cli_trains_from_fasttext_format_files(tmp_path, capsys):
    train = _write(tmp_path / "train.txt", _examples(100, 0))
    valid = _write(tmp_path / "valid.txt", _examples(20, 1))
    assert main(["data", "train-classifier", str(train), "--valid", str(valid), "--out", str(tmp_path / "m.pt"),
                 "--buckets", "4096", "--epochs", "3"]) == 0
    assert "validation accuracy 1.000" in capsys.readouterr().out and (tmp_path / "m.pt").is_file()


def test_a_line_without_a_label_is_named(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("__label__hq fine text\nno label here\n")
    with pytest.raises(ConfigError, match="bad.txt:2"):
        read_labelled(bad)


def _fasttext_model(tmp_path):
    """A real fastText .bin (the `fasttext` package's own training), labelled like lid.176: __label__en, __label__de."""
    fasttext = pytest.importorskip("fasttext")
    train = tmp_path / "lid.txt"
    train.write_text("\n".join(["__label__en the cat sat on the mat and the dog ran in the park"] * 30 +
                               ["__label__de der Hund lief über die Straße und die Katze schlief"] * 30) + "\n")
    path = tmp_path / "lid.bin"
    fasttext.train_supervised(str(train), epoch=10, verbose=0).save_model(str(path))
    return path


def test_fasttext_bin_models_load_as_classifier_and_language_identifier(tmp_path):
    from lmlab.curation.langid import LANGUAGE_IDS

    path = _fasttext_model(tmp_path)
    assert load_classifier(path).predict("the dog ran in the park")[0] == "en"
    lid = LANGUAGE_IDS.build({"name": "fasttext", "model": str(path)})
    assert lid("die Katze schlief")[0] == "de" and 0 < lid("die Katze schlief")[1] <= 1
    keep_german = FILTERS.build({"name": "language", "languages": ["de"], "min_probability": 0.5,
                                 "identifier": {"name": "fasttext", "model": str(path)}})
    assert keep_german("der Hund lief über die Straße").keep and not keep_german("the cat sat on the mat").keep
    with pytest.raises(ConfigError, match="does not exist: download https://.*/lid.176.bin"):
        LANGUAGE_IDS.build({"name": "fasttext", "model": str(tmp_path / "lid.176.bin")})
    with pytest.raises(ConfigError, match="needs model=PATH.*identifier: {name: fasttext, model: PATH}"):
        LANGUAGE_IDS.build("fasttext")
