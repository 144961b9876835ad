"""The alignment experiment's table and curves as collect.sh gathers them from a run.sh output folder: held-out test accuracy of the
SFT model and of each post-training method over seeds (mean and spread), rollout tokens/s against plain
decoding, and the rollouts' reward and response length per step (PNG).

    python experiments/alignment/plot.py DIR   # DIR from collect.sh; writes DIR/table.md, curves.png, length.png
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHODS = {"grpo": "GRPO (grpo_clip)", "dr_grpo": "Dr. GRPO (dr_grpo)", "ppo": "PPO (ppo + critic)", "dpo": "DPO"}
RL = ("grpo", "dr_grpo", "ppo")
SMOOTH = 10  # steps per trailing mean of the noisy per-step curves


def curves(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Each logged metric of a run as (step, value) pairs, from its metrics.csv (collect.sh names it <run>.csv).
    A run started again in the same folder appends to that file: only the last run's rows count."""
    rows = list(csv.DictReader(run.read_text().splitlines()))
    steps = [int(row["step"]) for row in rows]
    starts = [i for i, step in enumerate(steps) if i == 0 or step < steps[i - 1]]
    series = defaultdict(list)
    for row in rows[starts[-1]:]:
        for key, value in row.items():
            if key != "step" and value not in ("", None):
                series[key].append((int(row["step"]), float(value)))
    return series


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.1f}%"
    return (f"{100 * statistics.mean(values):.1f}% ({len(values)} seeds: min {100 * min(values):.1f}, "
            f"max {100 * max(values):.1f})")


def groups(out: Path, ev: dict) -> dict[str, list[str]]:
    """Run names by group: a method, with the TAG that run.sh appended for a sweep, without its "-seed". A method
    is the longest METHODS name the group starts with (dr_grpo_600 is Dr. GRPO's, tag 600)."""
    names = {p.stem for p in out.glob("*.csv")} | set(ev)
    found = defaultdict(list)
    for name in sorted(names):
        group = name.rsplit("-", 1)[0]
        if method_of(group):
            found[group].append(name)
    order = list(METHODS)
    return dict(sorted(found.items(), key=lambda item: (order.index(method_of(item[0])), len(item[0]), item[0])))


def method_of(group: str) -> str | None:
    return next((m for m in sorted(METHODS, key=len, reverse=True) if group == m or group.startswith(m + "_")), None)


def label(group: str) -> str:
    method = method_of(group)
    return METHODS[method] + (f" [{group[len(method) + 1:]}]" if group != method else "")


def main() -> None:
    out = Path(sys.argv[1])
    ev = {p.stem: json.loads(p.read_text()) for p in (out / "eval").glob("*.json")}
    sft = ev["sft"]["accuracy"]
    by_group = groups(out, ev)
    runs = {group: {name: curves(out / f"{name}.csv") for name in names if (out / f"{name}.csv").exists()}
            for group, names in by_group.items()}
    lines = ["| model | steps | test accuracy, greedy (mean over seeds) | gain over SFT (points) |",
             "|---|---:|---|---|", f"| SFT | | {100 * sft:.1f}% | |"]
    for group, names in by_group.items():
        accs = [ev[name]["accuracy"] for name in names if name in ev]
        steps = sorted({max((s for s, _ in run.get("train/loss", [])), default=-1) + 1  # steps count from 0
                        for run in runs[group].values()})
        if accs:
            lines.append(f"| {label(group)} | {'/'.join(map(str, steps))} | {spread(accs)} | "
                         f"{100 * (statistics.mean(accs) - sft):+.1f} |")
    rl = {group: list(seeds.values()) for group, seeds in runs.items() if method_of(group) in RL}
    rollout = [v for seeds in rl.values() for run in seeds for _, v in run.get("train/rollout_tokens_per_s", [])]
    plain = ev.get("sft-samples", {})
    if rollout and plain:
        lines += ["", f"Rollout tokens/s per run (median over every RL step, sampling plus the rollout log-probs' forward; "
                  "runs side by side share the GPU): "
                  f"{statistics.median(rollout):,.0f}; plain sampling of the SFT model on the same engine, "
                  f"{plain.get('batch', 128)} responses at a time (evaluate.py): {plain['tokens_per_s']:,.0f}."]
    for name in ("sft-test-samples", "sft-samples"):
        if "pass@8" in ev.get(name, {}):
            e = ev[name]
            lines.append(f"SFT model, 8 samples per {e['data'].rsplit('/', 1)[-1]} prompt at temperature "
                         f"{e['temperature']}: {100 * e['accuracy']:.1f}% correct, pass@8 {100 * e['pass@8']:.1f}%.")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    panels = [("train/reward_mean", "rollout reward (mean)"), ("val/accuracy", "held-out accuracy (greedy)"),
              ("train/response_length", "response length (tokens)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (key, title) in zip(axes, panels):
        band(ax, rl, key, smooth=1 if key.startswith("val/") else SMOOTH)
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)

    # The length bias: GRPO's per-response mean lets wrong answers grow long; Dr. GRPO's constant does not.
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, key, title in zip(axes, ("train/response_length_correct", "train/response_length_incorrect"),
                              ("correct responses", "incorrect responses")):
        band(ax, rl, key, smooth=SMOOTH)
        ax.set_title(f"response length (tokens), {title}")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "length.png", dpi=120)


def band(ax, runs: dict[str, list[dict]], key: str, smooth: int) -> None:
    """Per group of RL runs: the mean over its seeds' `curves` of `key` (a trailing mean over `smooth` steps) and
    its min-max band."""
    for i, (group, seeds) in enumerate(runs.items()):
        series = [dict(moving_mean(run.get(key, []), smooth)) for run in seeds]
        steps = sorted(set.intersection(*(set(r) for r in series))) if series and all(series) else []
        if not steps:
            continue
        values = [[r[t] for r in series] for t in steps]
        ax.plot(steps, [statistics.mean(v) for v in values], color=f"C{i}", label=f"{label(group)}, {len(series)} seeds")
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=f"C{i}", alpha=0.2)
    ax.set_xlabel(f"optimizer step{f' (mean of the last {smooth})' if smooth > 1 else ''}")


def moving_mean(series: list[tuple[int, float]], width: int) -> list[tuple[int, float]]:
    """Each step's trailing mean over `width` values, skipping NaN (a batch with no correct response has no
    correct length)."""
    finite = [(step, value) for step, value in series if not math.isnan(value)]
    return [(step, statistics.mean(v for _, v in finite[max(0, i - width + 1):i + 1]))
            for i, (step, _) in enumerate(finite)]

if __name__ == "__main__":
    main()
