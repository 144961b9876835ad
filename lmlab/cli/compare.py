"""`lmlab-compare DIR`: a table and a plot of the runs under a (multi)run folder.

A run is any folder with Hydra's `.hydra/overrides.yaml` and the scalars a logger wrote into it
(TensorBoard events, at any depth; the csv logger's metrics.csv; the mlflow logger's file store),
or an `error.txt` (a failed job of a sweep). The table shows the overrides that differ between
runs, the final train/val loss, val bpb, the median tokens/s and a failed run's error; the plot
of validation loss is written next to the runs, and for MoE runs a grid of each layer's expert
loads over training (`expert_load.png`). `--over seed` averages over seeds instead: one row and one
mean curve per group of runs that differ only in the seed (`compare_over`).
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from lmlab.atomic import atomic_write, atomic_write_text
from lmlab.cli.app import ERROR_FILE
from lmlab.registry import closest

Scalars = dict[str, list[tuple[int, float]]]  # tag -> (step, value), in step order
BOOLS = {"True": "true", "False": "false"}
LOAD_TAG = re.compile(r"moe/(?P<layer>.+)/load/expert(?P<expert>\d+)$")  # logged by MoE layers


@dataclass
class Run:
    path: Path
    overrides: dict[str, str]
    scalars: Scalars
    error: str | None = None  # a failed job's one-line error

    def final(self, tag: str) -> float | None:
        return self.scalars[tag][-1][1] if self.scalars.get(tag) else None

    def median(self, tag: str) -> float | None:
        return statistics.median(v for _, v in self.scalars[tag]) if self.scalars.get(tag) else None


def read_tensorboard(events_file: Path) -> Scalars:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS as KIND, EventAccumulator

    acc = EventAccumulator(str(events_file), size_guidance={KIND: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()[KIND]}


def read_csv(metrics_csv: Path) -> Scalars:
    """Lightning's CSVLogger file: a `step` column and one column per tag, empty where not logged."""
    scalars: Scalars = {}
    with metrics_csv.open(newline="") as f:
        for row in csv.DictReader(f):
            for tag, value in row.items():
                if tag != "step" and value != "":
                    scalars.setdefault(tag, []).append((int(float(row["step"])), float(value)))
    return scalars


def read_mlflow(metrics_dir: Path) -> Scalars:
    """One run's metrics in an MLflow file store: a file per tag (`train/loss` is train/loss), a
    `timestamp value step` line per point."""
    scalars: Scalars = {}
    for path in sorted(p for p in metrics_dir.rglob("*") if p.is_file()):
        rows = (line.split() for line in path.read_text().splitlines() if line.strip())
        scalars[path.relative_to(metrics_dir).as_posix()] = [(int(step), float(value)) for _, value, step in rows]
    return scalars


# What each logger writes locally (a glob under the run folder) and how to read it.
READERS: dict[str, Callable[[Path], Scalars]] = {
    "events.out.tfevents.*": read_tensorboard,  # tb/, or tb/<run_name>/ in a sweep
    "metrics.csv": read_csv,
    "mlruns/*/*/metrics": read_mlflow,
}


def _natural_key(path: Path) -> list:
    """Job folders in numeric order: 2 before 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _overrides(run_dir: Path) -> dict[str, str]:
    pairs = (str(o).split("=", 1) for o in OmegaConf.load(run_dir / ".hydra" / "overrides.yaml"))
    # A sweep records booleans as Python spells them (False), a single run as typed (false).
    return {k.lstrip("+~"): BOOLS.get(v, v) for k, v in pairs}


def _error(run_dir: Path) -> str | None:
    path = run_dir / ERROR_FILE
    return (path.read_text().strip().splitlines() or ["failed"])[0] if path.is_file() else None


def find_runs(root: Path) -> list[Run]:
    """Every run under `root` with scalars or an error, in folder order (2 before 10)."""
    folders = sorted({p.parent.parent for p in root.rglob(".hydra/overrides.yaml")}, key=_natural_key)
    runs = {folder: Run(folder, _overrides(folder), {}, _error(folder)) for folder in folders}
    for pattern, read in READERS.items():
        for path in sorted(root.rglob(pattern), key=_natural_key):
            # A log belongs to the closest run folder above it, should a run hold another.
            run = next((runs[p] for p in path.parents if p in runs), None)
            if run is not None:
                for tag, points in read(path).items():
                    run.scalars.setdefault(tag, []).extend(points)
    for run in runs.values():
        for points in run.scalars.values():
            points.sort(key=lambda point: point[0])  # stable: a resumed run's later write of a step stays last
    return [run for run in runs.values() if run.scalars or run.error]


def differing_keys(runs: list[Run]) -> list[str]:
    keys = sorted({k for r in runs for k in r.overrides})
    if len(runs) == 1:
        return keys
    return [k for k in keys if len({r.overrides.get(k) for r in runs}) > 1]


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(runs: list[Run], root: Path) -> str:
    keys = differing_keys(runs)
    failed = any(r.error for r in runs)
    evals = sorted({tag for r in runs for tag in r.scalars if tag.startswith("eval/")})  # lmlab-train eval=[...]
    header = ["run", *keys, "train/loss", "val/loss", "val/bpb", *evals, "tokens/s", *(["failed"] if failed else [])]
    rows = [[str(r.path.relative_to(root)) if r.path != root else ".", *(r.overrides.get(k, "") for k in keys),
             _fmt(r.final("train/loss"), 4), _fmt(r.final("val/loss"), 4), _fmt(r.final("val/bpb"), 4),
             *(_fmt(r.final(tag), 4) for tag in evals),
             _fmt(r.median("perf/tokens_per_s"), 0), *([(r.error or "").replace("|", "\\|")] if failed else [])]
            for r in runs]
    return markdown_table(header, rows)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _label(run: Run, keys: list[str]) -> str:
    return ", ".join(f"{k}={run.overrides.get(k, '')}" for k in keys) or run.path.name


def line_style(i: int) -> dict:
    """The i-th curve's style: the colour cycle has 10 colours, so a new line style tells the next ten apart."""
    return dict(linestyle=("-", "--", ":", "-.")[i // 10 % 4], marker="o", markersize=3)


def save_png(fig, path: Path, dpi: int = 120) -> Path:
    """Lay the figure out and write it to `path` whole (a reader never sees half a PNG)."""
    fig.tight_layout()
    return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))


