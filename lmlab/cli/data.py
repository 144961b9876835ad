"""`lmlab data train-classifier TRAIN.txt --out MODEL.pt [--valid VALID.txt]`: a fastText-style text classifier
(lmlab.curation.classifier) from fastText-format examples (`__label__NAME text` a line), for the `classifier`
filter (`lmlab list filter`)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields
from pathlib import Path

from lmlab.errors import ConfigError


def cmd_train_classifier(args: argparse.Namespace) -> int:
    from lmlab.curation.classifier import ClassifierConfig, TextClassifier, read_labelled

    examples = read_labelled(args.train)
    valid = read_labelled(args.valid) if args.valid else []
    cfg = ClassifierConfig(**{f.name: getattr(args, f.name) for f in fields(ClassifierConfig)})
    start = time.perf_counter()
    clf = TextClassifier.train(examples, cfg)
    print(f"trained on {len(examples)} examples of labels {', '.join(clf.labels)} in {time.perf_counter() - start:.1f} s;"
          f" training accuracy {clf.accuracy(examples):.3f}"
          + (f", validation accuracy {clf.accuracy(valid):.3f} ({len(valid)} examples)" if valid else ""))
    print(f"saved {clf.save(args.out)}")
    return 0


def main(argv: list[str]) -> int:
    from lmlab.curation.classifier import ClassifierConfig

    parser = argparse.ArgumentParser(prog="lmlab data", description="the data stage's tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train-classifier", help="a fastText-style classifier from __label__-prefixed lines")
    p_train.add_argument("train", type=Path, help="fastText-format examples: `__label__NAME text` a line")
    p_train.add_argument("--out", type=Path, required=True, help="the model file to write (e.g. quality.pt)")
    p_train.add_argument("--valid", type=Path, help="held-out examples whose accuracy is printed")
    for f in fields(ClassifierConfig):
        p_train.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(f.default), default=f.default)
    p_train.set_defaults(func=cmd_train_classifier)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"lmlab data: error: {err}", file=sys.stderr)
        return 2
