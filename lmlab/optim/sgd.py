"""Stochastic gradient descent with heavy-ball or Nesterov momentum."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lmlab.optim.base import ParamwiseOptimizer
from lmlab.optim.checks import check_lr, check_momentum, check_non_negative


class SGD(ParamwiseOptimizer):
    """SGD with momentum and an L2 penalty; same numerics as `torch.optim.SGD` (without dampening)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-2,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
    ):
        check_lr("SGD", lr)
        check_momentum("SGD", momentum)
        check_non_negative("SGD", weight_decay=weight_decay)
        if nesterov and momentum == 0:
            raise ValueError("SGD: nesterov needs momentum > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        d = grad.add(p, alpha=wd) if wd else grad  # gradient of loss + wd/2 |p|^2
        if mu:
            if "momentum_buffer" not in state:
                # The first step moves by the whole gradient (torch's convention), not (1 - mu) of it.
                state["momentum_buffer"] = d.clone()
            else:
                state["momentum_buffer"].mul_(mu).add_(d)
            buf = state["momentum_buffer"]
            # Nesterov: step from where the momentum is about to carry the weights.
            d = d.add(buf, alpha=mu) if group["nesterov"] else buf
        p.add_(d, alpha=-lr)
