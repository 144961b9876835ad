"""ZeRO stage 3, or fully sharded data parallelism (Rajbhandari et al. 2020; Zhao et al. 2023), written
to be read:

    model = FSDP(model)                          # each rank now keeps 1/world_size of every weight
    optimizer = AdamW(model.parameters(), ...)   # over the shards
    loss = loss_fn(model(x_shard), y_shard)      # a mean over the rank's shard of the batch
    loss.backward()
    model.finish_gradient_synchronization()      # each shard's .grad: the mean over the ranks
    optimizer.step()
    full = model.gather_full_params()            # name -> whole tensor, on every rank

Shards. A parameter is cut along its first dimension, padded to a multiple of world_size: rank r keeps
rows [r k, (r + 1) k). Outside forward and backward each parameter *is* its shard (its `.data`), so an
optimizer, its parameter groups, gradient clipping and the weights' memory all see 1/world_size. An
elementwise optimizer (SGD, AdamW, Lion) then takes exactly the step it takes unsharded; one that
needs whole matrices (Muon) would see only rows.

Units. Each module of `unit_types` (the Transformer's blocks) is a unit; what is left (embedding, final
norm, head) is the root unit. Before a unit runs, one all-gather of its shards, concatenated, makes
every parameter whole; after it runs, the parameters are shards again, so whole weights exist for one
unit at a time. In backward, a hook on the unit's output gathers it again before its gradients are
computed. When the gradient reaches the unit's input (a marker applied there in forward), its full
gradients are reduce-scattered: each rank receives the sum of its rows, and divides by world_size.
The whole gradients and weights are freed. The root stays whole from the start of forward to
`finish_gradient_synchronization`: its embedding runs first and its head last.

Mixed precision. With compute_dtype=torch.bfloat16 the shards stay float32 (the master weights, and
the optimizer's state), units are gathered as bfloat16 copies, and gradients are reduce-scattered in
float32.

Every rank makes the same collectives in the same order: the units run in the same order everywhere,
and whether a parameter had a gradient is agreed per unit before its reduction (a branch some ranks'
data did not take counts as a zero gradient there; one no rank took keeps `.grad` as it was, as in
one process). Frozen parameters are not sharded: they stay whole on every rank. Each unit must run
once per forward (no recomputation in backward).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmlab.parallel.comm import (all_gather_single, broadcast_module, load_whole_tensors, map_optimizer_state,
                                 reduce_scatter_single)


class _ReduceWhenReached(torch.autograd.Function):
    """Identity on a unit's input; its backward runs once the unit's gradients are all accumulated."""

    @staticmethod
    def forward(ctx, unit: _Unit, x: torch.Tensor) -> torch.Tensor:
        ctx.unit = unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.unit.reduce_gradients()
        return None, grad


class _Unit:
    """A group of parameters gathered, used and freed together."""

    def __init__(self, params: list[nn.Parameter], compute_dtype: torch.dtype | None):
        self.params = params
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.shapes = [p.shape for p in params]
        self.rows = [shape[0] if len(shape) else 1 for shape in self.shapes]
        self.shard_rows = [math.ceil(rows / self.world) for rows in self.rows]
        self.shard_numel = [k * math.prod(shape[1:]) for k, shape in zip(self.shard_rows, self.shapes)]
        self.compute_dtype = compute_dtype
        self.shards: list[torch.Tensor] = []
        # A shard gradient from an earlier backward (micro-batches accumulating), set aside while this
        # backward's whole gradient accumulates: moved when that gradient arrives, not when the unit is
        # gathered, so an optimizer's zero_grad between forward and backward (Lightning's order) still clears it.
        self.saved_grads: list[torch.Tensor | None] = [None] * len(params)
        self.arrived = [False] * len(params)  # this backward's gradient reached parameter i
        for i, p in enumerate(params):
            p.register_hook(self._set_aside(i))
        self.whole = False
        self.reduced = False

    def _set_aside(self, i: int):
        def hook(grad: torch.Tensor) -> None:  # runs just before autograd accumulates `grad` into .grad
            p = self.params[i]
            if p.grad is not None and not self.arrived[i]:
                self.saved_grads[i], p.grad = p.grad, None
            self.arrived[i] = True

        return hook

    def shard(self) -> None:
        """Keep this rank's rows of each (equal on every rank) parameter."""
        for i, p in enumerate(self.params):
            p.data = self.rows_of(i, p.data)
            self.shards.append(p.data)

    def rows_of(self, i: int, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor shaped like parameter i (the weights, or optimizer state): a shard,
        with the parameter's number of dimensions so that shape rules (no weight decay on vectors) still hold."""
        k, shape = self.shard_rows[i], self.shapes[i]
        rows = self._padded(whole.reshape(self.rows[i], -1), k)
        return rows[self.rank * k:(self.rank + 1) * k].reshape(k, *shape[1:]).clone()

    def whole_of(self, i: int, shard: torch.Tensor) -> torch.Tensor:
        """The inverse of rows_of: every rank's rows of a shard-shaped tensor, gathered (a collective)."""
        gathered = torch.empty(self.world * shard.numel(), dtype=shard.dtype, device=shard.device)
        all_gather_single(gathered, shard.contiguous().flatten())
        return gathered.reshape(-1, *self.shapes[i][1:])[:self.rows[i]].reshape(self.shapes[i])

    def _padded(self, rows: torch.Tensor, k: int) -> torch.Tensor:
        return F.pad(rows, (0, 0, 0, self.world * k - len(rows)))

    def gather(self) -> None:
        """Make every parameter whole: one all-gather of the concatenated shards."""
        if self.whole:
            return
        dtype = self.compute_dtype or self.shards[0].dtype
        local = torch.cat([s.to(dtype).flatten() for s in self.shards])
        gathered = torch.empty(self.world * len(local), dtype=dtype, device=local.device)
        all_gather_single(gathered, local)
        gathered = gathered.view(self.world, -1)  # row r: rank r's shards
        offset = 0
        for i, (p, shape, rows, numel) in enumerate(zip(self.params, self.shapes, self.rows, self.shard_numel)):
            full = gathered[:, offset:offset + numel].reshape(-1, *shape[1:])[:rows]  # ranks' rows in order
            offset += numel
            p.data = full.reshape(shape)
        self.whole = True
        self.reduced = False

    def free(self) -> None:
        """Back to the shards."""
        if not self.whole:
            return
        for p, shard in zip(self.params, self.shards):
            p.data = shard
        self.whole = False

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the whole gradients into averaged shard gradients (added to any saved ones), then free."""
        if self.reduced or not self.whole:
            return
        for i, p in enumerate(self.params):  # no gradient this time: what .grad holds is an earlier shard's
            if not self.arrived[i] and p.grad is not None:
                self.saved_grads[i], p.grad = p.grad, None
        present = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32,
                               device=self.shards[0].device)
        dist.all_reduce(present)  # agreed first: a gradient missing on some ranks is zero there
        rows = []
        for i, (p, k) in enumerate(zip(self.params, self.shard_rows)):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            rows.append(self._padded(grad.float().reshape(self.rows[i], -1), k).reshape(self.world, -1))
        mine = torch.empty(sum(self.shard_numel), dtype=torch.float32, device=self.shards[0].device)
        reduce_scatter_single(mine, torch.cat(rows, dim=1).flatten())
        mine.div_(self.world)
        for p in self.params:
            p.grad = None  # the whole gradients: reduced now
        self.reduced = True
        self.free()  # shards again, before their shard gradients can be assigned
        for i, (p, shard, grad, anywhere) in enumerate(zip(self.params, self.shards, mine.split(self.shard_numel),
                                                           present.tolist())):
            saved, self.saved_grads[i], self.arrived[i] = self.saved_grads[i], None, False
            grad = grad.view_as(shard).to(shard.dtype) if anywhere else None
            p.grad = saved if grad is None else grad if saved is None else saved + grad


class FSDP(nn.Module):
    """Wraps a module with every trainable parameter sharded across the ranks; see the module docstring."""

    def __init__(self, module: nn.Module, unit_types: tuple[type, ...] | None = None,
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        if unit_types is None:
            from lmlab.nn.blocks import Block

            unit_types = (Block,)
        self.module = module
        broadcast_module(module)  # every rank shards the same weights
        unit_modules = [m for m in module.modules() if isinstance(m, unit_types) and m is not module]
        owned: dict[nn.Parameter, nn.Module] = {}
        for unit_module in unit_modules:
            for p in unit_module.parameters():
                if p.requires_grad and owned.setdefault(p, unit_module) is not unit_module:
                    raise ValueError(f"a parameter is shared by two {type(unit_module).__name__} units; "
                                     "shared weights must live in one unit (or outside all of them)")
        self.units = []
        for unit_module in unit_modules:
            params = [p for p in unit_module.parameters() if p.requires_grad]
            if not params:
                continue
            unit = _Unit(params, compute_dtype)
            unit_module.register_forward_pre_hook(self._before(unit), with_kwargs=True)
            unit_module.register_forward_hook(self._after(unit))
            self.units.append(unit)
        rest = [p for p in module.parameters() if p.requires_grad and p not in owned]
        self.root = _Unit(rest, compute_dtype) if rest else None
        self.place: dict[int, tuple[_Unit, int]] = {}  # id(parameter) -> its unit and index there
        for unit in self.all_units():
            unit.shard()
            self.place.update({id(p): (unit, i) for i, p in enumerate(unit.params)})
        self.compute_dtype = compute_dtype

    def all_units(self) -> list[_Unit]:
        return [*self.units, *([self.root] if self.root else [])]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.root is not None:
            self.root.gather()
        out = self.module(*args, **kwargs)
        if self.root is not None and not torch.is_grad_enabled():  # no backward follows (evaluation)
            self.root.free()
        return out

    @staticmethod
    def _before(unit: _Unit):
        def hook(module, args, kwargs):
            unit.gather()
            if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                args = (_ReduceWhenReached.apply(unit, args[0]), *args[1:])
            return args, kwargs

        return hook

    @staticmethod
    def _after(unit: _Unit):
        def hook(module, args, output):
            unit.free()
            outputs = output if isinstance(output, tuple) else (output,)
            wants_grad = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
            if wants_grad:  # gather again before this unit's backward needs its weights
                wants_grad[0].register_hook(lambda grad: unit.gather())
            return output

        return hook

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Reduce what backward has not (the root; a unit whose input needed no gradient), in the same order
        on every rank; afterwards every parameter is its shard and its `.grad` the averaged shard gradient."""
        for unit in self.all_units():
            if unit.whole:
                unit.reduce_gradients()

    # -- whole tensors: checkpoints and the global gradient norm (collectives: every rank calls them) ------
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return clip_sharded_grad_norm_(params, max_norm)

    @torch.no_grad()
    def gather_full_params(self, of: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The state dict of `of` (default: the wrapped module; or a module inside it, for its names) with
        whole tensors, float32 where sharded, on every rank."""
        of = self.module if of is None else of
        return {name: (self._whole(t) if id(t) in self.place else t.detach())
                for name, t in of.state_dict(keep_vars=True).items()}

    def _whole(self, p: torch.Tensor) -> torch.Tensor:
        unit, i = self.place[id(p)]
        return unit.whole_of(i, unit.shards[i])

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor], of: nn.Module | None = None,
                             strict: bool = True) -> None:
        """Load whole tensors (a gathered or an unsharded state dict): each rank keeps its rows."""
        def local_part(t: torch.Tensor, whole: torch.Tensor) -> torch.Tensor | None:
            if id(t) not in self.place:
                return None
            unit, i = self.place[id(t)]
            return unit.rows_of(i, whole)

        load_whole_tensors(self.module if of is None else of, state, strict, local_part)

    @torch.no_grad()
    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict with each shard-shaped state tensor made whole: what the same optimizer
        would hold unsharded (loadable by `load_full_optimizer_state_dict` at another world size)."""
        def whole(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
            if id(p) not in self.place or value.shape != p.shape:
                return None
            unit, i = self.place[id(p)]
            return unit.whole_of(i, value)

        return map_optimizer_state(optimizer, optimizer.state_dict(), whole)

    @torch.no_grad()
    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        def rows(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
            place = self.place.get(id(p))
            if place is None or value.shape != place[0].shapes[place[1]]:
                return None
            return place[0].rows_of(place[1], value)

        optimizer.load_state_dict(map_optimizer_state(optimizer, state_dict, rows))


@torch.no_grad()
def clip_sharded_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over gradients sharded across the ranks: the global norm (a collective)."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=device)
    dist.all_reduce(square)
    norm = square.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm
