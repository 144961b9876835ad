"""Plot the learning-rate curve of a schedule config, to check a schedule before a run uses it."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from lmlab.optim.schedules import SCHEDULERS


def plot_schedule(sched_cfg: Any, max_lr: float, total_steps: int, path: str | os.PathLike) -> Path:
    """Write the lr of every step 0..total_steps of `sched_cfg` (a name, mapping or Config) to a PNG."""
    from matplotlib.figure import Figure  # a Figure without pyplot renders with Agg and no display

    entry, cfg = SCHEDULERS.resolve(sched_cfg)
    lr_at = SCHEDULERS.build(cfg, max_lr, total_steps)
    steps = range(total_steps + 1)
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(steps, [lr_at(s) for s in steps])
    settings = ", ".join(f"{f.name}={getattr(cfg, f.name)}" for f in entry.fields())
    ax.set(xlabel="step", ylabel="learning rate")
    ax.set_title(textwrap.fill(f"{entry.name}: {settings}", 80), fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path
