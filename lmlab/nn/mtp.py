"""Multi-token prediction (DeepSeek-V3): sequential modules that predict tokens further ahead.

Module d (1..depth) at position t combines the previous depth's hidden state at t with the
embedding of token t+d, runs one Transformer block, and predicts token t+d+1 through the
model's shared output head. Depth 0 is the main model (predicting t+1). The modules only add
training signal: generation uses the main head and can drop them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.blocks import BLOCKS
from lmlab.nn.norms import NORMS
from lmlab.nn.positions import PositionEncoding


@dataclass
class MTPConfig:
    depth: int = 0  # extra modules predicting tokens t+2 .. t+depth+1; 0: off
    loss_weight: float = 0.3  # weight of the mean loss over the depths (DeepSeek-V3: 0.3, later 0.1)


def check_mtp(cfg: MTPConfig) -> None:
    if cfg.depth < 0 or cfg.loss_weight < 0:
        raise ConfigError(f"model.mtp.depth and loss_weight must be >= 0, got {cfg.depth} and {cfg.loss_weight}")


class MTPModule(nn.Module):
    """One depth: norm both inputs, project their concatenation to d_model, one block, a final norm."""

    def __init__(self, model_cfg, layer_idx: int):
        super().__init__()
        d = model_cfg.d_model
        self.hnorm = NORMS.build(model_cfg.norm, d)
        self.enorm = NORMS.build(model_cfg.norm, d)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.layer = BLOCKS.build(model_cfg.block, model_cfg, layer_idx=layer_idx)
        self.norm = NORMS.build(model_cfg.norm, d) if self.layer.final_norm else nn.Identity()

    def forward(self, hidden: torch.Tensor, next_embeddings: torch.Tensor, position: PositionEncoding,
                positions: torch.Tensor, cache=None) -> torch.Tensor:
        """hidden (B, S, d) of the previous depth at positions t, next_embeddings (B, S, d) of tokens t+d;
        `cache`: the block's KV cache when drafting with these modules (self-speculation)."""
        x = self.eh_proj(torch.cat([self.hnorm(hidden), self.enorm(next_embeddings)], dim=-1))
        return self.layer(x, position, positions, cache)
