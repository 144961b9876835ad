"""`lmlab-compare DIR --over seed`: runs that differ only in the named overrides (seeds, say) as one row each.

A comparison of two settings from one seed each cannot tell a difference from run-to-run noise. Swept over seeds
(`lmlab-train -m seed=0,1,2 ...`), each setting's runs make a group: its table row gives the number of runs and the
mean and sample standard deviation of each final value, and its plot line is the mean over the group's runs with
their minimum-maximum band, over a panel of each run less the first group's run of the same seed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from lmlab.cli.compare import Run, differing_keys, line_style, markdown_table, save_png

FINAL_TAGS = ("train/loss", "val/loss", "val/bpb")


@dataclass
class Group:
    overrides: dict[str, str]  # the overrides its runs share, among those that differ between groups
    runs: list[Run]

    def finals(self, tag: str) -> list[float]:
        return [value for run in self.runs if (value := run.final(tag)) is not None]

    def failed(self) -> int:
        return sum(run.error is not None for run in self.runs)


def group_runs(runs: list[Run], over: list[str]) -> list[Group]:
    """Runs that agree on every differing override but those in `over`, in the order of their first run."""
    keys = [k for k in differing_keys(runs) if k not in over]
    groups: dict[tuple[str, ...], Group] = {}
    for run in runs:
        values = tuple(run.overrides.get(k, "") for k in keys)
        groups.setdefault(values, Group(dict(zip(keys, values)), [])).runs.append(run)
    return list(groups.values())


def _mean_sd(values: list[float], sign: str = "") -> str:
    """'mean ± sd' to four decimals (`sign="+"` writes a difference's sign); '-' for no values."""
    if not values:
        return "-"
    mean = format(statistics.mean(values), f"{sign}.4f")
    return mean if len(values) == 1 else f"{mean} ± {statistics.stdev(values):.4f}"


def _paired(group: Group, first: Group, over: list[str], tag: str) -> list[float]:
    """`tag`'s final value of each run less that of `first`'s run with the same values of `over` (the same seed)."""
    key = lambda run: tuple(run.overrides.get(k) for k in over)
    reference = {key(run): value for run in first.runs if (value := run.final(tag)) is not None}
    return [value - reference[key(run)] for run in group.runs
            if (value := run.final(tag)) is not None and key(run) in reference]


def group_table(groups: list[Group], over: list[str], metric: str = "val/loss") -> str:
    """One row per group; each final value as mean ± sample standard deviation, and `metric` also paired with the
    first group's run of the same seed: a difference that the seeds' spread would hide can show there."""
    keys = list(groups[0].overrides)
    evals = sorted({tag for g in groups for r in g.runs for tag in r.scalars if tag.startswith("eval/")})
    failed = any(g.failed() for g in groups)
    header = [*keys, "runs", *FINAL_TAGS, *evals, f"{metric} less the first's, same {'/'.join(over)}", "tokens/s",
              *(["failed"] if failed else [])]
    rows = []
    for g in groups:
        speeds = [s for run in g.runs if (s := run.median("perf/tokens_per_s")) is not None]
        finals = [_mean_sd(g.finals(tag)) for tag in (*FINAL_TAGS, *evals)]
        paired = _mean_sd(_paired(g, groups[0], over, metric), "+")
        rows.append([*g.overrides.values(), str(len(g.runs)), *finals, paired,
                     f"{statistics.median(speeds):,.0f}" if speeds else "-", *([str(g.failed())] if failed else [])])
    return markdown_table(header, rows)


def _label(group: Group) -> str:
    return ", ".join(f"{k}={v}" for k, v in group.overrides.items() if v) or "defaults"


@dataclass
class Curves:
    """One group's runs of a scalar over the steps that all of them logged, each run keyed by its values of `over`."""

    steps: list[int]
    runs: dict[tuple, list[float]]

    def per_step(self) -> list[tuple[float, ...]]:
        return list(zip(*self.runs.values()))

    def less(self, first: Curves) -> tuple[list[int], list[list[float]]]:
        """Each run less `first`'s run with the same values of `over`, at the steps both logged: (steps, per step
        the differences); runs without a partner in `first` are left out."""
        paired = [key for key in self.runs if key in first.runs]
        if not paired:
            return [], []
        at = {s: i for i, s in enumerate(first.steps)}
        shared = [(j, at[s], s) for j, s in enumerate(self.steps) if s in at]
        return ([s for *_, s in shared],
                [[self.runs[key][j] - first.runs[key][i] for key in paired] for j, i, _ in shared])


def group_curves(groups: list[Group], over: list[str], tag: str) -> dict[str, Curves]:
    """Each group that logged `tag`, by its label."""
    curves = {}
    for group in groups:
        runs = {tuple(run.overrides.get(k) for k in over): dict(run.scalars[tag])
                for run in group.runs if run.scalars.get(tag)}
        steps = sorted(set.intersection(*(set(c) for c in runs.values()))) if runs else []
        if steps:
            curves[_label(group)] = Curves(steps, {key: [c[s] for s in steps] for key, c in runs.items()})
    return curves


def plot_groups(groups: list[Group], path: Path, over: list[str], tag: str = "val/loss") -> Path | None:
    """Each group's mean curve of `tag` with its runs' min-max band; below, each run less the first group's run of
    the same seed (the same values of `over`), where settings a percent apart, which look alike above, separate:
    the mean of those differences and their min-max band."""
    from matplotlib.figure import Figure

    curves = group_curves(groups, over, tag)
    if not curves:
        return None
    fig = Figure(figsize=(8, 8))
    top, bottom = fig.subplots(2, 1, sharex=True)
    first_label, first = next(iter(curves.items()))

    def band(ax, xs, per_step, **style):
        line, = ax.plot(xs, [statistics.mean(v) for v in per_step], **style)
        ax.fill_between(xs, [min(v) for v in per_step], [max(v) for v in per_step], color=line.get_color(),
                        alpha=0.2, linewidth=0)
        return line.get_color()

    for i, (label, curve) in enumerate(curves.items()):
        style = line_style(i)
        color = band(top, curve.steps, curve.per_step(), label=f"{label} ({len(curve.runs)} runs)", **style)
        xs, differences = curve.less(first)
        if xs:
            band(bottom, xs, differences, color=color, **style)
    top.set(ylabel=tag, title=f"{tag}, mean and min-max over runs: {path.parent.name}")
    bottom.set(xlabel="step", ylabel=f"{tag}, less the same {'/'.join(over)}'s run of the first")
    bottom.set_title(f"less the first: {first_label}", fontsize=9)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(fontsize=8)
    return save_png(fig, path)
