"""Position-wise feed-forward layers (config group `model/ffn`).

Two families, each a base class whose entries differ only in their activation `act`:

- `MLP`, two matrices: down(act(up(x))); d_ff defaults to 4 * d_model.
- `GLU`, three matrices: down(act(gate(x)) * up(x)); d_ff defaults to 8/3 * d_model, rounded
  up to a multiple of 64 (`glu_hidden`).

Both defaults keep the parameter count near 8 * d_model**2 per layer, so swapping
`model/ffn` compares activations at (nearly) the same size.

Each entry declares its own `Config` subclass, even when it adds no field: the registry
finds the entry of a Config instance by its class, so entries must not share one.

An FFN writes its formula once, in `combine(x, proj)`, in terms of its named projections
(`projections`); `forward` applies its own Linear layers. A mixture of experts runs the same
formula with each projection replaced by E stacked expert matrices (lmlab.nn.moe.experts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.fused import fused_outputs

Projection = Callable[[str, torch.Tensor], torch.Tensor]  # (projection name, input) -> input @ W.T
from lmlab.registry import Registry

FFNS = Registry("ffn", group="model/ffn", doc="feed-forward layers and their activations")

GELU_APPROXIMATIONS = ("none", "tanh")


def glu_hidden(d_model: int, multiple: int = 64) -> int:
    return multiple * math.ceil(8 * d_model / 3 / multiple)


def _check_gelu_approximate(value: str) -> str:
    # F.gelu would only complain at the first forward pass; fail while building instead.
    if value not in GELU_APPROXIMATIONS:
        raise ConfigError(f"ffn.approximate must be one of {', '.join(GELU_APPROXIMATIONS)}, got '{value}'")
    return value


class FFN(nn.Module):
    """Base of the FFN families: `forward` runs `combine` with the module's own Linear layers."""

    projections: tuple[str, ...] = ()

    def act(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, x: torch.Tensor, proj: Projection) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_outputs(self, x)  # the projections of x, from one matmul, where an inference engine fused them
        return self.combine(x, lambda name, h: fused[name] if name in fused else getattr(self, name)(h))


class MLP(FFN):
    """down(act(up(x))): the two-matrix FFN; subclasses define the activation `act`."""

    projections = ("up_proj", "down_proj")

    @dataclass
    class Config:
        d_ff: int | None = None  # None: 4 * d_model

    def __init__(self, d_model: int, cfg: Config):
        super().__init__()
        d_ff = cfg.d_ff or 4 * d_model
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def combine(self, x: torch.Tensor, proj: Projection) -> torch.Tensor:
        return proj("down_proj", self.act(proj("up_proj", x)))


@FFNS.register("relu")
class ReluMLP(MLP):
    """down(relu(up(x))), the original Transformer FFN; d_ff defaults to 4 d_model."""

    @dataclass
    class Config(MLP.Config):
        pass

    def act(self, h):
        return F.relu(h)


@FFNS.register("gelu")
class GeluMLP(MLP):
    """down(gelu(up(x))), the GPT-2 FFN; d_ff defaults to 4 d_model."""

    @dataclass
    class Config(MLP.Config):
        approximate: str = "tanh"  # "tanh" (GPT-2) or "none" (exact erf)

    def __init__(self, d_model: int, cfg: Config):
        super().__init__(d_model, cfg)
        self.approximate = _check_gelu_approximate(cfg.approximate)

    def act(self, h):
        return F.gelu(h, approximate=self.approximate)


@FFNS.register("silu")
class SiluMLP(MLP):
    """down(silu(up(x))), an ungated SiLU (Swish) FFN; d_ff defaults to 4 d_model."""

    @dataclass
    class Config(MLP.Config):
        pass

    def act(self, h):
        return F.silu(h)


@FFNS.register("squared_relu")
class SquaredReluMLP(MLP):
    """down(relu(up(x))**2), the Primer FFN; d_ff defaults to 4 d_model."""

    @dataclass
    class Config(MLP.Config):
        pass

    def act(self, h):
        return F.relu(h).square()


class GLU(FFN):
    """down(act(gate(x)) * up(x)): the gated three-matrix FFN; subclasses define `act`."""

    projections = ("gate_proj", "up_proj", "down_proj")
    fusable_projections = ("gate_proj", "up_proj")  # both read x (lmlab.nn.fused)

    @dataclass
    class Config:
        d_ff: int | None = None  # None: glu_hidden(d_model), about 8/3 * d_model

    def __init__(self, d_model: int, cfg: Config):
        super().__init__()
        d_ff = cfg.d_ff or glu_hidden(d_model)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up

    def combine(self, x: torch.Tensor, proj: Projection) -> torch.Tensor:
        return proj("down_proj", self.gated(proj("gate_proj", x), proj("up_proj", x)))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The reference SwiGLU activation, silu(gate) * up."""
    return F.silu(gate) * up


@FFNS.register("swiglu")
class SwiGLU(GLU):
    """down(silu(gate(x)) * up(x)), the Llama FFN; d_ff defaults to 8/3 d_model."""

    @dataclass
    class Config(GLU.Config):
        pass

    def __init__(self, d_model: int, cfg: Config):
        super().__init__(d_model, cfg)
        self.kernel = swiglu  # (gate, up) -> silu(gate) * up; `kernels=` may swap in a fused one

    def use_kernels(self, ops) -> None:
        if ops.swiglu is not None:
            self.kernel = ops.swiglu

    def act(self, h):
        return F.silu(h)

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.kernel(gate, up)


@FFNS.register("geglu")
class GeGLU(GLU):
    """down(gelu(gate(x)) * up(x)), the GEGLU FFN (T5 v1.1, Gemma); d_ff defaults to 8/3 d_model."""

    @dataclass
    class Config(GLU.Config):
        approximate: str = "tanh"  # "tanh" (T5 v1.1, Gemma) or "none" (exact erf)

    def __init__(self, d_model: int, cfg: Config):
        super().__init__(d_model, cfg)
        self.approximate = _check_gelu_approximate(cfg.approximate)

    def act(self, h):
        return F.gelu(h, approximate=self.approximate)
