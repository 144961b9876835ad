"""Muon (Keller Jordan et al. 2024): momentum SGD whose update for each weight matrix is replaced
by the nearest semi-orthogonal matrix, so every direction of the matrix moves by the same amount.

The orthogonalisation of an update G = U S V^T is U V^T, approximated by a few Newton-Schulz
iterations instead of an SVD. The quintic coefficients (3.4445, -4.7750, 2.0315) are tuned to
push small singular values up fast rather than to converge exactly: the result has singular
values roughly within [0.7, 1.2], which trains as well as the exact U V^T at a fraction of the cost.

Scale: the update is multiplied by sqrt(max(1, rows / cols)) (the reference implementation's
choice), so a tall matrix's update has the same per-column RMS as a square one. With it Muon's
learning rate (~0.02) is not on AdamW's scale; the AdamW part of a Muon run has its own
learning rate (see the `muon` optimizer entry).

Muon is for hidden matrices only: embeddings, the output head, gains and biases go to AdamW.
Tensors with more than two dims are stacks of matrices (MoE experts, shape (n_experts, out, in)):
each matrix of the stack is orthogonalised on its own, in one batched iteration.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lmlab.optim.base import ParamwiseOptimizer
from lmlab.optim.checks import check_lr, check_momentum, check_non_negative

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalise(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately U V^T for G = U S V^T, per matrix over the last two dims, by Newton-Schulz."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()  # the reference runs this in bfloat16 on GPUs; float32 keeps CPU runs exact and repeatable
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the smaller Gram matrix X X^T
        x = x.mT
    # Dividing by the Frobenius norm puts every singular value in [0, 1], where the iteration converges.
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        # X <- a X + b (X X^T) X + c (X X^T)^2 X: an odd polynomial applied to each singular value.
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).to(g.dtype)


class Muon(ParamwiseOptimizer):
    """Nesterov momentum, then the update of every matrix orthogonalised by Newton-Schulz."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
    ):
        check_lr("Muon", lr)
        check_momentum("Muon", momentum)
        check_non_negative("Muon", weight_decay=weight_decay)
        if ns_steps < 1:
            raise ValueError(f"Muon: ns_steps must be >= 1, got {ns_steps}")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() < 2:
                    raise ValueError(f"Muon: only matrices can be orthogonalised, got a tensor of shape "
                                     f"{tuple(p.shape)}; give embeddings, gains and biases to AdamW")

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"].lerp_(grad, 1 - mu)  # buf = mu buf + (1 - mu) g
        direction = grad.lerp(buf, mu) if group["nesterov"] else buf
        direction = orthogonalise(direction, group["ns_steps"])
        p.mul_(1 - lr * wd)  # decoupled weight decay
        p.add_(direction, alpha=-lr * max(1.0, p.size(-2) / p.size(-1)) ** 0.5)
