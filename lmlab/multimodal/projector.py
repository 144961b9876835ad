"""Projectors (config group `projector`): a vision encoder's patch features (B, N, in_dim) into the language
model's embedding space (B, N, out_dim), where they stand in for an image marker token (LLaVA).

Entries are built as `Cls(in_dim, out_dim, cfg=Config)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmlab.checks import at_least
from lmlab.registry import Registry

PROJECTORS = Registry("projector", group="projector",
                      doc="vision features -> LM embeddings (task=vlm); built as Cls(in_dim, out_dim, cfg=Config)")


@PROJECTORS.register("linear")
class LinearProjector(nn.Module):
    """One linear map from the encoder's width to the LM's d_model (LLaVA 1)."""

    @dataclass
    class Config:
        bias: bool = True

    def __init__(self, in_dim: int, out_dim: int, cfg: Config):
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim, bias=cfg.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features)


@PROJECTORS.register("mlp")
class MLPProjector(nn.Module):
    """Linear, GELU, linear (LLaVA 1.5); the hidden width defaults to the LM's d_model."""

    @dataclass
    class Config:
        hidden: int | None = None  # None: out_dim

        def __post_init__(self) -> None:
            at_least("projector", self, 1, "hidden")

    def __init__(self, in_dim: int, out_dim: int, cfg: Config):
        super().__init__()
        hidden = cfg.hidden or out_dim
        self.up = nn.Linear(in_dim, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, out_dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(features)))
