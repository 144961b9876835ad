"""Text from HTML bytes, and HTML responses out of WARC files (warcio).

Extractors are a registry (`lmlab list extractor`): `resiliparse` (the default, as DCLM and the course extract:
detect the encoding, then `extract_plain_text`) and `trafilatura` (main-content extraction, slower). Each maps
HTML bytes to text, or to None when the bytes do not decode or hold no text.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmlab.errors import ConfigError
from lmlab.registry import Registry

EXTRACTORS = Registry("extractor", group="curation/extractor", doc="HTML to plain text: bytes in, text or None out")

HTML_TYPES = ("text/html", "application/xhtml+xml")


def decode_html(html_bytes: bytes) -> str | None:
    """The bytes as text: UTF-8 when they are valid UTF-8 (a strong signal, and most of the web), else the
    encoding resiliparse detects; None when neither decodes them."""
    try:
        return html_bytes.decode("utf-8")
    except UnicodeDecodeError:
        pass
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    try:
        return bytes_to_str(html_bytes, detect_encoding(html_bytes))
    except (UnicodeDecodeError, LookupError, ValueError):
        return None


def extract_text_from_html_bytes(html_bytes: bytes) -> str | None:
    """The page's plain text (resiliparse's `extract_plain_text`), or None when the bytes do not decode."""
    return ResiliparseExtractor()(html_bytes)


@EXTRACTORS.register("resiliparse")
class ResiliparseExtractor:
    """resiliparse's `extract_plain_text` after decoding (UTF-8, else the detected encoding): fast, keeps all text."""

    @dataclass
    class Config:
        main_content: bool = False  # resiliparse's heuristics that drop navigation, headers and footers
        preserve_formatting: bool = True  # line breaks between blocks: line-level filters and dedup need them
        alt_texts: bool = True
        list_bullets: bool = True

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()

    def __call__(self, html_bytes: bytes) -> str | None:
        from resiliparse.extract.html2text import extract_plain_text

        text = decode_html(html_bytes)
        c = self.cfg
        return None if text is None else extract_plain_text(
            text, main_content=c.main_content, preserve_formatting=c.preserve_formatting, alt_texts=c.alt_texts,
            list_bullets=c.list_bullets)


@EXTRACTORS.register("trafilatura")
class TrafilaturaExtractor:
    """trafilatura's main-content extraction (boilerplate removed, with fallbacks); about 10x slower."""

    @dataclass
    class Config:
        favor_precision: bool = False
        favor_recall: bool = False
        include_tables: bool = True
        include_comments: bool = False

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        if importlib.util.find_spec("trafilatura") is None:
            raise ConfigError("extractor 'trafilatura' needs `pip install trafilatura lxml_html_clean`")

    def __call__(self, html_bytes: bytes) -> str | None:
        import trafilatura

        text = decode_html(html_bytes)
        c = self.cfg
        return None if text is None else trafilatura.extract(
            text, favor_precision=c.favor_precision, favor_recall=c.favor_recall, include_tables=c.include_tables,
            include_comments=c.include_comments)


@dataclass
class WarcHtml:
    url: str
    date: str
    html: bytes


@dataclass
class WarcStats:
    records: int = 0
    html: int = 0
    not_ok: int = 0  # responses whose HTTP status is not 200 (redirects, 404s, errors)
    not_html: int = 0  # 200 responses of another content type (images, scripts, PDFs)
    corrupt: int = 0  # truncated or unreadable records (the rest of the file is skipped)


def iter_warc_records(path: str | Path, select: Callable, stats: WarcStats) -> Iterator[tuple[Any, bytes]]:
    """(record, payload) of the records of a WARC/WET file (gzipped or not) that `select(record)` accepts, the
    payload read inside the guard: a truncated or corrupt record ends the file's reading, counted in
    `stats.corrupt`, and what came before it is kept."""
    from warcio.archiveiterator import ArchiveIterator
    from warcio.exceptions import ArchiveLoadFailed

    with open(path, "rb") as stream:
        records = ArchiveIterator(stream)
        try:
            for record in records:
                stats.records += 1
                if select(record):
                    yield record, record.content_stream().read()
        except (ArchiveLoadFailed, OSError, EOFError, ValueError):
            stats.corrupt += 1
            return
        if records.offset < os.fstat(stream.fileno()).st_size:  # warcio stops quietly at a cut-off gzip member
            stats.corrupt += 1


def iter_warc_html(path: str | Path, stats: WarcStats | None = None) -> Iterator[WarcHtml]:
    """The HTML responses (HTTP 200) of a WARC file, with their URL and date; damage counted as
    `iter_warc_records` does."""
    stats = stats if stats is not None else WarcStats()

    def html_response(record) -> bool:
        if record.rec_type != "response":
            return False
        content_type = (record.http_headers.get_header("Content-Type") or "") if record.http_headers else ""
        status = record.http_headers.get_statuscode() if record.http_headers else None
        if status != "200":
            stats.not_ok += 1
            return False
        if content_type.split(";")[0].strip().lower() not in HTML_TYPES:
            stats.not_html += 1
            return False
        stats.html += 1
        return True

    for record, payload in iter_warc_records(path, html_response, stats):
        yield WarcHtml(record.rec_headers.get_header("WARC-Target-URI") or "",
                       record.rec_headers.get_header("WARC-Date") or "", payload)
