"""Text from HTML bytes (resiliparse, as DCLM and the course do), and HTML responses out of WARC files (warcio)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
    from resiliparse.extract.html2text import extract_plain_text

    text = decode_html(html_bytes)
    return None if text is None else extract_plain_text(text)


@dataclass
class WarcHtml:
    url: str
    date: str
    html: bytes


@dataclass
class WarcStats:
    records: int = 0
    html: int = 0
    skipped: int = 0  # responses that are not HTML, or not HTTP 200
    corrupt: int = 0  # truncated or unreadable records (the rest of the file is skipped)


def iter_warc_html(path: str | Path, stats: WarcStats | None = None) -> Iterator[WarcHtml]:
    """The HTML responses of a WARC file (gzipped or not), with their URL and date. A truncated or corrupt record
    ends the file's reading: it is counted in `stats.corrupt`, and what came before it is kept."""
    from warcio.archiveiterator import ArchiveIterator
    from warcio.exceptions import ArchiveLoadFailed

    stats = stats if stats is not None else WarcStats()
    with open(path, "rb") as stream:
        records = ArchiveIterator(stream)
        try:
            for record in records:
                stats.records += 1
                if record.rec_type != "response":
                    continue
                content_type = (record.http_headers.get_header("Content-Type") or "") if record.http_headers else ""
                status = record.http_headers.get_statuscode() if record.http_headers else None
                if status != "200" or content_type.split(";")[0].strip().lower() not in HTML_TYPES:
                    stats.skipped += 1
                    continue
                stats.html += 1
                yield WarcHtml(record.rec_headers.get_header("WARC-Target-URI") or "",
                               record.rec_headers.get_header("WARC-Date") or "", record.content_stream().read())
        except (ArchiveLoadFailed, OSError, EOFError, ValueError):
            stats.corrupt += 1
            return
        if records.offset < os.fstat(stream.fileno()).st_size:  # warcio stops quietly at a cut-off gzip member
            stats.corrupt += 1
