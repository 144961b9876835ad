"""Residual block layouts (config group `model/block`)."""

from __future__ import annotations

import torch
from torch import nn

from lmlab.nn.attention import ATTENTION
from lmlab.nn.ffn import FFNS
from lmlab.nn.norms import NORMS
from lmlab.nn.positions import PositionEncoding
from lmlab.registry import Registry

BLOCKS = Registry("block", group="model/block", doc="residual block layouts")


@BLOCKS.register("prenorm")
class PreNormBlock(nn.Module):
    """x + attn(norm(x)), then x + ffn(norm(x)): the GPT-2/Llama layout."""

    def __init__(self, model_cfg, cfg=None):
        super().__init__()
        d = model_cfg.d_model
        self.input_layernorm = NORMS.build(model_cfg.norm, d)
        self.self_attn = ATTENTION.build(model_cfg.attention, d)
        self.post_attention_layernorm = NORMS.build(model_cfg.norm, d)
        self.mlp = FFNS.build(model_cfg.ffn, d)

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), position, positions)
        return x + self.mlp(self.post_attention_layernorm(x))
