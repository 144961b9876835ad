"""GSM8K and MMLU in their original release formats, read from a local path or from Hugging Face `datasets`.

GSM8K (Cobbe et al., 2021): `{train,test}.jsonl`, one JSON object per line with `question` and `answer` (the
worked solution, whose last line is `#### <number>`). MMLU (Hendrycks et al., 2021): a folder holding `dev/`,
`val/` and `test/`, each with `<subject>_<split>.csv` files of rows question, A, B, C, D, answer letter (no
header). A file in the wrong format fails with one line naming the file and the line or row.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmlab.errors import ConfigError
from lmlab.jsonl import json_lines
from lmlab.registry import closest, unknown_name_message

MMLU_LETTERS = ("A", "B", "C", "D")
HF_SOURCE = "hf"  # the `source` that means Hugging Face instead of a local path
GSM8K_HF = ("openai/gsm8k", "main")
MMLU_HF = ("cais/mmlu", "all")
GSM8K_SPLITS = {"train": "train", "test": "test"}  # lmlab's split name -> the Hugging Face split
MMLU_SPLITS = {"dev": "dev", "val": "validation", "test": "test"}  # the release's folder names -> Hugging Face


@dataclass(frozen=True)
class GSM8KProblem:
    question: str
    answer: str  # the full worked solution, ending with the line "#### <number>"


@dataclass(frozen=True)
class MMLUQuestion:
    subject: str  # as in the file names, e.g. "high_school_geography"
    question: str
    choices: tuple[str, str, str, str]
    answer: str  # the correct choice's letter, "A" to "D"


def _gsm8k_problem(record: Any, where: str) -> GSM8KProblem:
    if not isinstance(record, Mapping) or not all(isinstance(record.get(k), str) for k in ("question", "answer")):
        raise ConfigError(f"{where} lacks a 'question' or 'answer' string; a GSM8K line is "
                          '{"question": "...", "answer": "... #### <number>"}')
    if not record["answer"].rsplit("\n", 1)[-1].startswith("#### "):
        raise ConfigError(f"{where}: the answer does not end with a '#### <number>' line, as GSM8K answers do")
    return GSM8KProblem(record["question"], record["answer"])


def _mmlu_question(subject: str, question: str, choices: Sequence[str], answer: str, where: str) -> MMLUQuestion:
    if answer not in MMLU_LETTERS:
        raise ConfigError(f"{where}: the answer {answer!r} is not one of A, B, C, D")
    return MMLUQuestion(subject, question, (choices[0], choices[1], choices[2], choices[3]), answer)


def _chosen_subjects(available: Iterable[str], subjects: Iterable[str] | None, where: str) -> list[str]:
    available = sorted(set(available))
    if subjects is None:
        return available
    subjects = sorted(set(subjects))
    for subject in subjects:
        if subject not in available:
            hint = closest(subject, available)
            did_you_mean = f" Did you mean {hint!r}?" if hint else ""
            raise ConfigError(f"unknown MMLU subject '{subject}' in {where}.{did_you_mean} "
                              f"({len(available)} subjects there)")
    return subjects


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte {err.start}); the GSM8K and MMLU releases are UTF-8") from None


def _gsm8k_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"GSM8K file {path} does not exist; give a .jsonl file of question/answer lines "
                          "(the release's train.jsonl or test.jsonl)")
    return path


def read_gsm8k(path: str | Path) -> list[GSM8KProblem]:
    """The problems of a GSM8K `.jsonl` file, in file order."""
    path = _gsm8k_file(path)
    problems = [_gsm8k_problem(record, f"{path}:{line_no}")
                for line_no, record in json_lines(_read_text(path), str(path), "a GSM8K file holds one JSON object per line")]
    if not problems:
        raise ConfigError(f"GSM8K file {path} holds no problems")
    return problems


def _read_mmlu_csv(path: Path, subject: str) -> list[MMLUQuestion]:
    # newline="": quoted fields may hold newlines; strict: a stray quote is an error, not part of a field
    reader = csv.reader(io.StringIO(_read_text(path), newline=""), strict=True)
    questions, first_line = [], 1  # a row may span lines: errors name the line it starts on
    try:
        for row in reader:
            where, first_line = f"{path}:{first_line}", reader.line_num + 1
            if not row:
                continue
            if len(row) != 6:
                raise ConfigError(f"{where} has {len(row)} columns, not 6 (question, A, B, C, D, answer letter); "
                                  "quote fields that hold commas")
            questions.append(_mmlu_question(subject, row[0], row[1:5], row[5], where))
    except csv.Error as err:
        raise ConfigError(f"{path}:{first_line} is not valid CSV ({err}); a field with commas, quotes or newlines "
                          'is quoted, with its quotes doubled ("")') from None
    if not questions:
        raise ConfigError(f"MMLU file {path} holds no questions")
    return questions


def _mmlu_split_folder(root: str | Path, split: str) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"MMLU folder {root} does not exist; give the folder that holds dev/, val/ and test/ "
                          "(the release's data/ folder)")
    folder = root / split
    if not folder.is_dir():
        present = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise ConfigError(f"MMLU split folder {folder} does not exist (folders there: {present or 'none'}); "
                          "an MMLU folder holds dev/, val/ and test/")
    return folder


def read_mmlu(root: str | Path, split: str, subjects: Iterable[str] | None = None) -> dict[str, list[MMLUQuestion]]:
    """The questions of one split (`dev`, `val` or `test`) of an MMLU folder, by subject (sorted), in file order.

    `subjects` picks some (all when None)."""
    folder = _mmlu_split_folder(root, split)
    suffix = f"_{split}.csv"
    files = {p.name[:-len(suffix)]: p for p in folder.glob(f"*{suffix}") if p.is_file()}
    if not files:
        raise ConfigError(f"MMLU split folder {folder} has no <subject>{suffix} files")
    chosen = _chosen_subjects(files, subjects, str(folder))
    return {subject: _read_mmlu_csv(files[subject], subject) for subject in chosen}


def _hf_split(what: str, split: str, splits: Mapping[str, str]) -> str:
    if split not in splits:
        raise ConfigError(unknown_name_message(f"{what} split", split, splits))
    return splits[split]


def _load_hf(path: str, name: str, split: str):
    """A Hugging Face dataset split; its failures (most often: no network) become one ConfigError line."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"reading {path} from Hugging Face needs the `datasets` package: "
                          "pip install 'lmlab[eval]'") from None
    try:
        return datasets.load_dataset(path, name, split=split)
    except Exception as err:  # noqa: BLE001 - datasets fails with many types (network, hub, cache, builders)
        reason = (str(err).strip().splitlines() or [""])[0]
        raise ConfigError(f"cannot load {path} ({name}, split {split}) from Hugging Face ({type(err).__name__}: "
                          f"{reason}); it needs the network, or use a local path to the release's files") from None


