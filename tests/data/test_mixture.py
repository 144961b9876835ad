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


def test_a_source_s_errors_name_the_key_the_user_wrote(tmp_path):
    """The sources and the mixing rule are typed Any in the mixture's schema, so they are checked when built:
    each mistake is one DataSourceError (a ConfigError: one line, exit status 2) naming data.sources.NAME."""
    notes = _jsonl(tmp_path / "n.jsonl", "note", 5, 10)

    def build(source, mixing="proportional"):
        return SOURCES.build({"name": "mixture", "sources": {"web": source}, "mixing": mixing})

    composed = compose_config(["data=mixture", f"+data.sources.web={{name: text_files, paths: [{notes}], bogus: 1}}"])
    with pytest.raises(DataSourceError, match=r"^unknown key 'data.sources.web.bogus' \(data.sources.web has: "
                                              r"context_length, batch_size, val_fraction, paths, text_field\)$"):
        SOURCES.build(composed.data)  # as lmlab-train builds it
    with pytest.raises(DataSourceError, match=r"'data.sources.web.pahts'. Did you mean 'data.sources.web.paths'\?"):
        build({"name": "text_files", "pahts": [notes]})
    with pytest.raises(DataSourceError, match="^data.sources.web.paths: '.*nope' matches no file"):
        build({"name": "text_files", "paths": [str(tmp_path / "nope")]})
    with pytest.raises(DataSourceError, match="wrong type for 'data.sources.web.batch_size': got 'abc', expected int"):
        build({"name": "text_files", "paths": [notes], "batch_size": "abc"})
    with pytest.raises(DataSourceError, match="^data.sources.web: unknown data .* Did you mean 'text_files'"):
        build({"name": "text_filez", "paths": [notes]})
    with pytest.raises(DataSourceError, match=r"^unknown key 'data.mixing.max_epoch'. Did you mean 'data.mixing.max_"):
        build({"name": "text_files", "paths": [notes]}, {"name": "unimax", "max_epoch": 2})
    with pytest.raises(DataSourceError, match="^data.mixing.temperature must be > 0"):
        build({"name": "text_files", "paths": [notes]}, {"name": "temperature", "temperature": 0})
    # outside a mixture, the same source names its fields as before
    with pytest.raises(DataSourceError, match="^data.paths: '.*nope' matches no file"):
        SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "nope")]})
