"""Adam (Kingma & Ba) and AdamW (Loshchilov & Hutter), written out so every step of the update is visible."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from lmlab.optim.base import evaluate_closure
from lmlab.optim.checks import check_betas, check_lr, check_non_negative


class Adam(torch.optim.Optimizer):
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
        # `kernels=` may swap in a fused update with the same signature. It takes a whole group at
        # once, so a multi-tensor kernel can update every parameter in one launch.
        self.kernel = adam_update

    def use_kernels(self, ops) -> None:
        if ops.adam is not None:
            self.kernel = ops.adam

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
            self.kernel(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                        [s["exp_avg_sq"] for s in states], [s["step"] for s in states], group["lr"],
                        group["betas"], group["eps"], group["weight_decay"], self.decoupled_weight_decay)
        return loss


def adam_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: list[int], lr: float, betas: tuple[float, float],
                eps: float, wd: float, decoupled: bool) -> None:
    """One Adam step of each parameter in place, and of its moments, at its step count (1-based)."""
    for p, grad, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        adam_update_tensor(p, grad, m, v, t, lr, betas, eps, wd, decoupled)


def adam_update_tensor(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, lr: float,
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
