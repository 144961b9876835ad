import json
import sys
import types
from pathlib import Path

import pytest

from lmlab.errors import ConfigError
from lmlab.eval.datasets import (GSM8KProblem, MMLUQuestion, check_gsm8k_source, check_mmlu_source, load_gsm8k,
                                 load_mmlu, read_gsm8k, read_mmlu)

FIXTURES = Path(__file__).parent / "fixtures"


def test_read_gsm8k_reads_the_fixture_in_order():
    train, test = read_gsm8k(FIXTURES / "gsm8k" / "train.jsonl"), read_gsm8k(FIXTURES / "gsm8k" / "test.jsonl")
    assert (len(train), len(test)) == (4, 3)
    assert test[0] == GSM8KProblem(
        "Sara has 3 boxes with 14 crayons each. She gives 9 crayons to her brother. How many crayons does she have left?",
        "Sara has 3 * 14 = <<3*14=42>>42 crayons.\nShe has 42 - 9 = <<42-9=33>>33 left.\n#### 33")
    assert load_gsm8k(FIXTURES / "gsm8k", "train") == train


def test_read_mmlu_reads_subjects_sorted_and_quoted_fields():
    test = read_mmlu(FIXTURES / "mmlu", "test")
    assert list(test) == ["abstract_algebra", "high_school_geography"]
    assert [len(qs) for qs in test.values()] == [6, 7]
    tricky = test["abstract_algebra"][3]  # a question with a comma, quotes and a newline
    assert tricky == MMLUQuestion(
        "abstract_algebra",
        'A student says: "every group of prime order is cyclic, so every group of order 4 is cyclic."\n'
        "What is wrong with the argument?",
        ("Nothing, it is correct", "4 is not prime", "Groups of prime order are not cyclic", "Z_4 is not a group"), "B")
    dev = load_mmlu(FIXTURES / "mmlu", "dev", subjects=["high_school_geography"])
    assert list(dev) == ["high_school_geography"] and len(dev["high_school_geography"]) == 5


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


GOOD_LINE = json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"})


@pytest.mark.parametrize("content, message", [
    (f"{GOOD_LINE}\n{{not json\n", r"bad\.jsonl line 2 is not JSON"),
    (f"{GOOD_LINE}\n\n{json.dumps({'question': 'q'})}\n", r"bad\.jsonl:3 lacks a 'question' or 'answer' string"),
    ('["question", "answer"]\n', r"bad\.jsonl:1 lacks a 'question'"),
    (json.dumps({"question": "q", "answer": "it is 2"}) + "\n", r"bad\.jsonl:1: the answer does not end with a '#### "),
    ("\n\n", r"bad\.jsonl holds no problems"),
    (b'{"question": "\xff"}\n', r"bad\.jsonl is not UTF-8 text"),
])
def test_read_gsm8k_names_the_file_and_line_of_bad_input(tmp_path, content, message):
    with pytest.raises(ConfigError, match=message) as err:
        read_gsm8k(_write(tmp_path / "bad.jsonl", content))
    assert "\n" not in str(err.value)


def test_read_gsm8k_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"GSM8K file .*test\.jsonl does not exist"):
        load_gsm8k(tmp_path, "test")


GOOD_ROW = 'Which is even?,1,2,3,5,B\r\n'


@pytest.mark.parametrize("content, message", [
    (GOOD_ROW + '"A quoted\nquestion, on two lines",1,2,3\r\n', r"x_test\.csv:2 has 4 columns, not 6"),
    (GOOD_ROW + '"Two lines,\nfirst",1,2,3,4,B\r\nQ,1,2,3,4,E\r\n', r"x_test\.csv:4: the answer 'E' is not one of A, B"),
    (GOOD_ROW + 'Q,1,2,3,4, B\r\n', r"x_test\.csv:2: the answer ' B' is not one of"),
    (GOOD_ROW + '"unclosed,1,2,3,4,B\r\n', r"x_test\.csv:2 is not valid CSV \(unexpected end of data\)"),
    ("\r\n", r"MMLU file .*x_test\.csv holds no questions"),
])
def test_read_mmlu_names_the_file_and_line_of_bad_rows(tmp_path, content, message):
    _write(tmp_path / "test" / "x_test.csv", content)
    with pytest.raises(ConfigError, match=message) as err:
        read_mmlu(tmp_path, "test")
    assert "\n" not in str(err.value)


def test_read_mmlu_folder_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"MMLU folder .*nowhere does not exist"):
        read_mmlu(tmp_path / "nowhere", "test")
    with pytest.raises(ConfigError, match=r"split folder .*val does not exist \(folders there: \['dev', 'test'\]\)"):
        read_mmlu(FIXTURES / "mmlu", "val")
    (tmp_path / "test").mkdir()
    _write(tmp_path / "test" / "x_dev.csv", GOOD_ROW)  # another split's file does not count
    with pytest.raises(ConfigError, match=r"MMLU split folder .*test has no <subject>_test\.csv files"):
        read_mmlu(tmp_path, "test")