def check_gsm8k_source(source: str | Path, splits: Iterable[str]) -> None:
    """Raise ConfigError unless `load_gsm8k(source, split)` can find each split: a local folder's files exist (no
    data read), a Hugging Face split is known."""
    for split in splits:
        if source == HF_SOURCE:
            _hf_split("GSM8K", split, GSM8K_SPLITS)
        else:
            _gsm8k_file(Path(source) / f"{split}.jsonl")


def check_mmlu_source(source: str | Path, splits: Iterable[str]) -> None:
    """Raise ConfigError unless `load_mmlu(source, split)` can find each split: a local folder's split folders
    exist (no data read), a Hugging Face split is known."""
    for split in splits:
        if source == HF_SOURCE:
            _hf_split("MMLU", split, MMLU_SPLITS)
        else:
            _mmlu_split_folder(source, split)


def load_gsm8k(source: str | Path, split: str) -> list[GSM8KProblem]:
    """GSM8K's `train` or `test` split from a local folder holding `{split}.jsonl`, or from Hugging Face when
    `source` is "hf" ("openai/gsm8k", config "main")."""
    if source != HF_SOURCE:
        return read_gsm8k(Path(source) / f"{split}.jsonl")
    path, name = GSM8K_HF
    rows = _load_hf(path, name, _hf_split("GSM8K", split, GSM8K_SPLITS))
    return [_gsm8k_problem(row, f"{path} {split} row {i}") for i, row in enumerate(rows, 1)]


def load_mmlu(source: str | Path, split: str, subjects: Iterable[str] | None = None) -> dict[str, list[MMLUQuestion]]:
    """MMLU's `dev`, `val` or `test` split by subject, from a local folder (see `read_mmlu`) or from Hugging Face
    when `source` is "hf" ("cais/mmlu", config "all", whose rows hold `question`, `subject`, `choices` and the
    answer's index)."""
    if source != HF_SOURCE:
        return read_mmlu(source, split, subjects)
    path, name = MMLU_HF
    by_subject: dict[str, list[MMLUQuestion]] = {}
    for i, row in enumerate(_load_hf(path, name, _hf_split("MMLU", split, MMLU_SPLITS)), 1):
        where = f"{path} {split} row {i}"
        if len(row["choices"]) != 4 or row["answer"] not in range(4):
            raise ConfigError(f"{where} has {len(row['choices'])} choices and answer {row['answer']!r}, "
                              "not 4 choices and an index 0-3")
        question = _mmlu_question(row["subject"], row["question"], row["choices"], MMLU_LETTERS[row["answer"]], where)
        by_subject.setdefault(question.subject, []).append(question)
    return {subject: by_subject[subject] for subject in _chosen_subjects(by_subject, subjects, f"{path} {split}")}
