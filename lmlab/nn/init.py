"""Weight initialisation schemes (config group `model/init`).

A scheme is applied once to a freshly built model (`scheme.apply(model)`). It may also set the
model's forward multipliers (output logits, attention scale) and return learning-rate
multipliers per parameter name, which the optimizer turns into parameter groups: that is how
muP's per-layer learning rates reach the optimizer without the optimizer knowing about muP.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from lmlab.nn.moe.experts import Experts
from lmlab.registry import Registry

INITS = Registry("init", group="model/init", doc="weight initialisation (and muP's width multipliers)")

# Projections that write into the residual stream (dense and expert FFNs, attention, Mamba-2's out_proj).
RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "experts.down_proj", "out_proj.weight")


class Matrix(NamedTuple):
    name: str
    weight: torch.Tensor
    fan_in: int
    embedding: bool


def _matrices(model: nn.Module) -> Iterator[Matrix]:
    """Every weight matrix: Linear and Embedding weights (tied ones once) and each stack of
    expert matrices (one initialisation per expert, by the fan-in of one expert)."""
    seen = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            embedding = isinstance(module, nn.Embedding)
            yield Matrix(f"{name}.weight", module.weight, 0 if embedding else module.in_features, embedding)
        elif isinstance(module, Experts):
            for proj in module.ffn.projections:
                weight = getattr(module, proj)
                yield Matrix(f"{name}.{proj}", weight, weight.shape[-1], False)


@INITS.register("standard")
class StandardInit:
    """PyTorch-style: Linear weights N(0, 1/fan_in), embeddings N(0, 1)."""

    def __init__(self, cfg=None):
        pass

    def apply(self, model: nn.Module) -> dict[str, float]:
        for m in _matrices(model):
            nn.init.normal_(m.weight, std=1.0 if m.embedding else m.fan_in**-0.5)
        return {}


@INITS.register("gpt2")
class GPT2Init:
    """N(0, std) everywhere; residual-stream outputs scaled by 1/sqrt(2 n_layers) (GPT-2)."""

    @dataclass
    class Config:
        std: float = 0.02

    def __init__(self, cfg: Config):
        self.std = cfg.std

    def apply(self, model: nn.Module) -> dict[str, float]:
        for m in _matrices(model):
            nn.init.normal_(m.weight, std=self.std * _depth_scale(model, m))
        return {}


def _depth_scale(model: nn.Module, matrix: Matrix) -> float:
    """1/sqrt(2 n_layers loops) for a projection that writes into the residual stream, else 1: each layer adds two
    residual branches, and shrinking their outputs keeps the stream's variance from growing with depth."""
    return 1 / math.sqrt(2 * model.effective_depth) if matrix.name.endswith(RESIDUAL_OUTPUTS) else 1.0


@INITS.register("mup")
class MuPInit:
    """muP (Tensor Programs V): hyperparameters tuned at base_d_model transfer to wider models."""

    @dataclass
    class Config:
        base_d_model: int = 128  # the width at which muP equals the gpt2 scheme
        std: float = 0.02
        readout_zero_init: bool = False

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def apply(self, model: nn.Module) -> dict[str, float]:
        """With m = d_model / base_d_model: hidden matrices get std / sqrt(m) (variance ~ 1/fan_in)
        and learning rate / m (Adam); embeddings and the readout keep std and learning rate; the
        logits are multiplied by 1/m; attention scores use 1/head_dim scaling (1/sqrt(head_dim * m)
        here, which equals 1/sqrt(head_dim) at the base width). Residual-stream outputs keep gpt2's
        depth scaling (a width-independent factor), so that at m = 1 this is gpt2's scheme exactly."""
        m = model.embed_tokens.embedding_dim / self.cfg.base_d_model
        lr_multipliers = {}
        for matrix in _matrices(model):
            readout = not matrix.embedding and matrix.weight is model.lm_head.weight
            if readout or matrix.embedding:
                std = 0.0 if readout and self.cfg.readout_zero_init else self.cfg.std
            else:
                std = self.cfg.std * _depth_scale(model, matrix) / math.sqrt(m)
                lr_multipliers[matrix.name] = 1 / m
            nn.init.normal_(matrix.weight, std=std) if std else nn.init.zeros_(matrix.weight)
        model.output_multiplier = 1 / m
        for module in model.modules():
            if hasattr(module, "set_score_scale"):
                module.set_score_scale(1 / math.sqrt(module.head_dim * m))
        return lr_multipliers
