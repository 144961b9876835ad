"""Adam (Kingma & Ba) and AdamW (Loshchilov & Hutter), written out so every step of the update is visible."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lmlab.optim.base import ParamwiseOptimizer
from lmlab.optim.checks import check_betas, check_lr, check_non_negative


class Adam(ParamwiseOptimizer):
    """Adam with an L2 penalty added to the gradient; same arguments and numerics as `torch.optim.Adam`."""

    # AdamW's one change: decay shrinks the weight directly instead of passing through the
    # moments, where Adam's normalisation would shrink it for parameters with large gradients.
    decoupled_weight_decay = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        name = type(self).__name__
        check_lr(name, lr)
        check_betas(name, betas)
        check_non_negative(name, eps=eps, weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.kernel = adam_update  # `kernels=` may swap in a fused update with the same signature

    def use_kernels(self, ops) -> None:
        if ops.adam is not None:
            self.kernel = ops.adam

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        self.kernel(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"], group["betas"],
                    group["eps"], group["weight_decay"], self.decoupled_weight_decay)


def adam_update(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, lr: float,
                betas: tuple[float, float], eps: float, wd: float, decoupled: bool) -> None:
    """One Adam step of `p` in place, and of its moments `m`, `v`, at step `t` (1-based)."""
    beta1, beta2 = betas
    g = grad
    if decoupled:
        p.mul_(1 - lr * wd)
    elif wd:
        g = g.add(p, alpha=wd)  # gradient of the penalty wd/2 |p|^2
    m.lerp_(g, 1 - beta1)  # m = beta1 m + (1 - beta1) g
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    # Bias corrections for the zero-initialised moments, folded into step size and denominator.
    step_size = lr / (1 - beta1**t)
    denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


class AdamW(Adam):
    """Adam with decoupled weight decay; same arguments and numerics as `torch.optim.AdamW`."""

    decoupled_weight_decay = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        super().__init__(params, lr, betas, eps, weight_decay)
