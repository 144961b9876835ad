"""A corpus large enough that a scaling sweep does not repeat it, from what every machine here has offline:
the Python source of the interpreter's standard library and installed packages (torch, transformers,
numpy, ... on the GPU machine). Files are read in sorted path order, exact duplicates dropped (by content
hash), each file's text followed by the end-of-text token, until --mb megabytes; a sample of the first
--sample-mb goes to a second file for training the tokenizer.

    python experiments/scaling-laws/make_corpus.py OUT_DIR [--mb 100] [--sample-mb 10]
"""

from __future__ import annotations

import argparse
import hashlib
import sysconfig
from pathlib import Path

EOT = "<|endoftext|>"


def sources() -> list[Path]:
    roots = {Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "purelib", "platlib")}
    files = {p.resolve() for root in roots if root.is_dir() for p in root.rglob("*.py")}
    return sorted(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in megabytes (1e6 bytes of UTF-8)")
    parser.add_argument("--sample-mb", type=float, default=10.0, help="the tokenizer's training sample")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seen, size, files = set(), 0, 0
    limit, sample_limit = int(args.mb * 1e6), int(args.sample_mb * 1e6)
    with (args.out / "corpus.txt").open("w", encoding="utf-8") as corpus, \
            (args.out / "sample.txt").open("w", encoding="utf-8") as sample:
        for path in sources():
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            digest = hashlib.sha1(text.encode()).digest()
            if not text.strip() or digest in seen or EOT in text:
                continue
            seen.add(digest)
            piece = text + EOT
            corpus.write(piece)
            if size < sample_limit:
                sample.write(piece)
            size += len(piece.encode())
            files += 1
            if size >= limit:
                break
    print(f"{args.out / 'corpus.txt'}: {size / 1e6:.1f} MB from {files} Python files "
          f"({len(sources())} found); tokenizer sample {min(size, sample_limit) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
