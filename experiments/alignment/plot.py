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
    return f"{100 * statistics.mean(values):.1f}% (min {100 * min(values):.1f}, max {100 * max(values):.1f})"


def main() -> None:
    out = Path(sys.argv[1])
    ev = {p.stem: json.loads(p.read_text()) for p in (out / "eval").glob("*.json")}
    sft = ev["sft"]["accuracy"]
    lines = ["| model | test accuracy, greedy (3 seeds: mean, min, max) | gain over SFT (points) |", "|---|---|---|",
             f"| SFT | {100 * sft:.1f}% | |"]
    for method, label in METHODS.items():
        accs = [e["accuracy"] for name, e in sorted(ev.items()) if name.rsplit("-", 1)[0] == method]
        if accs:
            lines.append(f"| {label} | {spread(accs)} | {100 * (statistics.mean(accs) - sft):+.1f} |")
    runs = {method: [curves(run) for run in sorted(out.glob(f"{method}-*.csv"))] for method in RL}  # each seed's
    rollout = [v for seeds in runs.values() for run in seeds for _, v in run.get("train/rollout_tokens_per_s", [])]
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
    others = sorted(name for name in ev if name.rsplit("-", 1)[0] not in METHODS and not name.startswith("sft"))
    if others:
        lines += ["", "Other runs (sweeps): " + ", ".join(f"{name} {100 * ev[name]['accuracy']:.1f}%" for name in others)]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    panels = [("train/reward_mean", "rollout reward (mean)"), ("val/accuracy", "held-out accuracy (greedy)"),
              ("train/response_length", "response length (tokens)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (key, title) in zip(axes, panels):
        band(ax, runs, key, smooth=1 if key.startswith("val/") else SMOOTH)
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)

    # The length bias: GRPO's per-response mean lets wrong answers grow long; Dr. GRPO's constant does not.
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, key, title in zip(axes, ("train/response_length_correct", "train/response_length_incorrect"),
                              ("correct responses", "incorrect responses")):
        band(ax, runs, key, smooth=SMOOTH)
        ax.set_title(f"response length (tokens), {title}")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "length.png", dpi=120)


def band(ax, runs: dict[str, list[dict]], key: str, smooth: int) -> None:
    """Per RL method: the mean over its seeds' `curves` of `key` (a trailing mean over `smooth` steps) and its
    min-max band."""
    for i, (method, seeds) in enumerate(runs.items()):
        series = [dict(moving_mean(run.get(key, []), smooth)) for run in seeds]
        steps = sorted(set.intersection(*(set(r) for r in series))) if series and all(series) else []
        if not steps:
            continue
        values = [[r[t] for r in series] for t in steps]
        ax.plot(steps, [statistics.mean(v) for v in values], color=f"C{i}", label=f"{METHODS[method]}, {len(series)} seeds")
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
