"""The optimizer registry (config group `optim`): each entry builds one torch optimizer for a model.

Every entry's Config has `lr` (the peak learning rate, which the schedule scales), `weight_decay`
(the default of its rules) and `groups`, the rules that split the parameters by role (see
lmlab/optim/groups.py). Overrides look like `optim.groups.1.lr_mult=0.5`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.optim.adafactor import Adafactor
from lmlab.optim.adam import Adam, AdamW
from lmlab.optim.groups import GroupRule, Part, build_optimizer, decay_matrices
from lmlab.optim.lion import Lion
from lmlab.optim.muon import Muon
from lmlab.optim.sgd import SGD
from lmlab.registry import Registry

OPTIMIZERS = Registry("optim", group="optim", doc="optimizers; built as target(model, cfg=Config)")


@dataclass
class AdamWConfig:
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    # bf16 weights and moments (trainer.precision=bf16-true) written with stochastic rounding, which keeps the
    # updates that round-to-nearest loses (lmlab.optim.stochastic_rounding); float32 ones are unaffected
    stochastic_rounding: bool = True
    # the moments' dtype: float32 keeps them in float32 under bf16 weights (Adam then moves 22 bytes a parameter
    # instead of 14); None: the weights' dtype
    state_dtype: str | None = None
    groups: list[GroupRule] = field(default_factory=decay_matrices)


def _state_dtype(name: str | None) -> torch.dtype | None:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name is not None and name not in dtypes:
        raise ConfigError(f"optim.state_dtype must be float32 or bfloat16 (or null: the weights' dtype), got '{name}'")
    return None if name is None else dtypes[name]


@OPTIMIZERS.register("adamw", config=AdamWConfig)
def adamw(model: nn.Module, cfg: AdamWConfig) -> torch.optim.Optimizer:
    """AdamW (lmlab's own, matches torch.optim.AdamW); decay on matrices only."""
    make = partial(AdamW, betas=tuple(cfg.betas), eps=cfg.eps, stochastic_rounding=cfg.stochastic_rounding,
                   state_dtype=_state_dtype(cfg.state_dtype))
    return build_optimizer(model, cfg.groups, cfg.weight_decay, {"adamw": Part(cfg.lr, make)})


@dataclass
class AdamConfig:
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0  # an L2 penalty in the gradient (coupled), unlike adamw's
    stochastic_rounding: bool = True  # as adamw's
    state_dtype: str | None = None  # as adamw's
    groups: list[GroupRule] = field(default_factory=decay_matrices)


@OPTIMIZERS.register("adam", config=AdamConfig)
def adam(model: nn.Module, cfg: AdamConfig) -> torch.optim.Optimizer:
    """Adam with L2 penalty (matches torch.optim.Adam)."""
    make = partial(Adam, betas=tuple(cfg.betas), eps=cfg.eps, stochastic_rounding=cfg.stochastic_rounding,
                   state_dtype=_state_dtype(cfg.state_dtype))
    return build_optimizer(model, cfg.groups, cfg.weight_decay, {"adam": Part(cfg.lr, make)})


@dataclass
class SGDConfig:
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0  # an L2 penalty in the gradient
    groups: list[GroupRule] = field(default_factory=decay_matrices)


@OPTIMIZERS.register("sgd", config=SGDConfig)
def sgd(model: nn.Module, cfg: SGDConfig) -> torch.optim.Optimizer:
    """SGD with heavy-ball or Nesterov momentum (matches torch.optim.SGD)."""
    make = partial(SGD, momentum=cfg.momentum, nesterov=cfg.nesterov)
    return build_optimizer(model, cfg.groups, cfg.weight_decay, {"sgd": Part(cfg.lr, make)})


@dataclass
class LionConfig:
    # The paper's rule of thumb against AdamW: 3-10x smaller lr, 3-10x larger decay (here 10x adamw's).
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float = 1.0
    groups: list[GroupRule] = field(default_factory=decay_matrices)


@OPTIMIZERS.register("lion", config=LionConfig)
def lion(model: nn.Module, cfg: LionConfig) -> torch.optim.Optimizer:
    """Lion: sign of interpolated momentum (Chen et al. 2023); half of Adam's optimizer memory."""
    make = partial(Lion, betas=tuple(cfg.betas))
    return build_optimizer(model, cfg.groups, cfg.weight_decay, {"lion": Part(cfg.lr, make)})


@dataclass
class AdafactorConfig:
    lr: float = 1e-2  # relative: a step moves a weight by about lr times its RMS
    beta2_decay: float = -0.8  # second-moment decay 1 - step^beta2_decay
    eps1: float | None = None  # guards the second moment; None: the dtype's machine epsilon
    eps2: float = 1e-3  # smallest weight RMS the relative step is taken of
    clip_threshold: float = 1.0  # updates are scaled down to RMS <= this
    weight_decay: float = 0.0
    groups: list[GroupRule] = field(default_factory=decay_matrices)


@OPTIMIZERS.register("adafactor", config=AdafactorConfig)
def adafactor(model: nn.Module, cfg: AdafactorConfig) -> torch.optim.Optimizer:
    """Adafactor: factored second moment, relative steps (matches torch.optim.Adafactor)."""
    make = partial(Adafactor, beta2_decay=cfg.beta2_decay, eps=(cfg.eps1, cfg.eps2), d=cfg.clip_threshold)
    return build_optimizer(model, cfg.groups, cfg.weight_decay, {"adafactor": Part(cfg.lr, make)})


def muon_rules() -> list[GroupRule]:
    return [GroupRule(roles=["matrix", "expert"], optimizer="muon"),
            GroupRule(roles=["embedding", "head", "conv"], optimizer="adamw"),
            GroupRule(roles=["norm", "bias"], optimizer="adamw", weight_decay=0.0)]


@dataclass
class MuonConfig:
    lr: float = 0.02  # Muon's; its update is orthogonalised, so this is not on AdamW's scale
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    weight_decay: float = 0.0  # decoupled; the default of every rule, Muon's and AdamW's
    adamw_lr: float = 3e-3  # the AdamW part: embeddings, head, gains, biases
    adamw_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    adamw_eps: float = 1e-8
    groups: list[GroupRule] = field(default_factory=muon_rules)


@OPTIMIZERS.register("muon", config=MuonConfig)
def muon(model: nn.Module, cfg: MuonConfig) -> torch.optim.Optimizer:
    """Muon for hidden matrices (Newton-Schulz orthogonalised momentum), AdamW for the rest."""
    make_muon = partial(Muon, momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps)
    make_adamw = partial(AdamW, betas=tuple(cfg.adamw_betas), eps=cfg.adamw_eps)
    return build_optimizer(model, cfg.groups, cfg.weight_decay,
                           {"muon": Part(cfg.lr, make_muon), "adamw": Part(cfg.adamw_lr, make_adamw)})
