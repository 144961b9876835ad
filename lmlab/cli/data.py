"""The data stage's verbs.

    lmlab data run pipeline=web input=crawl/*.warc.gz output=data/clean [executor=ray] [format=parquet]
    lmlab data run pipeline=text input=[a.jsonl,b.jsonl] output=data/dedup pipeline.stages=[exact_dedup,minhash]
    lmlab data train-classifier TRAIN.txt --out MODEL.pt [--valid VALID.txt]

`run` runs a pipeline (conf/pipeline/NAME.yaml: a reader and stages, lmlab.curation.pipeline) over the input
files, sharded and resumable, and prints each stage's funnel; `data=text_files data.paths=[OUTPUT/shards]` trains
on its JSONL output. `train-classifier` trains a fastText-style text classifier (lmlab.curation.classifier) from
fastText-format examples (`__label__NAME text` a line), for the `classifier` filter (`lmlab list filter`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from lmlab.curation.pipeline import PipelineConfig
from lmlab.errors import ConfigError


@dataclass
class DataRunConfig:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # pipeline=NAME: conf/pipeline/NAME.yaml
    executor: Any = field(default_factory=dict)  # executor=local|ray (lmlab list executor)
    input: Any = None  # a file, folder or glob pattern, or a list of them
    output: str | None = None  # the output folder
    format: str = "jsonl"  # jsonl | parquet
    files_per_shard: int = 1  # input files per shard: a shard is one task, one output file, one resume unit
    overwrite: bool = False  # replace another pipeline's output in `output`
    plugins: list[str] = field(default_factory=list)  # modules imported before the config is composed


ConfigStore.instance().store(name="data_run_schema", node=DataRunConfig)


def cmd_run(args: argparse.Namespace) -> int:
    from lmlab.cli.compose import compose_config
    from lmlab.curation.executors import EXECUTORS
    from lmlab.curation.funnel import funnel_table, plot_funnel
    from lmlab.curation.pipeline import Run, input_files

    if stray := [a for a in args.settings if "=" not in a]:
        raise ConfigError(f"unexpected argument '{stray[0]}': arguments are KEY=VALUE (lmlab data run --help)")
    composed = compose_config(args.settings, config_name="data_run")
    cfg: DataRunConfig = OmegaConf.to_object(composed)
    if cfg.input is None or cfg.output is None:
        raise ConfigError("lmlab data run needs input=FILES (a file, folder, glob or list) and output=FOLDER")
    patterns = [cfg.input] if isinstance(cfg.input, str) else list(cfg.input)
    run = Run(cfg.pipeline, input_files(patterns), Path(cfg.output), cfg.format, cfg.files_per_shard)
    executor = EXECUTORS.build(composed.executor)
    run.claim(cfg.overwrite)
    print(f"{len(run.files)} input files in {len(run.shards)} shards; stages: read, {', '.join(run.labels)}; "
          f"{len(run.segments)} segments on executor {composed.executor.name}", file=sys.stderr)
    start = time.perf_counter()
    stats = run.execute(executor)
    (run.out / "stats.json").write_text(json.dumps({k: v.to_dict() for k, v in stats.items()}, indent=1))
    plot_funnel(stats, run.out / "funnel.png", f"{cfg.output}: {len(run.files)} input files")
    print(funnel_table(stats))
    print(f"done in {time.perf_counter() - start:.1f} s: {run.out}/shards, stats.json, funnel.png", file=sys.stderr)
    return 0


def cmd_train_classifier(args: argparse.Namespace) -> int:
    from lmlab.curation.classifier import ClassifierConfig, TextClassifier, read_labelled

    cfg = ClassifierConfig(**{f.name: getattr(args, f.name) for f in fields(ClassifierConfig)})  # checked first
    examples = read_labelled(args.train)
    valid = read_labelled(args.valid) if args.valid else []
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
    p_run = sub.add_parser("run", help="run a pipeline (conf/pipeline/) over input files into sharded output",
                           description="lmlab data run pipeline=NAME input=FILES output=FOLDER [executor=local|ray] "
                                       "[format=jsonl|parquet] [files_per_shard=1] [overwrite=false] [KEY=VALUE ...]")
    p_run.add_argument("settings", nargs="*", help="KEY=VALUE settings and overrides")
    p_run.set_defaults(func=cmd_run)
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
