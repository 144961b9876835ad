"""The optimizer registry (config group `optim`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lmlab.optim.adamw import AdamW
from lmlab.registry import Registry

OPTIMIZERS = Registry("optim", group="optim", doc="optimizers; built as target(model, cfg=Config)")


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights) only, not on gains and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


@dataclass
class AdamWConfig:
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1


@OPTIMIZERS.register("adamw", config=AdamWConfig)
def adamw(model: nn.Module, cfg: AdamWConfig) -> torch.optim.Optimizer:
    """AdamW (lmlab's own, matches torch.optim.AdamW); decay on matrices only."""
    return AdamW(decay_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
