"""WARC files written here with warcio, for the tests that read them."""

import io

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter


def warc_bytes(records) -> bytes:
    """A gzipped WARC of (url, HTTP status, content type, body bytes) responses."""
    buffer = io.BytesIO()
    writer = WARCWriter(buffer, gzip=True)
    for url, status, content_type, body in records:
        headers = StatusAndHeaders(status, [("Content-Type", content_type)], protocol="HTTP/1.1")
        writer.write_record(writer.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=headers))
    return buffer.getvalue()


def wet_bytes(records) -> bytes:
    """A gzipped WET file of (url, text bytes) conversion records, as Common Crawl writes its extracted text."""
    buffer = io.BytesIO()
    writer = WARCWriter(buffer, gzip=True)
    for url, body in records:
        writer.write_record(writer.create_warc_record(url, "conversion", payload=io.BytesIO(body),
                                                      warc_content_type="text/plain"))
    return buffer.getvalue()
