"""`lmlab`: the catalogue of config sections and registered parts (`lmlab list [GROUP]`), benchmarks
(`lmlab bench NAME`) and the verbs that take a training config's overrides or a checkpoint."""

from __future__ import annotations

import argparse
import importlib
import sys

from lmlab.catalog import load_catalog
from lmlab.cli.listing import format_registry, format_section, sections
from lmlab.errors import ConfigError
from lmlab.registry import unknown_name_message


def cmd_list(args: argparse.Namespace) -> int:
    registries = load_catalog(args.plugin)
    groups = {r.group for r in registries.values()}
    all_sections = sections()
    section_paths = {s.path for s in all_sections.values()}
    by_name = {**{r.group: r for r in registries.values()}, **registries}
    wanted = [args.group] if args.group else list(dict.fromkeys([*all_sections, *registries]))  # `data` is both
    shown = [format_section(all_sections[name], groups, section_paths) for name in wanted if name in all_sections]
    shown += [format_registry(by_name[name]) for name in wanted if name in by_name]
    if not shown:
        message = unknown_name_message("group or section", args.group, {*all_sections, *by_name})
        print(f"lmlab list: error: {message}", file=sys.stderr)
        return 2
    print("\n\n".join(shown))
    return 0


# `lmlab bench NAME ...` runs the `main(argv)` of the module named here.
BENCHMARKS = {"tokenizer": "lmlab.tokenizers.bench", "moe": "lmlab.nn.moe.bench", "comm": "lmlab.parallel.comm_bench",
              "parallel": "lmlab.parallel.bench", "train": "lmlab.training.bench",
              "kernels": "lmlab.kernels.bench", "generate": "lmlab.inference.bench",
              "data": "lmlab.curation.bench", "paged-attention": "lmlab.serving.attention_bench", "serve": "lmlab.serving.bench"}


def cmd_bench(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.name]).main(args.args)


# Verbs that parse their own arguments, --help included: `lmlab VERB ARGS...` runs `main(ARGS)` of the module.
VERBS = {
    "info": ("lmlab.cli.info", "cost model of a training config: parameters, FLOPs, KV cache, time"),
    "plot-lr": ("lmlab.cli.plot_lr", "PNG of the learning-rate schedule a training config would use"),
    "upcycle": ("lmlab.cli.upcycle", "dense checkpoint -> MoE checkpoint whose experts copy the FFN"),
    "export-hf": ("lmlab.cli.export_hf", "checkpoint -> Hugging Face Llama model folder"),
    "generate": ("lmlab.cli.generate", "text from a checkpoint or Hugging Face Llama folder, streamed"),
    "serve": ("lmlab.cli.serve", "an OpenAI-compatible HTTP server over a checkpoint (continuous batching)"),
    "eval": ("lmlab.cli.eval", "evaluation tasks (perplexity, MMLU, GSM8K) on a checkpoint"),
    "lm-eval": ("lmlab.cli.lm_eval", "lm-evaluation-harness's command line with lmlab's model `lmlab`"),
    "scaling": ("lmlab.cli.scaling", "scaling-law fits (joint, IsoFLOP, envelope, Kaplan) of a points table"),
    "data": ("lmlab.cli.data", "the data stage's tools: train-classifier (a fastText-style quality/toxicity model)"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmlab", description="lmlab: language models from scratch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="config sections and registered parts, with their fields")
    p_list.add_argument("group", nargs="?", help="a section (top, model, data, trainer) or a group, by registry "
                                                 "name (norm) or config group (model/norm)")
    p_list.add_argument("--plugin", action="append", default=[], help="also import this plugin module")
    p_list.set_defaults(func=cmd_list)
    for verb, (_, help_text) in VERBS.items():
        sub.add_parser(verb, help=f"{help_text} (lmlab {verb} --help)", add_help=False)
    p_bench = sub.add_parser("bench", help="benchmarks that compare lmlab with its reference in one run")
    p_bench.add_argument("name", choices=sorted(BENCHMARKS))
    p_bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark (try --help)")
    p_bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in VERBS:  # before argparse, which would take the verb's own flags for lmlab's
        command, run = argv[0], lambda: importlib.import_module(VERBS[argv[0]][0]).main(argv[1:])
    else:
        args = _parser().parse_args(argv)
        command, run = args.command, lambda: args.func(args)
    try:
        return run()
    except ConfigError as err:
        print(f"lmlab {command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
