"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): round a Linear's weight column by column, each time spreading the rounding error over
the columns not yet rounded so that the layer's output on calibration inputs X changes least.

The objective ||W X^T - Q X^T||^2 has Hessian H = 2 X^T X (K x K, the same for every output row).
Rounding column i with error e moves the later columns by -e * Hinv[i, i:] / Hinv[i, i], where Hinv
is the upper Cholesky factor of H^-1 (the paper's numerically stable form of the OBS update). Updates
are applied lazily: within a block of 128 columns, then to the rest of the matrix in one matmul.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.inference.quant.grid import Grid

BLOCK = 128  # columns per lazy batch update (the paper's B)


def collect_hessians(model: nn.Module, linears: dict[str, nn.Linear],
                     batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / n of each Linear's inputs X (n rows) while `model` runs on the token-id batches.

    All Hessians come from one pass of the unquantized model (not the paper's layer-by-layer pass
    through already-quantized layers): simpler, and the same for every Linear of a layer."""
    device = next(model.parameters()).device
    sums = {name: torch.zeros(m.in_features, m.in_features, device=device) for name, m in linears.items()}
    rows = dict.fromkeys(linears, 0)

    def accumulate(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, module.in_features).float()
            sums[name].addmm_(x.T, x)
            rows[name] += x.shape[0]
        return hook

    handles = [m.register_forward_pre_hook(accumulate(name)) for name, m in linears.items()]
    was_training, n_batches = model.training, 0
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                if batch.dim() != 2 or batch.dtype.is_floating_point:
                    raise ConfigError(f"calibration batches must be token ids of shape (batch, seq); "
                                      f"got {batch.dtype} of shape {tuple(batch.shape)}")
                model(batch.to(device))
                n_batches += 1
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if n_batches == 0:
        raise ConfigError("quant.method=gptq got no calibration batches; pass token-id batches or use quant.method=rtn")
    if idle := [name for name, n in rows.items() if n == 0]:  # its H would be 0 and GPTQ would zero its weight
        raise ConfigError(f"GPTQ: {len(idle)} Linear(s) saw no calibration input, e.g. {idle[0]}: the model's "
                          "forward never called them")
    return {name: 2 * sums[name] / max(rows[name], 1) for name in linears}


def gptq(weight: torch.Tensor, grid: Grid, group_size: int, hessian: torch.Tensor,
         damp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (N, K) and per-group scale and zero (N, K // group_size) of `weight` (N, K), compensating
    rounding errors with the Hessian of its calibration inputs; `damp` adds that fraction of the mean
    diagonal to H (numerical stability). A group's scale and zero come from its columns as updated
    when its first column is reached (group_size divides BLOCK, or is K for one group per row)."""
    n, k = weight.shape
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = h.diagonal() == 0  # inputs that were always 0: their weights cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h.diagonal().add_(damp * h.diagonal().mean())
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch.linalg.LinAlgError:
        raise ConfigError(f"GPTQ: the calibration Hessian is not positive definite even with "
                          f"quant.damp={damp}; raise quant.damp or give more calibration tokens") from None
    codes = torch.empty_like(w)
    scale = w.new_empty(n, k // group_size)
    zero = torch.empty_like(scale)
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        block, block_hinv = w[:, start:end].clone(), hinv[start:end, start:end]
        errors = torch.empty_like(block)
        for i in range(end - start):
            col = start + i
            g = col // group_size
            if col % group_size == 0:
                current = torch.cat([block[:, i:], w[:, end:]], dim=1)[:, :group_size]
                scale[:, g], zero[:, g] = grid.params(current)
            codes[:, col] = grid.codes(block[:, i], scale[:, g], zero[:, g])
            error = (block[:, i] - grid.values(codes[:, col], scale[:, g], zero[:, g])) / block_hinv[i, i]
            block[:, i:].addr_(error, block_hinv[i, i:], alpha=-1.0)
            errors[:, i] = error
        w[:, end:].addmm_(errors, hinv[start:end, end:], alpha=-1.0)
    return codes, scale, zero
