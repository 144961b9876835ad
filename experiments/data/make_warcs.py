"""Packs the HTML that Debian's documentation packages install into WARC files, as a crawl would store them.

    python experiments/data/make_warcs.py OUT_DIR [--pages-per-file 250] [--heldout OUT_DIR/heldout.txt]

Sources (apt-get install debian-reference-{en,de,es,fr,it,ja,pt,zh-cn} debian-handbook python3-doc):
- /usr/share/debian-reference: the Debian Reference in 8 languages, chapter pages and a one-page copy of each;
- /usr/share/doc/debian-handbook/html: the Debian Administrator's Handbook in 26 languages (some partly
  translated: English paragraphs inside other languages' pages);
- /usr/share/doc/python3.11/html: the Python documentation, with its index pages (lists of links).
Every file under those folders becomes one HTTP 200 response record (URL https://docs.debian.example/PATH, the
content type from the file name): the HTML pages, and the images, CSS and JavaScript beside them, which a
pipeline must skip. Files are shuffled by a hash of their path, so each WARC holds a mix of sources.

The Python tutorial (tutorial/*.html) stays out of the WARCs: its main text, extracted by trafilatura, is the
clean held-out set that `run.sh` evaluates every model on.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import mimetypes
from pathlib import Path

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

ROOTS = [Path("/usr/share/debian-reference"), Path("/usr/share/doc/debian-handbook/html"),
         Path("/usr/share/doc/python3.11/html")]
HELDOUT = Path("/usr/share/doc/python3.11/html/tutorial")


def crawl_files() -> list[Path]:
    files = [p for root in ROOTS if root.is_dir() for p in root.rglob("*")
             if p.is_file() and not p.is_relative_to(HELDOUT) and p.suffix != ".gz"]
    if not files:
        raise SystemExit(f"no files under {', '.join(map(str, ROOTS))}: install the packages (see the module doc)")
    return sorted(files, key=lambda p: hashlib.sha1(str(p).encode()).hexdigest())


def write_warcs(files: list[Path], out: Path, per_file: int) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for start in range(0, len(files), per_file):
        path = out / f"debian-{start // per_file:04d}.warc.gz"
        with open(path, "wb") as stream:
            writer = WARCWriter(stream, gzip=True)
            for f in files[start:start + per_file]:
                content_type = mimetypes.guess_type(f.name)[0] or "application/octet-stream"
                headers = StatusAndHeaders("200 OK", [("Content-Type", content_type)], protocol="HTTP/1.1")
                url = "https://docs.debian.example" + str(f)
                writer.write_record(writer.create_warc_record(url, "response", payload=io.BytesIO(f.read_bytes()),
                                                              http_headers=headers))
        written.append(path)
    return written


def write_heldout(path: Path) -> int:
    from lmlab.curation.extract import EXTRACTORS

    extract = EXTRACTORS.build("trafilatura")
    texts = [t for p in sorted(HELDOUT.glob("*.html")) if (t := extract(p.read_bytes()))]
    path.write_text("\n\n".join(texts), encoding="utf-8")
    return len(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pages-per-file", type=int, default=250)
    parser.add_argument("--heldout", type=Path)
    args = parser.parse_args()
    files = crawl_files()
    warcs = write_warcs(files, args.out, args.pages_per_file)
    html = sum(f.suffix == ".html" for f in files)
    print(f"{len(files)} files ({html} HTML, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB) in {len(warcs)} "
          f"WARC files under {args.out}")
    if args.heldout:
        print(f"held-out: {write_heldout(args.heldout)} tutorial pages -> {args.heldout}")


if __name__ == "__main__":
    main()