def plot(runs: list[Run], path: Path, tag: str = "val/loss") -> Path | None:
    """The curves of `tag`, one per run that logged it; None when none did (e.g. every job failed)."""
    from matplotlib.figure import Figure  # renders with Agg, no display needed

    keys = differing_keys(runs)
    logged = [run for run in runs if run.scalars.get(tag)]
    if not logged:
        return None
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for i, run in enumerate(logged):
        points = run.scalars[tag]
        ax.plot([s for s, _ in points], [v for _, v in points], label=_label(run, keys), **line_style(i))
    ax.set(xlabel="step", ylabel=tag, title=f"{tag}: {path.parent.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_png(fig, path)


def plot_expert_load(runs: list[Run], path: Path) -> Path | None:
    """One row per MoE run, one panel per MoE layer: each expert's share of the tokens over
    training, against the balanced share (dashed). None when no run has expert loads."""
    from matplotlib.figure import Figure

    loads = [(run, [(m["layer"], int(m["expert"]), tag) for tag in run.scalars if (m := LOAD_TAG.match(tag))])
             for run in runs]
    loads = [(run, tags) for run, tags in loads if tags]
    if not loads:
        return None
    layers = sorted({layer for _, tags in loads for layer, _, _ in tags}, key=lambda s: _natural_key(Path(s)))
    keys = differing_keys([run for run, _ in loads])
    fig = Figure(figsize=(2.8 * len(layers), 2.2 * len(loads) + 0.6))
    axes = fig.subplots(len(loads), len(layers), squeeze=False, sharex=True, sharey=True)
    for row, (run, tags) in enumerate(loads):
        for col, layer in enumerate(layers):
            ax = axes[row][col]
            experts = sorted((e, tag) for name, e, tag in tags if name == layer)
            for e, tag in experts:
                ax.plot([s for s, _ in run.scalars[tag]], [v for _, v in run.scalars[tag]], linewidth=1)
            if experts:
                ax.axhline(1 / len(experts), color="black", linestyle="--", linewidth=0.8)
            ax.set_title(layer if row == 0 else "", fontsize=9)
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel(textwrap.fill(_label(run, keys), 28), fontsize=7)
    fig.suptitle(f"expert load (fraction of routed tokens per expert): {path.parent.name}", fontsize=10)
    fig.supxlabel("step", fontsize=9)
    return save_png(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmlab-compare", description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a multirun folder such as outputs/multirun/2026-11-29/10-00-00")
    parser.add_argument("--metric", default="val/loss", help="scalar to plot (default val/loss)")
    parser.add_argument("--over", nargs="+", default=[], metavar="KEY",
                        help="overrides to average over (e.g. seed): one row and one mean curve per group of runs "
                             "that differ only in these")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"lmlab-compare: error: {args.root} is not a folder", file=sys.stderr)
        return 2
    runs = find_runs(args.root)
    if not runs:
        print(f"lmlab-compare: error: no runs under {args.root} (folders with .hydra/overrides.yaml and TensorBoard "
              f"events, a metrics.csv, an mlruns/ store or {ERROR_FILE})", file=sys.stderr)
        return 2
    tags = {tag for run in runs for tag in run.scalars}
    if tags and args.metric not in tags:
        print(f"lmlab-compare: error: no run logged --metric {args.metric}; did you mean {closest(args.metric, tags)}?",
              file=sys.stderr)
        return 2
    swept = {k for run in runs for k in run.overrides}
    if missing := [k for k in args.over if k not in swept]:
        print(f"lmlab-compare: error: --over {' '.join(missing)}: no run sets it; the runs' overrides: "
              f"{', '.join(sorted(swept)) or 'none'}", file=sys.stderr)
        return 2
    plot_path = args.root / f"{args.metric.replace('/', '_')}.png"
    if args.over:
        from lmlab.cli.compare_over import group_runs, group_table, plot_groups

        groups = group_runs(runs, args.over)
        text = group_table(groups, args.over, args.metric)
        curves = plot_groups(groups, plot_path, args.over, args.metric)
    else:
        text, curves = table(runs, args.root), plot(runs, plot_path, args.metric)
    print(text)
    written = [atomic_write_text(args.root / "comparison.md", text + "\n"), curves,
               plot_expert_load(runs, args.root / "expert_load.png")]
    print(f"\nwrote {', '.join(str(path) for path in written if path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
