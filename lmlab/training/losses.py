"""Training losses (config group `loss`): logits (batch, seq, vocab) and targets -> scalar."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.registry import Registry

LOSSES = Registry("loss", group="loss", doc="training objectives on the output logits")


@LOSSES.register("cross_entropy")
class CrossEntropy(nn.Module):
    """Mean next-token cross-entropy in nats, computed in float32."""

    @dataclass
    class Config:
        ignore_index: int = -100
        label_smoothing: float = 0.0

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.flatten(0, -2).float(), targets.flatten(),
            ignore_index=self.cfg.ignore_index, label_smoothing=self.cfg.label_smoothing,
        )
