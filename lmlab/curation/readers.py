"""Readers: the documents of one input file, a registry (`lmlab list reader`).

- `warc`: the HTML responses of a WARC file (gzipped or not), their text from an extractor, URL and date kept;
- `wet`: the text records (`conversion`) of a WET file, as Common Crawl extracts them, URL and date kept;
- `jsonl`: one document a line (`.jsonl` or `.jsonl.gz`), its text under `text_key`;
- `parquet`: one document a row (pyarrow, read in batches);
- `text`: a plain text file is one document.

A reader counts what it reads into its stage statistics: records in, documents out, the bytes it read, and why
a record gave no document (corrupt record, HTTP status not 200, not HTML, undecodable bytes, no text).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmlab.checks import at_least
from lmlab.curation.document import Document, StageStats
from lmlab.curation.extract import EXTRACTORS, WarcStats, iter_warc_html, iter_warc_records
from lmlab.errors import ConfigError
from lmlab.registry import Registry

READERS = Registry("reader", group="curation/reader", doc="input files to documents")


def _id(path: Path, index: int) -> str:
    return f"{path.name}/{index}"


@READERS.register("warc")
class WarcReader:
    """HTTP 200 responses with an HTML content type; their text from `extractor` (`lmlab list extractor`)."""

    @dataclass
    class Config:
        extractor: Any = "resiliparse"  # an extractor's name, or {name: trafilatura, favor_precision: true}

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        self.extract = EXTRACTORS.build(self.cfg.extractor)

    def read(self, path: Path, stats: StageStats) -> Iterator[Document]:
        warc = WarcStats()
        for page in iter_warc_html(path, warc):
            stats.docs_in += 1
            stats.bytes_in += len(page.html)
            text = self.extract(page.html)
            if text is None:
                stats.drop("undecodable")
            elif not text.strip():
                stats.drop("empty")
            else:
                yield Document(_id(path, warc.html - 1), text, {"url": page.url, "date": page.date})
        # responses that hold no page count as read and dropped: other statuses, other content types
        stats.docs_in += warc.not_ok + warc.not_html + warc.corrupt
        stats.drop("http_status", warc.not_ok)
        stats.drop("not_html", warc.not_html)
        stats.drop("corrupt_record", warc.corrupt)


@READERS.register("wet")
class WetReader:
    """The `conversion` records of a WET file: text Common Crawl already extracted, decoded as UTF-8."""

    def __init__(self, cfg: object = None):
        pass

    def read(self, path: Path, stats: StageStats) -> Iterator[Document]:
        warc = WarcStats()
        for index, (record, payload) in enumerate(iter_warc_records(path, lambda r: r.rec_type == "conversion", warc)):
            stats.docs_in += 1
            stats.bytes_in += len(payload)
            try:
                text = payload.decode("utf-8")
            except UnicodeDecodeError:
                stats.drop("undecodable")
                continue
            if not text.strip():
                stats.drop("empty")
                continue
            yield Document(_id(path, index), text, {"url": record.rec_headers.get_header("WARC-Target-URI") or "",
                                                    "date": record.rec_headers.get_header("WARC-Date") or ""})
        stats.docs_in += warc.corrupt
        stats.drop("corrupt_record", warc.corrupt)


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


@READERS.register("jsonl")
class JsonlReader:
    """One JSON object a line with the text under `text_key`; other keys are kept as metadata."""

    @dataclass
    class Config:
        text_key: str = "text"
        id_key: str = "id"

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()

    def read(self, path: Path, stats: StageStats) -> Iterator[Document]:
        with _open_text(path) as lines:
            for line_no, line in enumerate(lines):
                if not line.strip():
                    continue
                stats.docs_in += 1
                stats.bytes_in += len(line.encode())
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    stats.drop("bad_json")
                    continue
                yield from _document(record, self.cfg.text_key, self.cfg.id_key, _id(path, line_no), stats)


def _document(record: dict, text_key: str, id_key: str, default_id: str, stats: StageStats) -> Iterator[Document]:
    text = record.pop(text_key, None)
    if not isinstance(text, str) or not text.strip():
        stats.drop("empty")
        return
    doc_id = record.pop(id_key, None)
    yield Document(str(doc_id) if doc_id is not None else default_id, text, record)


@READERS.register("parquet")
class ParquetReader:
    """One row a document (pyarrow, `batch_size` rows at a time), the text in column `text_key`."""

    @dataclass
    class Config:
        text_key: str = "text"
        id_key: str = "id"
        batch_size: int = 1024

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        at_least("reader", self.cfg, 1, "batch_size")

    def read(self, path: Path, stats: StageStats) -> Iterator[Document]:
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        if self.cfg.text_key not in table.schema_arrow.names:
            raise ConfigError(f"{path} has no column '{self.cfg.text_key}' (reader.text_key); its columns: "
                              f"{', '.join(table.schema_arrow.names)}")
        row = 0
        for batch in table.iter_batches(batch_size=self.cfg.batch_size):
            for record in batch.to_pylist():
                stats.docs_in += 1
                stats.bytes_in += len(record.get(self.cfg.text_key) or "")
                yield from _document(record, self.cfg.text_key, self.cfg.id_key, _id(path, row), stats)
                row += 1


@READERS.register("text")
class TextReader:
    """A plain text file is one document (undecodable bytes replaced)."""

    @dataclass
    class Config:
        encoding: str = "utf-8"

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()

    def read(self, path: Path, stats: StageStats) -> Iterator[Document]:
        data = path.read_bytes()
        stats.docs_in += 1
        stats.bytes_in += len(data)
        text = data.decode(self.cfg.encoding, errors="replace")
        if text.strip():
            yield Document(path.name, text, {"path": str(path)})
        else:
            stats.drop("empty")