def test_source_checks_look_for_the_files_without_reading_them(tmp_path):
    (tmp_path / "test.jsonl").write_text("not json")  # there, though unreadable: the check does not read it
    check_gsm8k_source(tmp_path, ["test"])
    with pytest.raises(ConfigError, match="GSM8K file .*train.jsonl does not exist"):
        check_gsm8k_source(tmp_path, ["test", "train"])
    (tmp_path / "test").mkdir()
    check_mmlu_source(tmp_path, ["test"])
    with pytest.raises(ConfigError, match=r"MMLU split folder .*dev does not exist \(folders there: \['test'\]\)"):
        check_mmlu_source(tmp_path, ["test", "dev"])
    with pytest.raises(ConfigError, match="MMLU folder .*nowhere does not exist"):
        check_mmlu_source(tmp_path / "nowhere", ["test"])
    check_gsm8k_source("hf", ["train", "test"])  # Hugging Face: the split names only, nothing downloaded
    with pytest.raises(ConfigError, match="GSM8K split"):
        check_gsm8k_source("hf", ["val"])


def test_read_mmlu_unknown_subject_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown MMLU subject 'high_school_geograpy' .* "
                                          r"Did you mean 'high_school_geography'\? \(2 subjects there\)"):
        read_mmlu(FIXTURES / "mmlu", "test", subjects=["abstract_algebra", "high_school_geograpy"])


def _fake_datasets(monkeypatch, rows_by_call: dict) -> list:
    """Puts a `datasets` module whose `load_dataset` returns `rows_by_call[(path, name, split)]`; returns the calls."""
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return rows_by_call[(path, name, split)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_load_gsm8k_from_hf_maps_rows_to_problems(monkeypatch):
    rows = [{"question": "1 + 1?", "answer": "2\n#### 2"}]
    calls = _fake_datasets(monkeypatch, {("openai/gsm8k", "main", "test"): rows})
    assert load_gsm8k("hf", "test") == [GSM8KProblem("1 + 1?", "2\n#### 2")]
    assert calls == [("openai/gsm8k", "main", "test")]


def test_load_mmlu_from_hf_maps_index_answers_to_letters_by_subject(monkeypatch):
    rows = [{"question": "q1", "subject": "virology", "choices": ["a", "b", "c", "d"], "answer": 3},
            {"question": "q2", "subject": "anatomy", "choices": ["e", "f", "g", "h"], "answer": 0},
            {"question": "q3", "subject": "virology", "choices": ["i", "j", "k", "l"], "answer": 1}]
    calls = _fake_datasets(monkeypatch, {("cais/mmlu", "all", "validation"): rows})
    val = load_mmlu("hf", "val")
    assert calls == [("cais/mmlu", "all", "validation")]
    assert list(val) == ["anatomy", "virology"]
    assert val["virology"] == [MMLUQuestion("virology", "q1", ("a", "b", "c", "d"), "D"),
                               MMLUQuestion("virology", "q3", ("i", "j", "k", "l"), "B")]
    assert list(load_mmlu("hf", "val", subjects=["virology"])) == ["virology"]
    with pytest.raises(ConfigError, match="unknown MMLU subject 'virolgy' in cais/mmlu val. Did you mean 'virology'"):
        load_mmlu("hf", "val", subjects=["virolgy"])


def test_load_from_hf_bad_rows_and_splits(monkeypatch):
    _fake_datasets(monkeypatch, {("cais/mmlu", "all", "test"): [
        {"question": "q", "subject": "virology", "choices": ["a", "b", "c", "d"], "answer": 4}]})
    with pytest.raises(ConfigError, match="cais/mmlu test row 1 has 4 choices and answer 4, not 4 choices and an index"):
        load_mmlu("hf", "test")
    with pytest.raises(ConfigError, match="unknown MMLU split 'validation'. Did you mean 'val'"):
        load_mmlu("hf", "validation")
    with pytest.raises(ConfigError, match="unknown GSM8K split 'dev'"):
        load_gsm8k("hf", "dev")


def test_load_from_hf_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ConfigError, match=r"needs the `datasets` package: pip install 'lmlab\[eval\]'"):
        load_gsm8k("hf", "test")


def test_load_from_hf_offline_is_one_line_saying_to_use_a_local_path(monkeypatch):
    def load_dataset(path, name=None, split=None):
        raise ConnectionError("Couldn't reach 'cais/mmlu' on the Hub (LocalEntryNotFoundError)\nmore detail")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    expected = (r"cannot load cais/mmlu \(all, split test\) from Hugging Face \(ConnectionError: Couldn't reach .*\); "
                r"it needs the network, or use a local path")
    with pytest.raises(ConfigError, match=expected) as err:
        load_mmlu("hf", "test")
    assert "\n" not in str(err.value)
