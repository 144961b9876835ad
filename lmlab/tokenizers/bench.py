"""Benchmark: lmlab's BPE against Hugging Face `tokenizers` and tiktoken, in one run.

    python -m lmlab.tokenizers.bench [FILE] [--vocab-size 8192] [--repeats 3]
    lmlab bench tokenizer [FILE] ...

FILE defaults to the built-in corpus: the text of the `pydocs` data source (the CPython
documentation that ships with Python), written to a temporary file.

Training: lmlab's `train_bpe` and HF's BpeTrainer (ByteLevel pre-tokenizer, same vocab size and
special token) on the same file; medians of `repeats` runs after one warm-up run each.
Memory: tracemalloc's peak of Python allocations during one lmlab training run.
Encoding (MB/s of UTF-8 input, medians): lmlab's encoder (tiktoken core with lmlab's ranks,
whole text), lmlab streaming (`encode_iterable` over lines), lmlab pure Python (cold cache), HF
`encode_batch` over lines, and tiktoken's own `encode_ordinary` (whole text) with lmlab's ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import tracemalloc
from pathlib import Path

from lmlab.timing import median_time
from lmlab.tokenizers.bpe import BPETokenizer
from lmlab.tokenizers.bpe_train import train_bpe

BUILTIN_CORPUS = "pydocs"  # a data source that needs no download
EOT = "<|endoftext|>"


def train_hf(path: Path, vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train([str(path)], trainer)
    return hf


def write_builtin_corpus(folder: Path) -> Path:
    """The built-in corpus as one UTF-8 file in `folder`, its documents separated by blank lines."""
    from lmlab.data.sources import SOURCES

    path = folder / f"{BUILTIN_CORPUS}.txt"
    path.write_text("\n\n".join(SOURCES.build(BUILTIN_CORPUS).documents()), encoding="utf-8")
    return path


def run(path: Path, vocab_size: int, repeats: int, name: str | None = None) -> dict:
    size_mb = path.stat().st_size / 1e6
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    r: dict = {"file": name or str(path), "mb": size_mb, "vocab_size": vocab_size, "repeats": repeats}

    r["lmlab_train_s"], (vocab, merges) = median_time(lambda: train_bpe(path, vocab_size, [EOT]), repeats)
    r["hf_train_s"], hf = median_time(lambda: train_hf(path, vocab_size), repeats)
    r["train_ratio"] = r["lmlab_train_s"] / r["hf_train_s"]

    tracemalloc.start()
    train_bpe(path, vocab_size, [EOT])
    r["lmlab_train_peak_mb"] = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    r["peak_over_file"] = r["lmlab_train_peak_mb"] / size_mb

    tok = BPETokenizer(vocab, merges, [EOT])
    encoders = {
        "lmlab (tiktoken core)": lambda: tok.encode(text),
        "lmlab encode_iterable": lambda: sum(1 for _ in tok.encode_iterable(lines)),
        "lmlab pure Python": lambda: BPETokenizer(vocab, merges, [EOT], use_tiktoken=False).encode(text),
        "HF tokenizers encode_batch": lambda: hf.encode_batch(lines),
    }
    if tok.uses_tiktoken:  # the Rust core alone, without lmlab's special-token split
        encoders["tiktoken encode_ordinary"] = lambda: tok._fast.encode_ordinary(text)
    r["encode_mb_s"] = {name: size_mb / median_time(fn, repeats)[0] for name, fn in encoders.items()}
    return r


def report(r: dict) -> str:
    lines = [
        f"{r['file']} ({r['mb']:.2f} MB), vocab {r['vocab_size']}, medians of {r['repeats']} runs after warm-up",
        "",
        "training                      seconds",
        f"  lmlab train_bpe             {r['lmlab_train_s']:7.3f}",
        f"  HF tokenizers BpeTrainer    {r['hf_train_s']:7.3f}",
        f"  ratio lmlab / HF            {r['train_ratio']:7.2f}x   (target: <= 5x)",
        f"  lmlab peak memory           {r['lmlab_train_peak_mb']:7.2f} MB = {r['peak_over_file']:.1f}x the file "
        "(target: < 10x; tracemalloc peak)",
        "",
        "encoding                        MB/s",
    ]
    lines += [f"  {name:<30}{mbs:7.2f}" for name, mbs in r["encode_mb_s"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmlab bench tokenizer", description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", type=Path,
                        help=f"UTF-8 text (default: the built-in corpus, the text of data={BUILTIN_CORPUS})")
    parser.add_argument("--vocab-size", type=int, default=8192,
                        help="(default 8192: the built-in corpus has merges for about 9,200 tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.file is not None and not args.file.is_file():
        print(f"lmlab bench tokenizer: error: {args.file} is not a file; give a UTF-8 text file", file=sys.stderr)
        return 2
    try:
        import tokenizers  # noqa: F401  (the reference must be there before minutes of work)
    except ImportError:
        print("lmlab bench tokenizer: error: needs Hugging Face `tokenizers`: pip install tokenizers", file=sys.stderr)
        return 2
    if args.file is None:
        with tempfile.TemporaryDirectory(prefix="lmlab-bench-") as tmp:
            results = run(write_builtin_corpus(Path(tmp)), args.vocab_size, args.repeats, f"data={BUILTIN_CORPUS}")
    else:
        results = run(args.file, args.vocab_size, args.repeats)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
