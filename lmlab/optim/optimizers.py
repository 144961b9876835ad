"""The optimizer registry (config group `optim`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lmlab.optim.adamw import AdamW
from lmlab.registry import Registry

OPTIMIZERS = Registry("optim", group="optim", doc="optimizers; built as target(model, cfg=Config)")


def decay_groups(model: nn.Module, weight_decay: float, lr: float) -> list[dict]:
    """Parameter groups: weight decay on matrices only (not gains and biases), and the learning
    rate times the model's per-parameter multiplier (`model.lr_multipliers`, set by muP)."""
    multipliers = getattr(model, "lr_multipliers", {})
    groups: dict[tuple[bool, float], list] = {}
    for name, p in model.named_parameters():  # tied weights come once
        if p.requires_grad:
            groups.setdefault((p.dim() >= 2, multipliers.get(name, 1.0)), []).append(p)
    return [{"params": params, "weight_decay": weight_decay if decays else 0.0, "lr": lr * mult}
            for (decays, mult), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], -kv[0][1]))]


@dataclass
class AdamWConfig:
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1


@OPTIMIZERS.register("adamw", config=AdamWConfig)
def adamw(model: nn.Module, cfg: AdamWConfig) -> torch.optim.Optimizer:
    """AdamW (lmlab's own, matches torch.optim.AdamW); decay on matrices only."""
    return AdamW(decay_groups(model, cfg.weight_decay, cfg.lr), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
