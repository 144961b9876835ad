"""Learning-rate schedules (config group `sched`): pure functions of the step, and their registry.

A registered schedule is built as `target(max_lr, total_steps, cfg=Config)` and returns a
function from the optimizer step to the learning rate. Every warmup is linear from 0 at step 0
to max_lr at `warmup_steps`. Optimizer step i (0-based) runs at lr(i), as in the course's
`get_lr_cosine_schedule` and Hugging Face's schedules: the first step at 0 when there is a warmup, and
the last at lr(total_steps - 1), one step short of where each decay ends (lr(total_steps)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lmlab.errors import ConfigError
from lmlab.registry import Registry, unknown_name_message

SCHEDULERS = Registry("sched", group="sched", doc="learning-rate schedules; lr = f(step)")

# Decay shapes of WSD: the fraction of the way from min_lr to max_lr still left at progress p in [0, 1].
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1 - math.sqrt(p),  # fast at first, then slow (Hägele et al. 2024's "1 - sqrt")
}


def _check(total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> None:
    if total_steps < 1:
        raise ConfigError(f"a schedule needs at least one step, got total_steps={total_steps}")
    if warmup_steps < 0:
        raise ConfigError(f"sched.warmup_steps must be >= 0, got {warmup_steps}")
    if warmup_steps > total_steps:
        raise ConfigError(f"sched.warmup_steps={warmup_steps} is longer than the run ({total_steps} steps)")
    if not 0 <= min_lr_ratio <= 1:
        raise ConfigError(f"sched.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")


def default_warmup(total_steps: int) -> int:
    """Warmup when none is set: 50 steps, or half of a run shorter than 100 steps (at least one step)."""
    return max(1, min(50, total_steps // 2))


def warmup_steps(sched_cfg, total_steps: int) -> int:
    """The warmup a schedule config asks for over `total_steps` (0 for a schedule without one)."""
    steps = getattr(sched_cfg, "warmup_steps", 0)
    return default_warmup(total_steps) if steps is None else steps


def cosine(step: int, max_lr: float, min_lr: float, warmup_steps: int, cosine_steps: int) -> float:
    """Linear warmup from 0 to `max_lr` over `warmup_steps`, cosine down to `min_lr` at `cosine_steps`, then flat."""
    if step < warmup_steps:
        return max_lr * step / warmup_steps
    if step > cosine_steps:
        return min_lr
    progress = (step - warmup_steps) / max(cosine_steps - warmup_steps, 1)
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def wsd(step: int, max_lr: float, min_lr: float, warmup_steps: int, decay_start: int, total_steps: int,
        shape: str = "linear") -> float:
    """Warmup, then `max_lr` until `decay_start`, then decay along `shape` to `min_lr` at `total_steps`."""
    if step < warmup_steps:
        return max_lr * step / warmup_steps
    if step < decay_start:
        return max_lr
    if step >= total_steps:
        return min_lr
    progress = (step - decay_start) / (total_steps - decay_start)
    return min_lr + (max_lr - min_lr) * DECAY_SHAPES[shape](progress)


def inverse_sqrt(step: int, max_lr: float, warmup_steps: int) -> float:
    """Warmup, then max_lr * sqrt(warmup_steps / step) (the original Transformer's decay)."""
    if step < warmup_steps:
        return max_lr * step / warmup_steps
    return max_lr * math.sqrt(warmup_steps / step)


@dataclass
class CosineConfig:
    warmup_steps: int | None = None  # None: min(50, half the run)
    min_lr_ratio: float = 0.1  # floor as a fraction of the peak learning rate
    cosine_steps: int | None = None  # None: the run's total steps


@SCHEDULERS.register("cosine", config=CosineConfig)
def cosine_schedule(max_lr: float, total_steps: int, cfg: CosineConfig) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to a floor (min_lr_ratio * lr)."""
    cosine_steps = cfg.cosine_steps or total_steps
    warmup = warmup_steps(cfg, cosine_steps)
    _check(cosine_steps, warmup, cfg.min_lr_ratio)
    min_lr = cfg.min_lr_ratio * max_lr
    return lambda step: cosine(step, max_lr, min_lr, warmup, cosine_steps)


@dataclass
class ConstantConfig:
    warmup_steps: int | None = None  # None: min(50, half the run)


@SCHEDULERS.register("constant", config=ConstantConfig)
def constant_schedule(max_lr: float, total_steps: int, cfg: ConstantConfig) -> Callable[[int], float]:
    """Linear warmup, then the peak learning rate to the end."""
    warmup = warmup_steps(cfg, total_steps)
    _check(total_steps, warmup)
    return lambda step: max_lr * step / warmup if step < warmup else max_lr


@dataclass
class LinearConfig:
    warmup_steps: int | None = None  # None: min(50, half the run)
    min_lr_ratio: float = 0.0  # the rate the decay reaches at step max_steps, as a fraction of the peak


@SCHEDULERS.register("linear", config=LinearConfig)
def linear_schedule(max_lr: float, total_steps: int, cfg: LinearConfig) -> Callable[[int], float]:
    """Linear warmup, then linear decay to min_lr_ratio * lr at the end of the run."""
    warmup = warmup_steps(cfg, total_steps)
    _check(total_steps, warmup, cfg.min_lr_ratio)
    min_lr = cfg.min_lr_ratio * max_lr
    return lambda step: wsd(step, max_lr, min_lr, warmup, warmup, total_steps, "linear")


@dataclass
class WSDConfig:
    warmup_steps: int | None = None  # None: min(50, half the run)
    decay_fraction: float = 0.2  # the last fraction of the run decays
    decay_shape: str = "sqrt"  # linear, cosine or sqrt (1 - sqrt(progress))
    min_lr_ratio: float = 0.0
    decay_start: int | None = None  # decay from this step instead (a stable-phase checkpoint's step)


@SCHEDULERS.register("wsd", config=WSDConfig)
def wsd_schedule(max_lr: float, total_steps: int, cfg: WSDConfig) -> Callable[[int], float]:
    """Warmup-stable-decay: flat peak, then a short decay that may start from any stable-phase checkpoint.

    One long stable run gives several (tokens, loss) points for scaling laws: resume it from the
    checkpoint at step S with `sched.decay_start=S trainer.max_steps=S+D`; the decay runs from S to S+D.
    """
    warmup = warmup_steps(cfg, total_steps)
    _check(total_steps, warmup, cfg.min_lr_ratio)
    if cfg.decay_shape not in DECAY_SHAPES:
        message = unknown_name_message("decay shape", cfg.decay_shape, DECAY_SHAPES)
        raise ConfigError(f"sched.decay_shape: {message}")
    if not 0 <= cfg.decay_fraction <= 1:
        raise ConfigError(f"sched.decay_fraction must be in [0, 1], got {cfg.decay_fraction}")
    if cfg.decay_start is not None:
        if not warmup <= cfg.decay_start < total_steps:
            raise ConfigError(f"sched.decay_start={cfg.decay_start} is outside the stable phase: it must be between "
                              f"the end of warmup ({warmup}) and the run's last step ({total_steps - 1})")
        decay_start = cfg.decay_start
    else:
        decay_start = total_steps - round(cfg.decay_fraction * total_steps)
        if decay_start < warmup:
            raise ConfigError(f"sched.warmup_steps={warmup} overlaps the decay, which starts at step "
                              f"{decay_start} (decay_fraction={cfg.decay_fraction} of {total_steps}); shorten one")
    min_lr = cfg.min_lr_ratio * max_lr
    return lambda step: wsd(step, max_lr, min_lr, warmup, decay_start, total_steps, cfg.decay_shape)


@dataclass
class InverseSqrtConfig:
    warmup_steps: int | None = None  # None: min(50, half the run)


@SCHEDULERS.register("inverse_sqrt", config=InverseSqrtConfig)
def inverse_sqrt_schedule(max_lr: float, total_steps: int, cfg: InverseSqrtConfig) -> Callable[[int], float]:
    """Linear warmup, then lr * sqrt(warmup_steps / step) (Vaswani et al. 2017)."""
    warmup = warmup_steps(cfg, total_steps)
    _check(total_steps, warmup)
    if warmup < 1:
        raise ConfigError("sched.warmup_steps must be >= 1 for inverse_sqrt: the decay is measured in warmups")
    return lambda step: inverse_sqrt(step, max_lr, warmup)
