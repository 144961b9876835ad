import json

import pytest

from lmlab.data import SOURCES, DataSourceError


def test_pydocs_needs_no_download_and_is_substantial():
    docs = list(SOURCES.build("pydocs").documents())
    assert len(docs) > 50 and sum(map(len, docs)) > 100_000


def test_text_files_reads_txt_and_jsonl_globs(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "beta"}) + "\n\n" + json.dumps({"text": "gamma"}) + "\n")
    src = SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "*.txt"), str(tmp_path / "*.jsonl")]})
    assert list(src.documents()) == ["alpha", "beta", "gamma"]


def test_text_files_fingerprint_changes_with_content(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one")
    before = SOURCES.build({"name": "text_files", "paths": [str(path)]}).fingerprint()
    path.write_text("one two")
    assert SOURCES.build({"name": "text_files", "paths": [str(path)]}).fingerprint() != before


def test_text_files_errors(tmp_path):
    with pytest.raises(DataSourceError, match="needs data.paths"):
        SOURCES.build({"name": "text_files"})
    with pytest.raises(DataSourceError, match="matches no file"):
        SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "missing*.txt")]})
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataSourceError, match=".txt and .jsonl"):
        SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "x.csv")]})
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "no text field"}) + "\n")
    src = SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "bad.jsonl")]})
    with pytest.raises(DataSourceError, match="bad.jsonl:1 has no 'text' field"):
        list(src.documents())


def test_hf_source_on_a_local_dataset(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps({"story": f"once upon a time {i}"}) + "\n" for i in range(5)))
    cfg = {"name": "hf", "path": "json", "data_files": [str(data)], "text_field": "story", "max_documents": 3}
    src = SOURCES.build(cfg)
    assert list(src.documents()) == [f"once upon a time {i}" for i in range(3)]
    assert src.fingerprint().startswith("hf-")
    with pytest.raises(DataSourceError, match="not a column"):
        SOURCES.build({**cfg, "text_field": "text"})


def test_text_files_reads_a_folder_recursively_in_sorted_order(tmp_path):
    (tmp_path / "corpus" / "b").mkdir(parents=True)
    (tmp_path / "corpus" / "b" / "two.txt").write_text("two")
    (tmp_path / "corpus" / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n")
    (tmp_path / "corpus" / "notes.md").write_text("skipped: not .txt or .jsonl")
    (tmp_path / "corpus" / "c.txt").write_text("three")
    for paths in ([str(tmp_path / "corpus")], [str(tmp_path / "corpus"), str(tmp_path / "corpus" / "c.txt")]):
        src = SOURCES.build({"name": "text_files", "paths": paths})
        assert list(src.documents()) == ["one", "two", "three"]


def test_text_files_folder_without_text_files_is_a_clear_error(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "data.csv").write_text("a,b")
    with pytest.raises(DataSourceError, match=f"'{tmp_path / 'empty'}' names only folders with no .txt or .jsonl"):
        SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "empty")]})


def test_hf_source_that_cannot_load_is_one_line_saying_what_to_do(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what HF_DATASETS_OFFLINE=1 sets at import
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    for path in (str(tmp_path / "no-such-dataset"), "no-such-user/no-such-dataset"):
        with pytest.raises(DataSourceError, match=f"data=hf cannot load data.path='{path}' .*data.data_files") as err:
            SOURCES.build({"name": "hf", "path": path})
        assert "\n" not in str(err.value)
