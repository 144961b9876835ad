"""Position-wise feed-forward layers (config group `model/ffn`).

Hidden width `d_ff` defaults to a rule per kind that keeps the parameter count near
8 * d_model**2 per layer: 4 * d_model for two-matrix FFNs, 8/3 * d_model (rounded up to a
multiple of 64) for three-matrix gated ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.registry import Registry

FFNS = Registry("ffn", group="model/ffn", doc="feed-forward layers and their activations")


def glu_hidden(d_model: int, multiple: int = 64) -> int:
    return multiple * math.ceil(8 * d_model / 3 / multiple)


@FFNS.register("swiglu")
class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), the Llama FFN; d_ff defaults to 8/3 d_model."""

    @dataclass
    class Config:
        d_ff: int | None = None

    def __init__(self, d_model: int, cfg: Config):
        super().__init__()
        d_ff = cfg.d_ff or glu_hidden(d_model)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@FFNS.register("gelu")
class GeluMLP(nn.Module):
    """down(gelu(up(x))), the GPT-2 FFN; d_ff defaults to 4 d_model."""

    @dataclass
    class Config:
        d_ff: int | None = None
        approximate: str = "tanh"

    def __init__(self, d_model: int, cfg: Config):
        super().__init__()
        d_ff = cfg.d_ff or 4 * d_model
        self.approximate = cfg.approximate
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))
