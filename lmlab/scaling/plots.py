"""PNG plots of scaling fits: IsoFLOP curves with their parabolas, N*(C) and D*(C) of every method with
the points they went through and bootstrap bands, loss against compute with each law's L*(C), and the
joint law's residuals."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from lmlab.scaling.laws import ComputeOptimal, FrontierFit, JointLaw, budget_of, curves_of
from lmlab.scaling.points import Point, arrays


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_isoflop(fit: FrontierFit, points: Sequence[Point], out: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for i, (budget, coeffs) in enumerate(sorted(fit.parabolas.items())):
        group = sorted((p for p in points if budget_of(p) == budget), key=lambda p: p.n)
        ax.scatter([p.n for p in group], [p.loss for p in group], color=f"C{i}", s=18, label=f"C = {budget:.2g}")
        log_n = np.linspace(np.log(group[0].n), np.log(group[-1].n), 100)
        ax.plot(np.exp(log_n), np.polyval(coeffs, log_n), color=f"C{i}", lw=1)
    ax.scatter([p.n for p in fit.optima], [p.loss for p in fit.optima], marker="*", color="k", s=60, zorder=3,
               label="parabola minima")
    ax.set(xscale="log", xlabel="parameters N", ylabel="loss", title="IsoFLOP profiles")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_frontier(fits: dict[str, ComputeOptimal], out: Path, up_to: float | None = None,
                  draws: dict[str, list] | None = None) -> None:
    """N*(C) and D*(C) of each fit over the compute its points span (to `up_to` when larger), each with the
    95% band of its bootstrap refits (`draws`) where given."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    spans = [p.flops for fit in fits.values() if isinstance(fit, FrontierFit) for p in fit.optima]
    low, high = (min(spans), max(spans)) if spans else (1e17, 1e21)
    c = np.logspace(np.log10(low), np.log10(max(high, up_to or high)), 100)
    for i, (name, fit) in enumerate(fits.items()):
        refits = (draws or {}).get(name, [])
        for ax, value in zip(axes, ("n_opt", "d_opt")):
            ax.plot(c, getattr(fit, value)(c), color=f"C{i}", label=name)
            if len(refits) > 1:
                curves = np.array([getattr(r, value)(c) for r in refits])
                ax.fill_between(c, *np.percentile(curves, [2.5, 97.5], axis=0), color=f"C{i}", alpha=0.15, lw=0)
        if isinstance(fit, FrontierFit):
            axes[0].scatter([p.flops for p in fit.optima], [p.n for p in fit.optima], color=f"C{i}", s=10)
            axes[1].scatter([p.flops for p in fit.optima], [p.d for p in fit.optima], color=f"C{i}", s=10)
    for ax, what in zip(axes, ("parameters N*", "tokens D*")):
        ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel=what, title=f"compute-optimal {what}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_envelope(points: Sequence[Point], fits: dict[str, ComputeOptimal], out: Path, up_to: float) -> None:
    """Loss against compute: every run's curve (or point), and each fit's predicted compute-optimal loss L*(C)
    out to `up_to`: the frontier the runs trace and where each law extrapolates it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for curve in curves_of(points).values():
        style = {"lw": 0.8, "alpha": 0.6} if len(curve) > 1 else {"marker": "o", "ms": 3, "alpha": 0.6}
        ax.plot([p.flops for p in curve], [p.loss for p in curve], color="0.5", **style)
    c = np.logspace(np.log10(min(p.flops for p in points)), np.log10(max(up_to, max(p.flops for p in points))), 100)
    for i, (name, fit) in enumerate(fits.items()):
        ax.plot(c, fit.predicted_loss(c), color=f"C{i}", lw=1.5, label=f"{name}: L*(C)")
    ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel="loss", title="loss against compute")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_residuals(law: JointLaw, points: Sequence[Point], out: Path) -> None:
    plt = _pyplot()
    n, d, c, loss = arrays(points)
    residual = np.log(loss) - np.log(law.loss(n, d))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, x, label in zip(axes, (n, c), ("parameters N", "compute C (FLOPs)")):
        ax.scatter(x, residual, s=12)
        ax.axhline(0, color="k", lw=0.8)
        ax.set(xscale="log", xlabel=label)
    axes[0].set_ylabel("log loss - log fitted loss")
    fig.suptitle("joint law L(N, D) residuals")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
