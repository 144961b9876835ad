"""Learning-rate schedules (config group `sched`): pure functions of the step, and their registry.

A registered schedule is built as `target(max_lr, total_steps, cfg=Config)` and returns a
function from the optimizer step to the learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lmlab.errors import ConfigError
from lmlab.registry import Registry

SCHEDULERS = Registry("sched", group="sched", doc="learning-rate schedules; lr = f(step)")


def cosine(step: int, max_lr: float, min_lr: float, warmup_steps: int, cosine_steps: int) -> float:
    """Linear warmup from 0 to `max_lr` over `warmup_steps`, cosine down to `min_lr` at `cosine_steps`, then flat."""
    if step < warmup_steps:
        return max_lr * step / warmup_steps
    if step > cosine_steps:
        return min_lr
    progress = (step - warmup_steps) / max(cosine_steps - warmup_steps, 1)
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (max_lr - min_lr)


@dataclass
class CosineConfig:
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # floor as a fraction of the peak learning rate
    cosine_steps: int | None = None  # None: the run's total steps


@SCHEDULERS.register("cosine", config=CosineConfig)
def cosine_schedule(max_lr: float, total_steps: int, cfg: CosineConfig) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to a floor (min_lr_ratio * lr)."""
    cosine_steps = cfg.cosine_steps or total_steps
    if cfg.warmup_steps > cosine_steps:
        raise ConfigError(f"sched.warmup_steps={cfg.warmup_steps} is longer than the run ({cosine_steps} steps)")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError(f"sched.min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    min_lr = cfg.min_lr_ratio * max_lr
    return lambda step: cosine(step, max_lr, min_lr, cfg.warmup_steps, cosine_steps)
