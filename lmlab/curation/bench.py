"""`lmlab bench data HTML_PATHS...`: the data stage's speed on one core against datatrove's, in one run.

    lmlab bench data /usr/share/debian-reference /usr/share/doc/python3/html --json data-bench.json

On the same HTML pages (files, folders or globs of .html files, up to `--max-page-mb` each, in a seeded shuffled
order), one process each:
- extraction + language ID + Gopher, MB of HTML per second: lmlab (resiliparse, py3langid, Gopher's rules), lmlab
  with trafilatura as its extractor, and datatrove's Trafilatura extractor and GopherQualityFilter. datatrove's
  language filter loads fastText's lid.176 from the Hugging Face hub, which an offline machine cannot, so its
  rows leave language ID out: they do less work than lmlab's.
- MinHash signatures of 1 KB documents (the pages' text cut at word boundaries), 100 hashes of word 5-grams,
  documents per second: lmlab's `shingles` + `MinHasher` against datatrove's `MinhashDedupSignature`
  (20 buckets x 5 hashes), shingling included.
Medians of `--repeats` passes, each contender timed in turn after a warm-up pass. datatrove needs
`pip install datatrove spacy 'xxhash<4'` (its English word tokenizer is spaCy's; xxhash 4 rejects the str its
MinHash hashes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import tempfile
from pathlib import Path

from lmlab.curation.dedup import MinHasher, shingles
from lmlab.curation.extract import EXTRACTORS
from lmlab.curation.filters import GopherQuality
from lmlab.curation.langid import identify_language
from lmlab.curation.pipeline import input_files
from lmlab.errors import ConfigError
from lmlab.timing import interleaved_medians

DOC_CHARS = 1000
PARTS = ("resiliparse", "trafilatura", "minhash")
NUM_HASHES, BUCKETS, NGRAMS = 100, 20, 5


def html_pages(patterns: list[str], limit: int, max_bytes: float) -> list[bytes]:
    """Up to `limit` pages of at most `max_bytes`, in an order shuffled by a fixed seed (so a prefix mixes sources)."""
    paths = [p for p in input_files(patterns) if p.suffix in (".html", ".htm") and p.stat().st_size <= max_bytes]
    if not paths:
        raise ConfigError(f"no .html file of at most {max_bytes / 1e6:g} MB under {patterns}")
    random.Random(0).shuffle(paths)
    return [p.read_bytes() for p in paths[:limit]]


def one_kb_documents(texts: list[str], count: int) -> list[str]:
    """`count` documents of about DOC_CHARS characters, cut from the texts at word boundaries."""
    docs, current = [], []
    for word in (w for text in texts for w in text.split()):
        current.append(word)
        if sum(map(len, current)) + len(current) >= DOC_CHARS:
            docs.append(" ".join(current))
            current = []
            if len(docs) == count:
                break
    return docs


def lmlab_pass(pages: list[bytes], extractor_name: str):
    extract, gopher = EXTRACTORS.build(extractor_name), GopherQuality()

    def run():
        kept = 0
        for html in pages:
            text = extract(html)
            if text:
                identify_language(text)
                kept += gopher(text).keep
        return kept
    return run


def datatrove_pass(pages: list[bytes]):
    from datatrove.data import Document
    from datatrove.pipeline.extractors import Trafilatura
    from datatrove.pipeline.filters import GopherQualityFilter

    extractor, gopher = Trafilatura(), GopherQualityFilter()
    decoded = [html.decode("utf-8", errors="replace") for html in pages]  # datatrove's readers hand it str

    def run():
        kept = 0
        for i, html in enumerate(decoded):
            text = extractor.extract(html)
            if text:
                result = gopher.filter(Document(text=text, id=str(i)))
                kept += result is True or (isinstance(result, tuple) and result[0])
        return kept
    return run


def lmlab_minhash(docs: list[str]):
    hasher = MinHasher(NUM_HASHES)
    return lambda: [hasher.signature(shingles(d, NGRAMS)) for d in docs]


def datatrove_minhash(docs: list[str], scratch: Path):
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature

    step = MinhashDedupSignature(output_folder=str(scratch), config=MinhashConfig(
        n_grams=NGRAMS, num_buckets=BUCKETS, hashes_per_bucket=NUM_HASHES // BUCKETS))
    return lambda: [step.get_signature(step.get_shingles(d)) for d in docs]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmlab bench data", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="HTML files, folders or glob patterns")
    parser.add_argument("--pages", type=int, default=3000, help="pages for the resiliparse rows")
    parser.add_argument("--trafilatura-pages", type=int, default=300, help="pages for the trafilatura rows (slower)")
    parser.add_argument("--max-page-mb", type=float, default=1.0,
                        help="leave out larger pages (a book on one page is no web page; trafilatura slows on them)")
    parser.add_argument("--docs", type=int, default=4000, help="1 KB documents for MinHash")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which comparisons to run")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("datatrove") is None:
        print("lmlab bench data: error: the comparison needs datatrove: pip install datatrove spacy 'xxhash<4'",
              file=sys.stderr)
        return 2
    try:
        pages = html_pages(args.paths, args.pages, args.max_page_mb * 1e6)
    except ConfigError as err:
        print(f"lmlab bench data: error: {err}", file=sys.stderr)
        return 2
    few = pages[:args.trafilatura_pages]
    mb, few_mb = sum(map(len, pages)) / 1e6, sum(map(len, few)) / 1e6
    extract = EXTRACTORS.build("resiliparse")
    docs = one_kb_documents([t for t in map(extract, pages) if t], args.docs)
    print(f"{len(pages)} pages ({mb:.1f} MB of HTML); trafilatura rows on the first {len(few)} ({few_mb:.1f} MB); "
          f"{len(docs)} documents of ~1 KB for MinHash; medians of {args.repeats}", file=sys.stderr)

    results = {}
    if "resiliparse" in args.parts:
        fast = interleaved_medians({"lmlab resiliparse + py3langid + gopher": lmlab_pass(pages, "resiliparse")},
                                   args.repeats)
        results.update({name: {"MB/s": mb / s} for name, s in fast.items()})
    if "trafilatura" in args.parts:
        slow = interleaved_medians({"lmlab trafilatura + py3langid + gopher": lmlab_pass(few, "trafilatura"),
                                    "datatrove trafilatura + gopher (no language ID)": datatrove_pass(few)},
                                   args.repeats)
        results.update({name: {"MB/s": few_mb / s} for name, s in slow.items()})
    if "minhash" in args.parts:
        with tempfile.TemporaryDirectory() as scratch:
            hashing = interleaved_medians({"lmlab minhash": lmlab_minhash(docs),
                                           "datatrove minhash": datatrove_minhash(docs, Path(scratch))}, args.repeats)
        results.update({name: {"docs/s": len(docs) / s} for name, s in hashing.items()})

    print("| pipeline (one core) | MB of HTML/s | 1 KB docs/s |\n|---|---:|---:|")
    for name, r in results.items():
        mb_s, docs_s = r.get("MB/s"), r.get("docs/s")
        print(f"| {name} | {f'{mb_s:.2f}' if mb_s else ''} | {f'{docs_s:,.0f}' if docs_s else ''} |")
    for kind, unit in (("trafilatura", "MB/s"), ("minhash", "docs/s")):
        pair = [r[unit] for name, r in results.items() if kind in name]
        if len(pair) == 2:
            print(f"lmlab / datatrove, {kind}: {pair[0] / pair[1]:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"pages": len(pages), "html_mb": mb, "docs": len(docs), "results": results},
                                        indent=1))
    return 0
