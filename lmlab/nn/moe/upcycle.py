"""Sparse upcycling (Komatsuzaki et al., 2022): an MoE model whose experts start as the dense FFN.

Every weight of the dense model is copied to the parameter of the same name; each MoE layer's
experts all get the dense layer's FFN matrices (optionally perturbed so they can diverge), its
gate keeps its fresh initialisation, and shared experts start with a zero output projection.
With routing weights that sum to 1 and no dropped tokens, the upcycled model computes exactly
the dense model's function at step 0.
"""

from __future__ import annotations

import torch

from lmlab.errors import ConfigError
from lmlab.nn.transformer import Transformer


@torch.no_grad()
def upcycle(dense: Transformer, moe: Transformer, noise: float = 0.0, seed: int = 0) -> None:
    """Copy `dense` into `moe` (the same config but model.moe); `noise` adds noise * std(W) * N(0, 1)
    to each expert's copy of W."""
    source = dense.state_dict()
    used = set()
    generator = torch.Generator().manual_seed(seed)
    for name, target in moe.state_dict().items():
        if name in source:
            if source[name].shape != target.shape:
                raise ConfigError(f"upcycle: {name} has shape {tuple(source[name].shape)} in the dense model but "
                                  f"{tuple(target.shape)} in the MoE model; only model.moe may differ")
            target.copy_(source[name])
            used.add(name)
        elif ".experts." in name:
            layer, proj = name.split(".experts.")
            weight = source.get(f"{layer}.{proj}.weight")
            if weight is None or weight.shape != target.shape[1:]:
                raise ConfigError(f"upcycle: no dense {layer}.{proj}.weight of shape {tuple(target.shape[1:])} for "
                                  f"{name}; the experts must have the dense FFN's width (leave model.moe.d_ff unset)")
            jitter = noise * weight.std() * torch.randn(target.shape, generator=generator) if noise else 0.0
            target.copy_(weight.expand_as(target) + jitter)
            used.add(f"{layer}.{proj}.weight")
        elif ".shared_experts." in name and name.endswith("down_proj.weight"):
            target.zero_()  # a new branch that adds nothing until training moves it
    unused = sorted(source.keys() - used)
    if unused:
        raise ConfigError(f"upcycle: dense weights with no place in the MoE model: {', '.join(unused[:5])}")
