"""A corpus large enough that a scaling sweep does not repeat it, from what every machine here has offline: the
source files of the interpreter's standard library and installed packages (torch, transformers, numpy, ... on
the GPU machine) and of /usr/include: Python mostly, with C, C++, CUDA and the packages' Markdown and
reStructuredText. Exact duplicates (by content hash) and files over 1 MB (generated tables) are dropped; the
rest are taken in an order shuffled by a hash of their path, so that the held-out last 5% (lmlab's validation
split) is drawn from the same mix as the training part rather than being the last package alphabetically.

Writes OUT/corpus.jsonl (one source file a line, {"text": ...}: lmlab's token cache streams it document by
document) up to --mb megabytes, and OUT/sample.jsonl, its first --sample-mb, to train the tokenizer on.

    python experiments/scaling-laws/make_corpus.py OUT_DIR [--mb 100] [--sample-mb 10]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

EOT = "<|endoftext|>"
SUFFIXES = (".py", ".pyi", ".pyx", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh", ".md", ".rst")
MAX_FILE_BYTES = 1_000_000


def sources(suffixes: tuple[str, ...]) -> list[Path]:
    roots = {Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "purelib", "platlib")}
    roots.add(Path("/usr/include"))
    files = {p.resolve() for root in roots if root.is_dir() for p in root.rglob("*") if p.suffix in suffixes}
    return sorted(files, key=lambda p: hashlib.sha1(str(p).encode()).digest())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in megabytes (1e6 bytes of UTF-8)")
    parser.add_argument("--sample-mb", type=float, default=10.0, help="the tokenizer's training sample")
    parser.add_argument("--suffixes", default=",".join(SUFFIXES), help="file types to read (comma-separated)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    files = sources(tuple(args.suffixes.split(",")))
    seen, size, taken = set(), 0, 0
    limit, sample_limit = int(args.mb * 1e6), int(args.sample_mb * 1e6)
    with (args.out / "corpus.jsonl").open("w", encoding="utf-8") as corpus, \
            (args.out / "sample.jsonl").open("w", encoding="utf-8") as sample:
        for path in files:
            try:
                if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                    continue
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            digest = hashlib.sha1(text.encode()).digest()
            if not text.strip() or digest in seen or EOT in text:
                continue
            seen.add(digest)
            line = json.dumps({"text": text}) + "\n"
            corpus.write(line)
            if size < sample_limit:
                sample.write(line)
            size += len(text.encode())
            taken += 1
            if size >= limit:
                break
    print(f"{args.out / 'corpus.jsonl'}: {size / 1e6:.1f} MB from {taken} of {len(files)} source files; "
          f"tokenizer sample {min(size, sample_limit) / 1e6:.1f} MB")
    if size < limit:
        sys.exit(f"make_corpus: only {size / 1e6:.1f} MB of text found, fewer than --mb {args.mb:g}: a sweep on it "
                 "would repeat its data; lower --mb or add --suffixes")


if __name__ == "__main__":
    main()
