"""Normalisation layers (config group `model/norm`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.registry import Registry

NORMS = Registry("norm", group="model/norm", doc="normalisation layers")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference RMSNorm; normalises in float32 so bf16 activations keep the small-variance tail."""
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * inv_rms).type_as(x) * weight


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of the fused residual add + RMSNorm: (s, rms_norm(s)) with s = x + residual."""
    s = x + residual
    return s, rms_norm(s, weight, eps)


def add_and_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, norm(x + residual)): a pre-norm block's residual add and the next norm, in one fused kernel
    where `kernels=` installed one on the norm (`add_kernel`), as two operations otherwise. The unfused path goes
    through the norm's `forward`, so hooks on the module (tensor parallelism's sequence sharding) still apply."""
    fused = getattr(norm, "add_kernel", None)
    if fused is not None:
        return fused(x, residual, norm.weight, norm.eps)
    s = x + residual
    return s, norm(s)


@NORMS.register("rmsnorm")
class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (no mean subtraction, no bias)."""

    @dataclass
    class Config:
        eps: float = 1e-6

    def __init__(self, dim: int, cfg: Config):
        super().__init__()
        self.eps = cfg.eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel = rms_norm  # (x, weight, eps) -> y; `kernels=` may swap in a fused one
        self.add_kernel = None  # `kernels=` may install a fused (x, residual, weight, eps) -> (x + residual, y)

    def use_kernels(self, ops) -> None:
        if ops.rms_norm is not None:
            self.kernel = ops.rms_norm
        if ops.add_rms_norm is not None:
            self.add_kernel = ops.add_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


@NORMS.register("layernorm")
class LayerNorm(nn.Module):
    """LayerNorm: subtract the mean, divide by the standard deviation, learned gain and bias."""

    @dataclass
    class Config:
        eps: float = 1e-5
        bias: bool = True

    def __init__(self, dim: int, cfg: Config):
        super().__init__()
        self.eps = cfg.eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if cfg.bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


@NORMS.register("none")
class NoNorm(nn.Module):
    """Identity: no normalisation and no parameters, for ablations that remove the norm."""

    # Lets `model/norm=none` answer "what does the norm buy?" without touching the block
    # layouts: every norm slot stays in place and simply passes its input through.

    @dataclass
    class Config:
        pass

    def __init__(self, dim: int, cfg: Config):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
