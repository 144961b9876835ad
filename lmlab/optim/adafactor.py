"""Adafactor (Shazeer & Stern 2018): Adam-like scaling with a second moment that costs O(rows + cols).

Per weight W (for a stack of matrices, per matrix over the last two dims):
- second moment: for a matrix, running means of g^2 over rows (R) and over columns (C) stand for
  the full V ~ R C / mean(R), the best rank-1 fit; vectors keep the full V;
- its decay grows with the step t: beta2_t = 1 - t^beta2_decay, so early averages are not biased
  towards zero and need no correction;
- the learning rate is relative: the step is min(lr, 1/sqrt(t)) * max(eps2, RMS(W)), so weights move
  by a fraction of their own size;
- update clipping: u = g / sqrt(V) is scaled down until RMS(u) <= d;
- no first moment (beta1 = 0), which is where the memory saving against Adam comes from.

This is the variant of `torch.optim.Adafactor` (same arguments, same numerics), written out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lmlab.optim.base import ParamwiseOptimizer
from lmlab.optim.checks import check_lr, check_non_negative


class Adafactor(ParamwiseOptimizer):
    """Factored second moment, relative step size, update clipping, no momentum."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
    ):
        check_lr("Adafactor", lr)
        eps1, eps2 = eps
        check_non_negative("Adafactor", eps1=0.0 if eps1 is None else eps1, eps2=eps2, weight_decay=weight_decay)
        if not beta2_decay <= 0:
            raise ValueError(f"Adafactor: beta2_decay must be <= 0, got {beta2_decay}")
        if not d >= 1:
            raise ValueError(f"Adafactor: clipping threshold d must be >= 1, got {d}")
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d, weight_decay=weight_decay))

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        lr, wd, d = group["lr"], group["weight_decay"], group["d"]
        eps1, eps2 = group["eps"]
        g = grad
        factored = g.dim() >= 2
        if not state:
            state["step"] = 0
            if factored:
                state["row_var"] = g.new_zeros((*g.shape[:-1], 1))
                state["col_var"] = g.new_zeros((*g.shape[:-2], 1, g.shape[-1]))
            else:
                state["variance"] = torch.zeros_like(g)
        state["step"] += 1
        t = state["step"]
        tiny = torch.finfo(p.dtype).eps if eps1 is None else eps1
        one_minus_beta2 = t**group["beta2_decay"]
        step_size = max(eps2, p.norm().item() / math.sqrt(p.numel())) * min(lr, 1 / math.sqrt(t))

        p.mul_(1 - lr * wd)
        if factored:
            row, col = state["row_var"], state["col_var"]
            row.lerp_(g.square().mean(dim=-1, keepdim=True), one_minus_beta2)
            col.lerp_(g.square().mean(dim=-2, keepdim=True), one_minus_beta2)
            v = row * col / row.mean(dim=-2, keepdim=True).clamp(min=tiny)
        else:
            v = state["variance"].lerp_(g.square(), one_minus_beta2).clone()
        # eps1 is squared because it guards V, and the update divides by sqrt(V).
        update = v.clamp_(min=tiny * tiny).rsqrt_().mul_(g)
        clip = max(1.0, update.norm().item() / (math.sqrt(update.numel()) * d))
        p.add_(update, alpha=-step_size / clip)
