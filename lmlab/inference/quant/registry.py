"""The `quant` config group: how `quantize` rounds a model's Linear weights (`quant=int8`, `quant=int4`).

An entry names the integer grid, how many input columns share a scale (a group), the module that
replaces each Linear, and the method that picks the codes (`METHODS`: round to nearest, or GPTQ from
calibration activations).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.inference.quant.gptq import gptq
from lmlab.inference.quant.grid import INT4, INT8, Grid, round_to_nearest
from lmlab.inference.quant.linear import Int4Linear, Int8Linear, QuantLinear, choose_kernel
from lmlab.registry import Registry, unknown_name_message

QUANTS = Registry("quant", group="quant", doc="post-training weight quantization")


@dataclass(frozen=True)
class Method:
    # (weight (N, K), grid, group_size, hessian (K, K) or None, damp) -> codes (N, K), scale and zero (N, groups)
    codes: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    calibrated: bool  # needs the Hessians of the Linears' inputs on calibration batches


METHODS = {"rtn": Method(round_to_nearest, calibrated=False), "gptq": Method(gptq, calibrated=True)}
GROUP_SIZES = (32, 64, 128)


def check_group_size_choice(group: str, size: int, note: str = "") -> None:
    """`{group}.group_size` must be one that the int4 kernels run."""
    if size not in GROUP_SIZES:
        raise ConfigError(f"{group}.group_size must be one of {', '.join(map(str, GROUP_SIZES))}{note}, got {size}")


def int4_group_size(group: str, size: int, name: str, linear: nn.Linear) -> int:
    """`size`, where it divides the Linear's input columns; else one error naming the sizes that do."""
    k = linear.in_features
    if k % size:
        fits = [str(s) for s in GROUP_SIZES if k % s == 0]
        fix = f"use {group}.group_size={' or '.join(fits)}" if fits else f"no group size fits it; use {group}=int8"
        raise ConfigError(f"{name} has in_features={k}, not a multiple of {group}.group_size={size}; {fix}")
    return size


class WeightQuant(ABC):
    """What the entries share: config checks, and the module made from a weight's codes."""

    grid: Grid
    module: type[QuantLinear]

    def __init__(self, cfg):
        if cfg.method not in METHODS:
            raise ConfigError(unknown_name_message("quant.method", cfg.method, METHODS))
        kernels = ["auto", *self.module.kernels]
        if cfg.kernel not in kernels:
            raise ConfigError(unknown_name_message("quant.kernel", cfg.kernel, kernels))
        if not cfg.damp > 0:
            raise ConfigError(f"quant.damp must be > 0 (GPTQ's dampening of the Hessian), got {cfg.damp}")
        self.cfg = cfg
        self.method = METHODS[cfg.method]

    @abstractmethod
    def group_size(self, name: str, linear: nn.Linear) -> int:
        """Input columns per scale in Linear `name`; a ConfigError if the entry cannot split its rows."""

    def kernel(self, name: str, linear: nn.Linear) -> str:
        return choose_kernel(self.module.kernels, self.module.auto, self.cfg.kernel, name, linear.weight)

    def replace(self, linear: nn.Linear, group_size: int, kernel: str, hessian: torch.Tensor | None) -> QuantLinear:
        codes, scale, zero = self.method.codes(linear.weight, self.grid, group_size, hessian, self.cfg.damp)
        return self.build(codes, scale.to(linear.weight.dtype), zero.to(linear.weight.dtype), linear, kernel)

    @abstractmethod
    def build(self, codes, scale, zero, linear: nn.Linear, kernel: str) -> QuantLinear:
        """The module for `linear` from its codes (N, K) and per-group scale and zero (N, groups)."""


@dataclass
class Int8Config:
    method: str = "rtn"  # rtn | gptq; per-channel int8 is near-lossless with rtn
    damp: float = 0.01  # gptq: this fraction of the Hessian's mean diagonal is added to it
    quantize_head: bool = True  # lm_head too
    kernel: str = "auto"  # auto | dequant | int8pack_mm


@QUANTS.register("int8", config=Int8Config)
class Int8Quant(WeightQuant):
    """Weight-only int8, one symmetric scale per output channel (row of each Linear's weight)."""

    grid, module = INT8, Int8Linear

    def group_size(self, name: str, linear: nn.Linear) -> int:
        return linear.in_features  # one group: the whole row

    def build(self, codes, scale, zero, linear: nn.Linear, kernel: str) -> QuantLinear:
        return Int8Linear(codes, scale[:, 0], linear.bias, kernel)


@dataclass
class Int4Config:
    group_size: int = 128  # 32, 64 or 128 input columns share a scale and zero
    method: str = "gptq"  # gptq (needs calibration batches) | rtn
    damp: float = 0.01  # gptq: this fraction of the Hessian's mean diagonal is added to it
    quantize_head: bool = False  # the head's rounding errors land directly on every logit
    kernel: str = "auto"  # auto | dequant | int4pack_mm


@QUANTS.register("int4", config=Int4Config)
class Int4Quant(WeightQuant):
    """Weight-only int4, an asymmetric scale and zero per group of input columns; GPTQ or round-to-nearest."""

    grid, module = INT4, Int4Linear

    def __init__(self, cfg: Int4Config):
        check_group_size_choice("quant", cfg.group_size)
        super().__init__(cfg)

    def group_size(self, name: str, linear: nn.Linear) -> int:
        return int4_group_size("quant", self.cfg.group_size, name, linear)

    def build(self, codes, scale, zero, linear: nn.Linear, kernel: str) -> QuantLinear:
        return Int4Linear(codes, scale, zero, self.cfg.group_size, linear.bias, kernel)
