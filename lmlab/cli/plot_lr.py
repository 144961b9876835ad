"""`lmlab plot-lr [OVERRIDES...] [--out lr.png]`: the learning-rate curve a training config would use.

Composes the same config as `lmlab-train` (same overrides) and plots the schedule `sched` of
peak `optim.lr` over `trainer.max_steps`, e.g. `lmlab plot-lr sched=wsd sched.decay_start=800
trainer.max_steps=1000`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lmlab.cli.compose import compose_config


def main(argv: list[str]) -> int:
    from lmlab.optim.plot import plot_schedule

    parser = argparse.ArgumentParser(prog="lmlab plot-lr", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="lmlab-train overrides, e.g. sched=wsd trainer.max_steps=1000")
    parser.add_argument("--out", type=Path, default=Path("lr.png"), help="PNG to write (default lr.png)")
    args = parser.parse_args(argv)
    cfg = compose_config(args.overrides)
    print(f"wrote {plot_schedule(cfg.sched, cfg.optim.lr, cfg.trainer.max_steps, args.out)}")
    return 0
