"""Cross-entropy fused with the output projection, computed a chunk of rows at a time.

`chunked_cross_entropy(hidden, weight, targets)` equals
`F.cross_entropy(hidden @ weight.T, targets, ignore_index=...)` (mean over non-ignored targets),
but the (N, V) logits only ever exist for `chunk_size` rows at once: the forward keeps one
log-sum-exp per row, and the backward recomputes each chunk's softmax from it. With a 50k
vocabulary that is the difference between a few GiB of logits (and as much again for their
gradient) and a few hundred MiB.

Logits are computed in float32 (float64 for float64 inputs); gradients come back in the input
dtypes. As in PyTorch, a batch whose targets are all ignored has a NaN loss (0 / 0) and zero
gradients.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_SIZE = 1024


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
           chunk_size: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden must be (N, d) and weight (V, d); "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden and weight must share d; got {hidden.shape[1]} and {weight.shape[1]}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be ({hidden.shape[0]},) to match hidden; got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class indices; got {targets.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1; got {chunk_size}")
    kept = targets[targets != ignore_index]
    if kept.numel() and (kept.min() < 0 or kept.max() >= weight.shape[0]):
        raise ValueError(f"targets must lie in [0, {weight.shape[0]}) or equal ignore_index={ignore_index}")


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                chunk_size: int) -> torch.Tensor:
        acc = torch.promote_types(hidden.dtype, torch.float32)
        w = weight.to(acc)
        kept = targets != ignore_index
        safe_targets = targets.masked_fill(~kept, 0)  # any valid index; those rows are masked out
        lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for r0 in range(0, hidden.shape[0], chunk_size):
            rows = slice(r0, r0 + chunk_size)
            logits = hidden[rows].to(acc) @ w.T
            lse[rows] = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, safe_targets[rows, None])[:, 0]
            total = total + ((lse[rows] - target_logit) * kept[rows]).sum()
        n_kept = kept.sum()
        ctx.save_for_backward(hidden, weight, safe_targets, kept, lse, n_kept)
        ctx.chunk_size = chunk_size
        return (total / n_kept).to(hidden.dtype)

    @staticmethod
    def backward(ctx: Any, d_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, safe_targets, kept, lse, n_kept = ctx.saved_tensors
        acc = lse.dtype
        w = weight.to(acc)
        # clamp: with every target ignored, every row's gradient is masked to zero anyway (as in torch).
        row_scale = kept.to(acc) * (d_loss.to(acc) / n_kept.clamp(min=1))
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for r0 in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(r0, r0 + ctx.chunk_size)
            h = hidden[rows].to(acc)
            # d logits = softmax - one_hot(target), scaled by d_loss / n_kept on kept rows.
            d_logits = torch.exp(h @ w.T - lse[rows, None])
            d_logits.scatter_add_(1, safe_targets[rows, None], torch.full_like(lse[rows, None], -1.0))
            d_logits *= row_scale[rows, None]
            d_hidden[rows] = (d_logits @ w).to(hidden.dtype)
            d_weight += d_logits.T @ h
        return d_hidden, d_weight.to(weight.dtype), None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          ignore_index: int = -100, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` over the non-ignored rows.

    hidden: (N, d), weight: (V, d) (the lm_head / tied embedding), targets: (N,) class indices.
    """
    _check(hidden, weight, targets, ignore_index, chunk_size)
    return _ChunkedCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk_size)
