"""The muP transfer and batch-size sweeps of run.sh, read with lmlab-compare's run finder.

    python experiments/scaling-laws/plot_sweeps.py mup DIR     # final val/loss against lr per width, SP and muP
    python experiments/scaling-laws/plot_sweeps.py batch DIR   # steps and tokens to a loss against batch size

Each writes a PNG and a markdown table beside the runs.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lmlab.cli.compare import find_runs  # noqa: E402


def mup(root: Path) -> None:
    """Per parametrisation (model/init) and width: final val/loss over the learning rates; the best lr per
    width should stay put under muP and drift under the standard parametrisation."""
    curves = defaultdict(dict)  # (init, width) -> lr -> loss
    for run in find_runs(root):
        loss = run.final("val/loss")
        if loss is not None:
            o = run.overrides
            curves[(o.get("model/init", "gpt2"), int(o["model.d_model"]))][float(o["optim.lr"])] = loss
    inits = sorted({init for init, _ in curves})
    fig, axes = plt.subplots(1, len(inits), figsize=(5 * len(inits), 3.8), sharey=True, squeeze=False)
    lines = ["| parametrisation | d_model | best lr | val/loss there |", "|---|---:|---:|---:|"]
    for ax, init in zip(axes[0], inits):
        for i, width in enumerate(sorted(w for j, w in curves if j == init)):
            points = sorted(curves[(init, width)].items())
            ax.plot([lr for lr, _ in points], [loss for _, loss in points], "o-", color=f"C{i}", label=f"d_model {width}")
            best = min(points, key=lambda p: p[1])
            ax.plot(*best, "k*", ms=10)
            lines.append(f"| {init} | {width} | {best[0]:g} | {best[1]:.4f} |")
        ax.set(xscale="log", xlabel="learning rate", title=f"model/init={init}")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("final val/loss")
    fig.tight_layout()
    fig.savefig(root / "mup_transfer.png", dpi=120)
    (root / "mup_transfer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def batch(root: Path) -> None:
    """Steps and tokens each batch size needs to reach a loss (the worst of the runs' final val/losses, so
    every run reaches it), and the gradient noise scale the runs logged: steps fall with the batch until
    about the noise scale, then stop falling (McCandlish et al.)."""
    runs = [(int(r.overrides["data.batch_size"]), r) for r in find_runs(root) if r.final("val/loss") is not None]
    target = max(r.final("val/loss") for _, r in runs)
    lines = [f"target val/loss {target:.4f}", "", "| batch (sequences) | steps to target | tokens to target | "
             "grad noise scale (tokens, median of the last half) |", "|---:|---:|---:|---:|"]
    rows = []
    for size, run in sorted(runs, key=lambda item: item[0]):
        context = int(run.overrides.get("data.context_length", 128))
        step = next(s for s, loss in run.scalars["val/loss"] if loss <= target) + 1
        # nan where the moving average of |G|^2 is not yet positive: small batches' estimates are the noisiest
        noise = [v for _, v in run.scalars.get("train/grad_noise_scale", []) if math.isfinite(v)]
        scale = statistics.median(noise[len(noise) // 2:]) if noise else float("nan")
        rows.append((size, step, step * size * context, scale))
        lines.append(f"| {size} | {step} | {step * size * context:,} | {scale:,.0f} |")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    axes[0].plot([r[0] for r in rows], [r[1] for r in rows], "o-")
    axes[0].set(xscale="log", yscale="log", xlabel="batch size (sequences)", ylabel="steps to target loss")
    axes[1].plot([r[0] for r in rows], [r[2] for r in rows], "o-")
    axes[1].set(xscale="log", yscale="log", xlabel="batch size (sequences)", ylabel="tokens to target loss")
    fig.suptitle(f"to val/loss {target:.3f}")
    fig.tight_layout()
    fig.savefig(root / "batch_size.png", dpi=120)
    (root / "batch_size.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


SWEEPS = {"mup": mup, "batch": batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", choices=sorted(SWEEPS))
    parser.add_argument("root", type=Path, help="the sweep's folder of runs")
    args = parser.parse_args()
    SWEEPS[args.sweep](args.root)


if __name__ == "__main__":
    main()
