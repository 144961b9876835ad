"""`data=mixture`: the weighting rules' arithmetic, epochs per source, a held-out share training never sees,
and composing it from the command line."""

import json

import pytest

from lmlab.cli.compose import compose_config
from lmlab.data import MIXING, SOURCES
from lmlab.data.sources import DataSourceError


def test_unimax_caps_epochs_and_gives_the_rest_to_larger_sources():
    takes = MIXING.build({"name": "unimax", "max_epochs": 2})({"small": 100, "mid": 1000, "big": 10_000}, 3000)
    assert takes == pytest.approx({"small": 200, "mid": 1400, "big": 1400})  # 200 = 2 epochs; the rest split evenly


def test_temperature_goes_from_proportional_to_uniform():
    sizes = {"a": 100.0, "b": 900.0}
    proportional = MIXING.build("proportional")(sizes, 1000)
    assert MIXING.build({"name": "temperature", "temperature": 1.0})(sizes, 1000) == pytest.approx(proportional)
    assert MIXING.build({"name": "temperature", "temperature": 1e6})(sizes, 1000) == pytest.approx(
        MIXING.build("uniform")(sizes, 1000), rel=1e-3)
    assert MIXING.build({"name": "weights", "weights": {"a": 3, "b": 1}})(sizes, 1000) == pytest.approx(
        {"a": 750, "b": 250})
    with pytest.raises(DataSourceError, match="a weight >= 0 for each source"):
        MIXING.build({"name": "weights", "weights": {"a": 1}})(sizes, 1000)


def _jsonl(path, prefix, n, words):
    path.write_text("".join(json.dumps({"text": f"{prefix}{i} " + "w " * words}) + "\n" for i in range(n)))
    return str(path)


def test_mixture_repeats_small_sources_up_to_the_cap_and_holds_out_unseen_documents(tmp_path, capsys):
    small, big = _jsonl(tmp_path / "s.jsonl", "small", 20, 20), _jsonl(tmp_path / "b.jsonl", "big", 200, 20)
    cfg = {"name": "mixture", "sources": {"small": {"name": "text_files", "paths": [small]},
                                          "big": {"name": "text_files", "paths": [big]}},
           "mixing": {"name": "unimax", "max_epochs": 3}, "budget": 2 * 200 * 45, "val_fraction": 0.1}
    source = SOURCES.build(cfg)
    docs = list(source.documents())
    assert source.epochs["small"] == pytest.approx(3.0)  # capped: uniform would ask for ~9 passes
    assert source.epochs["big"] > 1.0  # it takes what the small source could not
    val_chars, cut, seen = sum(map(len, docs)) * 0.095, len(docs), 0
    while seen < val_chars:  # the stream's last 10%, give or take a document: where the cache takes validation
        cut -= 1
        seen += len(docs[cut])
    train, val = set(docs[:cut]), set(docs[cut:])
    assert val and not train & val  # validation documents are never trained on
    assert {d.split()[0][:3] for d in val} == {"sma", "big"}  # both sources are in validation
    assert docs == list(SOURCES.build(cfg).documents())  # the seed fixes the order
    assert list(source.documents()) == docs  # a second read (the tokenizer's, then the encoding's) ...
    assert capsys.readouterr().err.count("data=mixture: small 3.00 epochs") == 2  # ... reports once per source
    other = SOURCES.build({**cfg, "mixing": "proportional"})
    assert other.fingerprint() != source.fingerprint()


def test_mixture_composes_from_the_command_line(tmp_path):
    small = _jsonl(tmp_path / "s.jsonl", "small", 5, 10)
    cfg = compose_config(["data=mixture", f"+data.sources.notes={{name: text_files, paths: [{small}]}}",
                          "data.mixing={name: temperature, temperature: 3}"])
    source = SOURCES.build(cfg.data)
    assert len(list(source.documents())) >= 5
    with pytest.raises(DataSourceError, match="needs data.sources"):
        SOURCES.build(compose_config(["data=mixture"]).data)
