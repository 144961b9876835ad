"""`lmlab-compare DIR`: a table and a plot of the runs under a (multi)run folder.

A run is any folder with Hydra's `.hydra/overrides.yaml` and TensorBoard events under `tb/`.
The table shows the overrides that differ between runs, the final train/val loss, val bpb
and the median tokens/s; the plot of validation loss is written next to the runs.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

SCALARS = ("train/loss", "val/loss", "val/bpb", "perf/tokens_per_s")


@dataclass
class Run:
    path: Path
    overrides: dict[str, str]
    scalars: dict[str, list[tuple[int, float]]]  # tag -> (step, value), in step order

    def final(self, tag: str) -> float | None:
        return self.scalars[tag][-1][1] if self.scalars.get(tag) else None

    def median(self, tag: str) -> float | None:
        return statistics.median(v for _, v in self.scalars[tag]) if self.scalars.get(tag) else None


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS as KIND, EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={KIND: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()[KIND]}


def _natural_key(path: Path) -> list:
    """Job folders in numeric order: 2 before 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def find_runs(root: Path) -> list[Run]:
    runs = []
    for overrides_file in sorted(root.rglob(".hydra/overrides.yaml"), key=_natural_key):
        run_dir = overrides_file.parent.parent
        if not (run_dir / "tb").is_dir():
            continue
        pairs = (str(o).split("=", 1) for o in OmegaConf.load(overrides_file))
        runs.append(Run(run_dir, {k.lstrip("+~"): v for k, v in pairs}, read_scalars(run_dir / "tb")))
    return runs


def differing_keys(runs: list[Run]) -> list[str]:
    keys = sorted({k for r in runs for k in r.overrides})
    if len(runs) == 1:
        return keys
    return [k for k in keys if len({r.overrides.get(k) for r in runs}) > 1]


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(runs: list[Run], root: Path) -> str:
    keys = differing_keys(runs)
    header = ["run", *keys, "train/loss", "val/loss", "val/bpb", "tokens/s"]
    rows = [[str(r.path.relative_to(root)) if r.path != root else ".", *(r.overrides.get(k, "") for k in keys),
             _fmt(r.final("train/loss"), 4), _fmt(r.final("val/loss"), 4), _fmt(r.final("val/bpb"), 4),
             _fmt(r.median("perf/tokens_per_s"), 0)] for r in runs]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def plot(runs: list[Run], path: Path, tag: str = "val/loss") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = differing_keys(runs)
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(runs):
        points = run.scalars.get(tag, [])
        label = ", ".join(f"{k}={run.overrides.get(k, '')}" for k in keys) or run.path.name
        # The colour cycle has 10 colours; a new line style tells the next ten apart.
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=label,
                linestyle=("-", "--", ":", "-.")[i // 10 % 4])
    ax.set(xlabel="step", ylabel=tag, title=f"{tag}: {path.parent.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmlab-compare", description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a multirun folder such as outputs/multirun/2026-11-29/10-00-00")
    parser.add_argument("--metric", default="val/loss", help="scalar to plot (default val/loss)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"lmlab-compare: error: {args.root} is not a folder", file=sys.stderr)
        return 2
    runs = find_runs(args.root)
    if not runs:
        print(f"lmlab-compare: error: no runs (folders with .hydra/overrides.yaml and tb/) under {args.root}",
              file=sys.stderr)
        return 2
    text = table(runs, args.root)
    print(text)
    (args.root / "comparison.md").write_text(text + "\n")
    png = plot(runs, args.root / f"{args.metric.replace('/', '_')}.png", args.metric)
    print(f"\nwrote {args.root / 'comparison.md'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
