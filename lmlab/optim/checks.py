"""Argument checks shared by the optimizers: a bad value fails in the constructor with a
ValueError that names the optimizer, the argument and the value (torch.optim's convention)."""

from __future__ import annotations

from collections.abc import Sequence


def check_lr(optimizer: str, lr: float) -> None:
    if not lr > 0:
        raise ValueError(f"{optimizer}: learning rate must be > 0, got {lr}")


def check_betas(optimizer: str, betas: Sequence[float]) -> None:
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{optimizer}: betas must be two numbers in [0, 1), got {tuple(betas)}")


def check_momentum(optimizer: str, momentum: float) -> None:
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"{optimizer}: momentum must be in [0, 1), got {momentum}")


def check_non_negative(optimizer: str, **values: float) -> None:
    bad = {k: v for k, v in values.items() if not v >= 0}
    if bad:
        got = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(f"{optimizer}: {', '.join(bad)} must be >= 0, got {got}")
