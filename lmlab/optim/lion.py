"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms")."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lmlab.optim.base import ParamwiseOptimizer
from lmlab.optim.checks import check_betas, check_lr, check_non_negative


class Lion(ParamwiseOptimizer):
    """Sign of an interpolated momentum: every coordinate moves by exactly lr; one state tensor per weight.

    Because the update has unit size per coordinate (larger than Adam's), the paper uses a
    learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ):
        check_lr("Lion", lr)
        check_betas("Lion", betas)
        check_non_negative("Lion", weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        m, g = state["exp_avg"], grad
        p.mul_(1 - lr * wd)  # decoupled, as in AdamW
        # The step uses beta1 to mix in the fresh gradient; the stored momentum uses the
        # slower beta2, so the update reacts quickly but the memory is long.
        p.add_(m.lerp(g, 1 - beta1).sign_(), alpha=-lr)
        m.lerp_(g, 1 - beta2)
