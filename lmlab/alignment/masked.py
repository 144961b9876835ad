"""Reductions over the tokens a mask selects (the response tokens of a prompt + response sequence).

Masked-out positions are never read, so a -inf or nan log-prob there cannot leak into the result or
its gradient. A row with no selected token (an empty response) gives 0, not nan.
"""

from __future__ import annotations

import torch


def _select(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), tensor * mask.to(tensor.dtype), torch.zeros((), dtype=tensor.dtype,
                                                                                device=tensor.device))


def masked_sum(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of tensor * mask over `dim` (all elements when None)."""
    selected = _select(tensor, mask)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the selected elements along `dim` (all elements when None); 0 where none is selected."""
    count = masked_sum(torch.ones_like(tensor), mask, dim)
    nonempty = count > 0
    return torch.where(nonempty, masked_sum(tensor, mask, dim) / torch.where(nonempty, count, 1), 0)


def masked_normalize(tensor: torch.Tensor, mask: torch.Tensor, normalize_constant: float = 1.0,
                     dim: int | None = None) -> torch.Tensor:
    """Sum over the selected elements along `dim`, divided by a constant (not by how many were selected:
    Dr. GRPO's fix for the length bias of a per-response mean)."""
    if normalize_constant <= 0:
        raise ValueError(f"normalize_constant must be > 0, got {normalize_constant}")
    return masked_sum(tensor, mask, dim) / normalize_constant
