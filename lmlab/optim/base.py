"""The base of lmlab's optimizers: one `step` loop, so each optimizer writes only its update rule."""

from __future__ import annotations

from collections.abc import Callable

import torch


def evaluate_closure(closure: Callable[[], float] | None) -> float | None:
    """The loss a `step(closure)` returns: the closure re-evaluated with gradients on, or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class ParamwiseOptimizer(torch.optim.Optimizer):
    """`step` evaluates the closure (if any), then calls `update` for every parameter with a gradient."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, p.grad, self.state[p], group)
        return loss

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        """Change `p` in place from its gradient, its optimizer state and its group's settings."""
        raise NotImplementedError
