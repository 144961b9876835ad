"""Quantization-aware training (config group `qat`): train through the rounding that `quantize` will apply.

A `qat` entry makes the Linears that the same-named `quant` entry quantizes multiply by their weight
fake-quantised: rounded to nearest on the entry's grid (with `grid.py`'s functions, as
`quant.method=rtn` rounds) and mapped back to floats,

    Q(w) = (clamp(round((w - zero) / scale) + mid, qmin, qmax) - mid) * scale + zero,

with scale and zero per output row (int8) or per group of input columns (int4) from the current
weights. Rounding has zero gradient almost everywhere, so the backward pass uses the straight-through
estimator (Bengio et al. 2013): dL/dw := dL/dQ(w), i.e. the gradient of the loss at the quantized
point, applied to the float master weights. The layer computes that as

    w_q = Q(sg(w)) + (w - sg(w))      (sg: stop-gradient; w - sg(w) is exactly 0)

so its value is bit-for-bit the grid's and its gradient is the identity. The grid spans each group's
[min, max] (its scale and zero follow the weights), so no weight is ever clipped and no gradient
mask is needed. The float master weights keep updates smaller than a grid step, which would be lost
if the weights themselves were rounded; the loss sees only the rounded ones, so training settles
where rounding costs little. Post-training quantization with round-to-nearest then reproduces the
trained forward exactly; GPTQ picks other codes, near but not equal.

    lmlab-train qat=int8
    lmlab-train qat=int4 qat.group_size=64        # then: lmlab generate quant=int4 quant.group_size=64

Each quantized Linear becomes a `FakeQuantLinear`: an `nn.Linear` holding the same Parameter objects,
so parameter names, optimizer roles and the state dict are the plain model's, the saved weights are
the float master weights, and a checkpoint loads into a plain `Transformer` and into `quantize` as it
is. (torch.nn.utils.parametrize would rename the weight to `parametrizations.weight.original` and
make `lm_head.weight` a computed tensor, which optimizer groups no longer recognise as the head.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError
from lmlab.inference.quant.grid import INT4, INT8, Grid, round_to_nearest
from lmlab.inference.quant.quantize import quantize_targets
from lmlab.inference.quant.registry import check_group_size_choice, int4_group_size
from lmlab.nn.transformer import Transformer
from lmlab.registry import Registry

QATS = Registry("qat", group="qat", doc="quantization-aware training: fake-quantised weights for a quant entry")


def fake_quantize(weight: torch.Tensor, grid: Grid, group_size: int) -> torch.Tensor:
    """`weight` (N, K) rounded to nearest on `grid` per group of `group_size` columns, with the identity
    as its gradient (the straight-through estimator)."""
    n, k = weight.shape
    codes, scale, zero = round_to_nearest(weight.detach(), grid, group_size, None, 0.0)
    rounded = grid.values(codes.view(n, -1, group_size), scale[..., None], zero[..., None]).view(n, k)
    return rounded.to(weight.dtype) + (weight - weight.detach())


class FakeQuantLinear(nn.Linear):
    """nn.Linear that multiplies by its weight fake-quantised; it holds the replaced Linear's own parameters."""

    def __init__(self, linear: nn.Linear, grid: Grid, group_size: int, active: bool = True):
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.grid, self.group_size = grid, group_size
        self.active = active  # False: a plain Linear (before qat.start_step)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = fake_quantize(self.weight, self.grid, self.group_size) if self.active else self.weight
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, qmin={self.grid.qmin}, qmax={self.grid.qmax}, group_size={self.group_size}"


class WeightQAT:
    """What the fake-quantising entries share: the Linears `quantize` would quantize, and their grid."""

    grid: Grid

    def __init__(self, cfg):
        self.cfg = cfg

    def group_size(self, name: str, linear: nn.Linear) -> int:
        return linear.in_features  # one group: the whole row

    def install(self, model: Transformer) -> int:
        """Make `model`'s targets FakeQuantLinears, in place; returns how many. Every check runs before any change."""
        if self.cfg.start_step < 0:
            raise ConfigError(f"qat.start_step must be >= 0, got {self.cfg.start_step}")
        targets = quantize_targets(model, self.cfg.quantize_head)
        sizes = {name: self.group_size(name, linear) for name, linear in targets.items()}
        for name, linear in targets.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    FakeQuantLinear(linear, self.grid, sizes[name], active=self.cfg.start_step == 0))
        return len(targets)

    def at_step(self, model: nn.Module, step: int) -> None:
        """Before training step `step`: fake-quantise from qat.start_step on (full precision before)."""
        for module in model.modules():
            if isinstance(module, FakeQuantLinear):
                module.active = step >= self.cfg.start_step


@QATS.register("none")
class NoQAT:
    """Full-precision weights (the default): the model is left as built."""

    def __init__(self, cfg):
        self.cfg = cfg

    def install(self, model: Transformer) -> int:
        return 0

    def at_step(self, model: nn.Module, step: int) -> None:
        pass


@dataclass
class Int8QATConfig:
    quantize_head: bool = True  # lm_head too; match the quant.quantize_head you will run (quant=int8: true)
    start_step: int = 0  # full precision until this step, fake-quantised after it (QAT as a final phase)


@QATS.register("int8", config=Int8QATConfig)
class Int8QAT(WeightQAT):
    """Train for quant=int8: weights fake-quantised to symmetric int8, one scale per output channel."""

    grid = INT8


@dataclass
class Int4QATConfig:
    group_size: int = 128  # 32, 64 or 128 input columns share a scale and zero: the quant.group_size you will run
    quantize_head: bool = False  # lm_head too; match the quant.quantize_head you will run (quant=int4: false)
    start_step: int = 0  # full precision until this step, fake-quantised after it (QAT as a final phase)


@QATS.register("int4", config=Int4QATConfig)
class Int4QAT(WeightQAT):
    """Train for quant=int4: weights fake-quantised to asymmetric int4 per group of input columns."""

    grid = INT4

    def __init__(self, cfg: Int4QATConfig):
        check_group_size_choice("qat", cfg.group_size, " (the group sizes quant=int4 runs)")
        super().__init__(cfg)

    def group_size(self, name: str, linear: nn.Linear) -> int:
        return int4_group_size("qat", self.cfg.group_size, name, linear)
