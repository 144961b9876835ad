"""Training losses (config group `loss`).

A loss maps logits (batch, seq, vocab) and targets to a dict of scalars: `loss` is what is
minimised, every other key is one of its terms, logged as `train/<key>`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.registry import Registry

LOSSES = Registry("loss", group="loss", doc="training objectives on the output logits")


@LOSSES.register("cross_entropy")
class CrossEntropy(nn.Module):
    """Mean next-token cross-entropy in nats (float32), plus an optional z-loss on the logits."""

    @dataclass
    class Config:
        ignore_index: int = -100
        label_smoothing: float = 0.0
        z_loss: float = 0.0  # weight of mean(logsumexp(logits)^2), which keeps the softmax normaliser near 1 (PaLM)

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        logits, targets = logits.flatten(0, -2).float(), targets.flatten()
        ce = F.cross_entropy(logits, targets, ignore_index=self.cfg.ignore_index,
                             label_smoothing=self.cfg.label_smoothing)
        if not self.cfg.z_loss:
            return {"loss": ce}
        keep = targets != self.cfg.ignore_index
        z = logits[keep].logsumexp(dim=-1).pow(2).mean()
        return {"loss": ce + self.cfg.z_loss * z, "ce": ce, "z_loss": z}
