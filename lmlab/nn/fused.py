"""Fused projections: a module's Linears that read the same input, run as one matmul.

A module lists them in `fusable_projections` (attention: q, k and v; gated FFNs: gate and up).
`fuse_projections(model)` (what the inference engine calls) concatenates each such group's weights
into one tensor and makes every Linear's weight a view of its rows, so no memory is duplicated and
in-place updates (optimizer steps, `load_state_dict`) reach both. The module's forward asks
`fused_outputs(self, x)` for the projections of x: one matmul then replaces several, which at decode
time, where each matmul reads its weights to multiply a few rows, saves launches and reads.

The fused path runs only without autograd (the Linears' parameters need their own gradients), while
the group still holds the module's current parameters (replacing a Linear, as quantization does, or
its parameter, as sharding does, silently returns the module to its own Linears), and while no forward
hook watches one of its Linears (GPTQ's calibration and activation probes must see every call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def make_views(params: list[torch.Tensor], packed: torch.Tensor) -> None:
    """Make each parameter a view of its slice of `packed` (the parameters' elements, one after another)."""
    offset = 0
    for param in params:
        param.data = packed.view(-1)[offset:offset + param.numel()].view(param.shape)
        offset += param.numel()


def are_views(params: list[torch.Tensor], packed: torch.Tensor) -> bool:
    """Every parameter is still its slice of `packed` (none replaced, moved or cast since `make_views`)."""
    pointer, size = packed.data_ptr(), packed.element_size()
    for param in params:
        if param.data_ptr() != pointer or param.device != packed.device or param.dtype != packed.dtype:
            return False
        pointer += param.numel() * size
    return True


class FusedLinears:
    """One weight for several bias-free Linears of one module; calling it returns their outputs."""

    def __init__(self, module: nn.Module, names: tuple[str, ...]):
        linears = [getattr(module, name) for name in names]
        self.names = names
        self.params = tuple(linear.weight for linear in linears)
        self.sizes = [linear.out_features for linear in linears]
        self.weight = torch.cat([p.detach() for p in self.params])
        make_views(list(self.params), self.weight)

    def serves(self, module: nn.Module) -> bool:
        """The module still has these parameters (no Linear or parameter was replaced since)."""
        return all(getattr(getattr(module, name), "weight", None) is param for name, param in zip(self.names, self.params))

    def watched(self, module: nn.Module) -> bool:
        """A forward hook (module or global) would miss the Linears' calls if they ran fused."""
        hooks = nn.modules.module
        if hooks._global_forward_pre_hooks or hooks._global_forward_hooks:
            return True
        return any(getattr(module, name)._forward_pre_hooks or getattr(module, name)._forward_hooks
                   for name in self.names)

    def aliased(self) -> bool:
        """Every parameter is still a view of the fused weight (a device move breaks that)."""
        return are_views(list(self.params), self.weight)

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, F.linear(x, self.weight).split(self.sizes, dim=-1)))


def fusable(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Plain bias-free Linears with plain-tensor weights of one dtype, device and input width."""
    linears = [getattr(module, name, None) for name in names]
    if len(names) < 2 or not all(type(linear) is nn.Linear and linear.bias is None for linear in linears):
        return False
    weights = [linear.weight for linear in linears]
    return (all(type(w.data) is torch.Tensor for w in weights)
            and len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every module's `fusable_projections` that can be (again, where a group went stale);
    returns the number of fused groups. The weights made are ordinary tensors even under inference mode."""
    with torch.inference_mode(False), torch.no_grad():
        return _fuse_all(model)


def _fuse_all(model: nn.Module) -> int:
    fused = 0
    for module in model.modules():
        names = getattr(module, "fusable_projections", ())
        group = module.__dict__.get("fused_projections")
        if group is not None and group.serves(module) and group.aliased():
            fused += 1
        elif fusable(module, names):
            module.fused_projections = FusedLinears(module, names)
            fused += 1
        elif group is not None:
            module.fused_projections = None
    return fused


def fused_outputs(module: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: projection of x} of the module's fused group, or {} where the module must run its own
    Linears (not fused, autograd on, the group no longer serves the module, or hooks watch them)."""
    group = module.__dict__.get("fused_projections")
    if group is None or torch.is_grad_enabled() or not group.serves(module) or group.watched(module):
        return {}
    return group(x)
