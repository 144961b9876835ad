"""Text sources (config group `data`): where training documents come from.

Every source's Config extends `DataConfig`, so the batch settings sit beside the source's own
fields: `lmlab-train data=text_files data.paths=[notes/*.txt] data.context_length=256`.
A source checks its input in `__init__` (before any long work) and streams documents. Its errors name its
fields by `source_key()`: `data.paths`, or `data.sources.web.paths` for a source of `data=mixture`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from lmlab.checks import at_least, in_open_interval
from lmlab.errors import ConfigError
from lmlab.registry import Registry

SOURCES = Registry("data", group="data", doc="text sources and batch settings")

_SOURCE_KEY = ContextVar("source_key", default="data")


def source_key() -> str:
    """Where the source being built sits in the config, for its error messages: `data`, or the key that
    `source_at` names (a mixture's `data.sources.NAME`)."""
    return _SOURCE_KEY.get()


@contextmanager
def source_at(key: str) -> Iterator[None]:
    """Sources built inside this block name their fields under `key` in their errors."""
    token = _SOURCE_KEY.set(key)
    try:
        yield
    finally:
        _SOURCE_KEY.reset(token)


@dataclass
class DataConfig:
    context_length: int = 128
    batch_size: int = 32
    val_fraction: float = 0.05  # the last tokens of the corpus, held out for validation

    def __post_init__(self) -> None:
        at_least(source_key(), self, 1, "context_length", "batch_size")
        in_open_interval(source_key(), self, "val_fraction", 0, 1)


class DataSourceError(ConfigError):
    """A data source that cannot be read: missing files, empty corpus, bad fields."""


class TextSource(ABC):
    @abstractmethod
    def documents(self) -> Iterator[str]:
        """The documents, one string each, in a fixed order."""

    @abstractmethod
    def fingerprint(self) -> str:
        """Changes whenever the documents may change; part of the token cache key."""


@SOURCES.register("pydocs")
class PyDocs(TextSource):
    """The CPython documentation topics shipped in the standard library (pydoc_data): no download."""

    @dataclass
    class Config(DataConfig):
        pass

    def __init__(self, cfg: Config):
        from pydoc_data import topics

        self._topics = topics.topics

    def documents(self) -> Iterator[str]:
        for key in sorted(self._topics):
            yield self._topics[key]

    def fingerprint(self) -> str:
        return f"pydocs-{sys.version_info.major}.{sys.version_info.minor}-{len(self._topics)}"


@SOURCES.register("text_files")
class TextFiles(TextSource):
    """Local .txt files (one document each) or .jsonl files (one document per line's text field);
    a folder stands for the .txt and .jsonl files under it."""

    @dataclass
    class Config(DataConfig):
        paths: list[str] = field(default_factory=list)  # files, folders or glob patterns
        text_field: str = "text"

    SUFFIXES = (".txt", ".jsonl")

    def __init__(self, cfg: Config):
        self.text_field = cfg.text_field
        self.key = key = source_key()
        if not cfg.paths:
            raise DataSourceError(f"data=text_files needs {key}.paths, e.g. {key}.paths=[corpus/*.txt]")
        files: list[Path] = []
        for pattern in cfg.paths:
            matched = [Path(p) for p in sorted(glob.glob(os.path.expanduser(pattern), recursive=True))]
            if not matched:
                raise DataSourceError(f"{key}.paths: '{pattern}' matches no file (working directory: {os.getcwd()})")
            found = [f for p in matched for f in ([p] if p.is_file() else self._files_under(p))]
            if not found:
                raise DataSourceError(f"{key}.paths: '{pattern}' names only folders with no .txt or .jsonl file in "
                                      f"them: {', '.join(map(str, matched[:3]))}")
            files.extend(found)
        unknown = [str(p) for p in files if p.suffix not in self.SUFFIXES]
        if unknown:
            raise DataSourceError(f"{key}.paths: only .txt and .jsonl files are read, got {unknown[:3]}")
        self.files = list(dict.fromkeys(files))  # a folder and a glob inside it may name a file twice

    @classmethod
    def _files_under(cls, folder: Path) -> list[Path]:
        return sorted(p for p in folder.rglob("*") if p.suffix in cls.SUFFIXES and p.is_file())

    def documents(self) -> Iterator[str]:
        for path in self.files:
            if path.suffix == ".txt":
                yield path.read_text(encoding="utf-8", errors="replace")
                continue
            with path.open(encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if self.text_field not in record:
                        raise DataSourceError(
                            f"{path}:{line_no} has no '{self.text_field}' field ({self.key}.text_field)")
                    yield record[self.text_field]

    def fingerprint(self) -> str:
        stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in self.files]
        return "files-" + hashlib.sha256(json.dumps([stats, self.text_field]).encode()).hexdigest()[:16]


@SOURCES.register("hf")
class HFDataset(TextSource):
    """A Hugging Face `datasets` dataset (e.g. roneneldan/TinyStories); needs the network or a local copy."""

    @dataclass
    class Config(DataConfig):
        path: str = "roneneldan/TinyStories"  # hub id, local folder, or a builder such as "json"
        config_name: str | None = None
        data_files: list[str] | None = None  # local files for builders such as "json" or "text"
        split: str = "train"
        text_field: str = "text"
        max_documents: int | None = None
        streaming: bool = False

    def __init__(self, cfg: Config):
        try:
            import datasets
        except ImportError:
            raise DataSourceError("data=hf needs the `datasets` package: pip install 'lmlab[hf]'") from None
        self.cfg, key = cfg, source_key()
        try:
            self._dataset = datasets.load_dataset(cfg.path, cfg.config_name, data_files=cfg.data_files, split=cfg.split,
                                                  streaming=cfg.streaming)
        except Exception as err:  # noqa: BLE001 - datasets fails with many types (network, files, builders)
            reason = (str(err).strip().splitlines() or [""])[0]
            raise DataSourceError(
                f"data=hf cannot load {key}.path='{cfg.path}' ({type(err).__name__}: {reason}); without the network, "
                f"read local files ({key}.path=json {key}.data_files=[my/*.jsonl], or data=text_files) or a copy "
                "already in the Hugging Face cache (HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1)") from None
        columns = self._dataset.column_names or []
        if columns and cfg.text_field not in columns:
            raise DataSourceError(f"{key}.text_field='{cfg.text_field}' is not a column of {cfg.path}: {columns}")

    def documents(self) -> Iterator[str]:
        for i, record in enumerate(self._dataset):
            if self.cfg.max_documents is not None and i >= self.cfg.max_documents:
                return
            yield record[self.cfg.text_field]

    def fingerprint(self) -> str:
        ds_fp = getattr(self._dataset, "_fingerprint", None) or "streaming"
        key = [self.cfg.path, self.cfg.config_name, self.cfg.data_files, self.cfg.split, self.cfg.text_field, self.cfg.max_documents, ds_fp]
        return "hf-" + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
