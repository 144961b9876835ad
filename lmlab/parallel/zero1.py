"""ZeRO stage 1 (Rajbhandari et al. 2020): optimizer state sharded across data-parallel ranks.

    model = NaiveDDP(model)                      # or BucketedDDP: gradients must be averaged first
    optimizer = ZeRO1(model.parameters(), AdamW, lr=3e-3, weight_decay=0.1)
    ...
    loss.backward(); model.finish_gradient_synchronization(); optimizer.step()

In plain data parallelism every rank keeps the whole optimizer state (AdamW: two moments, twice
the model) and takes the same step. Here each parameter has one owner rank: only the owner keeps
its state and steps it, then broadcasts the new values to the other ranks. Each rank's optimizer
state is about 1/world_size of the whole, for one broadcast of the weights per step.

Ownership is by whole parameter, balanced by element count (largest first, each to the least
loaded rank). So optimizers that need a whole tensor work unchanged: Muon orthogonalises each
matrix on its owner, Adafactor factors each one's second moment there.

ZeRO1 wraps any optimizer: `optimizer_cls(params, **optimizer_kwargs)` is built over all the
parameters and then cut down to the owned ones. ZeRO1's own `param_groups` keep every parameter
and the settings, so an LR scheduler, gradient clipping and `zero_grad` work on it as on the
unsharded optimizer; settings are copied into the local optimizer before each step.
`ZeRO1.from_registry(cfg, model)` shards an entry of lmlab's `optim` registry, including a
CompositeOptimizer (Muon + AdamW): its parts share the group dicts that ZeRO1 cuts down.

Checkpoints use the unsharded optimizer's `state_dict` format (parameter indices over all
groups). `state_dict()` holds this rank's shard of the state; after `consolidate_state_dict()`
(a collective) it holds every rank's on the target rank, which Lightning's strategies call
before saving from rank 0. `load_state_dict()` takes either (consolidated: at any world size)
and keeps the state of the parameters this rank owns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmlab.optim import OPTIMIZERS
from lmlab.optim.base import evaluate_closure


def assign_owners(sizes: Sequence[int], world_size: int) -> list[int]:
    """Owner rank of each item of `sizes`: largest first, each to the rank with the fewest elements
    so far (ties: lowest rank). Deterministic, so every rank computes the same assignment."""
    loads = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: equal sizes keep their order
        rank = min(range(world_size), key=loads.__getitem__)
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of an optimizer's state held by this rank (ZeRO1: its shard; FSDP: the local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    return sum((v.to_local() if isinstance(v, DTensor) else v).numel()
               for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


class ZeRO1(torch.optim.Optimizer):
    """Any optimizer with its state sharded by parameter across the ranks; steps, then broadcasts."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict] | nn.Module,
                 optimizer_cls: Callable[..., torch.optim.Optimizer], **optimizer_kwargs: Any):
        """`optimizer_cls(params, **optimizer_kwargs)` must build an optimizer over all parameters
        (an optimizer class, or any builder: `from_registry` passes a model and a registry builder)."""
        optimizer = optimizer_cls(params, **optimizer_kwargs)
        # Copies of the groups with every parameter: what schedulers, clipping and zero_grad see.
        super().__init__([dict(group) for group in optimizer.param_groups], dict(optimizer.defaults))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._params = [p for group in self.param_groups for p in group["params"]]
        self.owner = dict(zip(self._params, assign_owners([p.numel() for p in self._params], self.world_size)))
        for group in optimizer.param_groups:  # group i stays group i, so settings copy across by index
            group["params"] = [p for p in group["params"] if self.owner[p] == self.rank]
        for p in [p for p in optimizer.state if self.owner[p] != self.rank]:  # from constructors that fill state
            del optimizer.state[p]
        self.optimizer = optimizer
        self.state = optimizer.state  # one dict: `state` shows, and state_dict saves, the local shard
        self._consolidated: dict[int, Any] | None = None

    @classmethod
    def from_registry(cls, cfg: Any, model: nn.Module) -> ZeRO1:
        """Shard the optimizer that `OPTIMIZERS.build(cfg, model)` builds (an `optim` config or entry name).

        Pass the model itself, not a NaiveDDP/BucketedDDP wrapper: the registry reads its parameter
        names and muP learning-rate multipliers."""
        return cls(model, lambda m: OPTIMIZERS.build(cfg, m))

    def _copy_settings(self) -> None:
        # An LR scheduler changes our groups' lr; the local optimizer steps with its own groups.
        for mine, local in zip(self.param_groups, self.optimizer.param_groups):
            local.update({k: v for k, v in mine.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = evaluate_closure(closure)
        self._copy_settings()
        self.optimizer.step()
        self._consolidated = None  # stale now
        # All broadcasts are in flight at once; every rank issues them in the same order.
        works = [dist.broadcast(p.detach(), src=self.owner[p], async_op=True) for p in self._params]
        for work in works:
            work.wait()
        return loss

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the state on rank `to` (on CPU), where the next `state_dict()`
        returns all of it until the next step. A collective: every rank must call it."""
        shard = {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
                 for i, state in super().state_dict()["state"].items()}
        shards: list[dict[int, Any]] | None = [{} for _ in range(self.world_size)] if self.rank == to else None
        dist.gather_object(shard, shards, dst=to)
        self._consolidated = {i: s for part in shards for i, s in part.items()} if shards is not None else None

    def state_dict(self) -> dict[str, Any]:
        """The unsharded optimizer's format; its state is this rank's shard, or all shards after
        `consolidate_state_dict()` on the target rank."""
        state_dict = super().state_dict()
        if self._consolidated is not None:
            state_dict["state"] = self._consolidated
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state dict (saved at any world size) or this rank's own shard."""
        owned = {i: s for i, s in state_dict["state"].items() if self.owner[self._params[i]] == self.rank}
        super().load_state_dict({**state_dict, "state": owned})
        # In place: a CompositeOptimizer's parts share the local optimizer's state dict.
        self.optimizer.state.clear()
        self.optimizer.state.update(self.state)
        self.state = self.optimizer.state
        self._copy_settings()
        self._consolidated = None
