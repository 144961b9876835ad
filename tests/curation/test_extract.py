"""Text from HTML bytes, and HTML responses out of WARC files written here with warcio."""

import gzip

import pytest

from lmlab.curation import extract_text_from_html_bytes, iter_warc_html
from lmlab.curation.extract import WarcStats
from tests.curation.warcs import warc_bytes

PAGE = "<html><head><title>T</title></head><body><p>Café au lait, s'il vous plaît.</p></body></html>"


def test_utf8_and_legacy_encodings_give_the_same_text():
    assert "Café au lait" in extract_text_from_html_bytes(PAGE.encode("utf-8"))
    latin = PAGE.replace("<head>", '<head><meta charset="iso-8859-1">').encode("latin-1")
    assert "Café au lait" in extract_text_from_html_bytes(latin)


def test_bytes_that_do_not_decode_give_none_or_text_never_an_error():
    assert extract_text_from_html_bytes(b"") == ""
    out = extract_text_from_html_bytes(bytes(range(256)))
    assert out is None or isinstance(out, str)


def test_warc_yields_only_ok_html_responses_with_url_and_date(tmp_path):
    path = tmp_path / "a.warc.gz"
    path.write_bytes(warc_bytes([("https://a.example/", "200 OK", "text/html; charset=utf-8", PAGE.encode()),
                            ("https://a.example/logo.png", "200 OK", "image/png", b"\x89PNG"),
                            ("https://a.example/gone", "404 Not Found", "text/html", b"<p>no</p>"),
                            ("https://b.example/x", "200 OK", "application/xhtml+xml", b"<p>second page</p>")]))
    stats = WarcStats()
    pages = list(iter_warc_html(path, stats))
    assert [p.url for p in pages] == ["https://a.example/", "https://b.example/x"]
    assert pages[0].date and "Café" in extract_text_from_html_bytes(pages[0].html)
    assert (stats.html, stats.not_ok, stats.not_html, stats.corrupt) == (2, 1, 1, 0)


def test_a_truncated_warc_keeps_what_came_before_and_counts_the_damage(tmp_path):
    whole = warc_bytes([("https://a.example/", "200 OK", "text/html", PAGE.encode())] * 3)
    one = len(warc_bytes([("https://a.example/", "200 OK", "text/html", PAGE.encode())]))
    path = tmp_path / "cut.warc.gz"
    path.write_bytes(whole[:2 * one + one // 2])  # two whole records, then half of the third
    stats = WarcStats()
    pages = list(iter_warc_html(path, stats))
    assert len(pages) == 2 and stats.corrupt == 1
    assert gzip.decompress(whole)  # the untruncated file is valid


def test_extractors_registry_resiliparse_keeps_all_text_trafilatura_the_main_content():
    from lmlab.curation.extract import EXTRACTORS

    body = " ".join(["The mill by the river ground grain for the whole valley for two hundred years."] * 6)
    html = (f"<html><body><nav>Home | Products | Contact</nav><article><h1>The old mill</h1><p>{body}</p>"
            "</article><footer>Copyright 2024 Example Inc.</footer></body></html>").encode()
    everything = EXTRACTORS.build("resiliparse")(html)
    assert "Home | Products" in everything and body in everything
    pytest.importorskip("trafilatura")
    main = EXTRACTORS.build("trafilatura")(html)
    assert body in main and "Home | Products" not in main and "Copyright" not in main
