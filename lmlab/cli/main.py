"""`lmlab`: the catalogue of registered parts (`lmlab list [GROUP]`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys

from lmlab.catalog import load_catalog
from lmlab.errors import ConfigError
from lmlab.registry import Entry, Registry, unknown_name_message


def _field_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        default = repr(f.default)
    elif f.default_factory is not dataclasses.MISSING:
        default = repr(f.default_factory())
    else:
        default = "required"
    type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return f"{f.name}: {type_name} = {default}"


def format_entry(entry: Entry, width: int) -> list[str]:
    lines = [f"  {entry.name:<{width}}  {entry.doc}"]
    fields = entry.fields()
    lines += [f"  {'':<{width}}    {_field_text(f)}" for f in fields] or [f"  {'':<{width}}    (no fields)"]
    return lines


def format_registry(registry: Registry) -> str:
    entries = list(registry)
    width = max((len(e.name) for e in entries), default=0)
    header = f"{registry.name}  (config group '{registry.group}': {registry.doc})"
    return "\n".join([header] + [line for e in entries for line in format_entry(e, width)])


def cmd_list(args: argparse.Namespace) -> int:
    registries = load_catalog(args.plugin)
    if args.group is None:
        print("\n\n".join(format_registry(r) for r in registries.values()))
        return 0
    by_name = {**{r.group: r for r in registries.values()}, **registries}
    if args.group not in by_name:
        print(f"lmlab list: error: {unknown_name_message('registry group', args.group, registries)}", file=sys.stderr)
        return 2
    print(format_registry(by_name[args.group]))
    return 0


# `lmlab bench NAME ...` runs the `main(argv)` of the module named here.
BENCHMARKS = {"tokenizer": "lmlab.tokenizers.bench", "moe": "lmlab.nn.moe.bench", "comm": "lmlab.parallel.comm_bench",
              "parallel": "lmlab.parallel.bench", "train": "lmlab.training.bench",
              "kernels": "lmlab.kernels.bench"}


def cmd_bench(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.name]).main(args.args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmlab", description="lmlab: language models from scratch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="registered parts by group, with their config fields")
    p_list.add_argument("group", nargs="?", help="one group, by registry name (norm) or config group (model/norm)")
    p_list.add_argument("--plugin", action="append", default=[], help="also import this plugin module")
    p_list.set_defaults(func=cmd_list)
    p_info = sub.add_parser("info", help="cost model of a training config: parameters, FLOPs, KV cache, time",
                            add_help=False)
    p_info.add_argument("args", nargs=argparse.REMAINDER)
    p_info.set_defaults(func=lambda args: importlib.import_module("lmlab.cli.info").main(args.args))
    p_lr = sub.add_parser("plot-lr", help="PNG of the learning-rate schedule a training config would use",
                          add_help=False)
    p_lr.add_argument("args", nargs=argparse.REMAINDER)
    p_lr.set_defaults(func=lambda args: importlib.import_module("lmlab.cli.plot_lr").main(args.args))
    p_upcycle = sub.add_parser("upcycle", help="dense checkpoint -> MoE checkpoint whose experts copy the FFN",
                               add_help=False)
    p_upcycle.add_argument("args", nargs=argparse.REMAINDER)
    p_upcycle.set_defaults(func=lambda args: importlib.import_module("lmlab.cli.upcycle").main(args.args))
    p_bench = sub.add_parser("bench", help="benchmarks that compare lmlab with its reference in one run")
    p_bench.add_argument("name", choices=sorted(BENCHMARKS))
    p_bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark (try --help)")
    p_bench.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"lmlab {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
