"""Expert parallelism: the ranks of a group of ep hold 1/ep of every MoE layer's experts each, and tokens travel to
the rank of their expert and back with two all-to-alls; everything else is data parallel. Written to be read:

    model = ExpertParallel(model, ep=2)          # 4 ranks: {0, 1} and {2, 3} each split the experts in two
    loss = loss_fn(model(x_shard), y_shard)      # every rank trains on its own rows, a mean loss over them
    loss.backward()
    model.finish_gradient_synchronization()      # every .grad: the gradient of the whole batch's mean loss
    optimizer.step()
    whole = model.gather_full_params()           # a state dict with whole expert tensors (for a checkpoint)

Dispatch. An MoE layer sorts its tokens by expert and hands them to its experts with a count per expert. Here that
hand-over goes through the ranks: the counts are exchanged first (an all-to-all of E numbers), so each rank
knows how many rows it will send to and receive from every other; the rows follow (an all-to-all of the
tokens, already contiguous per destination since they are sorted by expert); the receiving rank sorts what
arrived by its local expert, runs its experts, puts the outputs back in arrival order, and a second
all-to-all returns them to the ranks whose tokens they are, in the order they left. Both all-to-alls are
differentiable (backward runs them in reverse), so the expert weights' gradients come from every rank's tokens.

Gradients. The world is dp groups of ep consecutive ranks (`expert group`); rank i of every group holds the same
experts (its `replica group`). Every rank trains on its own rows, so a replicated parameter (attention, router,
shared experts, embeddings) takes the mean of its gradients over all ranks, as in data parallelism. An expert's
gradient already sums the mean losses of the ep ranks whose tokens it ran on: it is divided by ep as it is
computed (so micro-batches accumulate as in one process), then averaged over its replica group.

Routers that steer by the batch's load (the aux-loss-free bias, `bias_update_rate`) count the load over all
ranks (`Router.load_group`), so every rank, and one process on the whole batch, takes the same step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmlab.nn.moe.experts import Experts
from lmlab.nn.moe.layer import MoELayer
from lmlab.nn.moe.routers import sum_router_load_over
from lmlab.parallel.comm import (average_gradients, broadcast_module, load_whole_tensors, map_optimizer_state,
                                 own_group)


def problems(model: nn.Module, ep: int) -> list[str]:
    """Why the experts of `model` (an lmlab Transformer) cannot be split over `ep` ranks; empty if they can."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        return ["the model has no MoE layers (model.moe is null): expert parallelism splits their experts; pick a "
                "router, e.g. model/moe=topk, or use parallel=ddp"]
    return sorted({f"model.moe.n_experts={m.router.n_experts} is not divisible by parallel.ep={ep}"
                   for m in layers if m.router.n_experts % ep})


class _AllToAll(torch.autograd.Function):
    """Rows of x: `send[r]` of them to rank r; returns `recv[r]` rows from each rank r. Backward: the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class ExpertParallelExperts(Experts):
    """This rank's share of an `Experts` module, experts [i E/n, (i + 1) E/n) for rank i of the n in `group`, under
    the same parameter names (state dict keys stay those of the whole module), called like the whole module."""

    def __init__(self, experts: Experts, group=None):
        nn.Module.__init__(self)  # not Experts.__init__: the stacked weights exist already, this keeps a slice
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if experts.n_experts % world:
            raise ValueError(f"{experts.n_experts} experts do not divide among {world} ranks")
        self.group, self.world, self.per_rank = group, world, experts.n_experts // world
        self.first, self.total_experts = rank * self.per_rank, experts.n_experts
        self.ffn = experts.ffn
        for name, param in experts.named_parameters(recurse=False):  # keep only this rank's experts
            self.register_parameter(name, nn.Parameter(self.rows_of(param.detach()), param.requires_grad))
        self.n_experts = self.per_rank  # the experts this module runs, as Experts counts them

    def rows_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a tensor stacked over all experts (the weights, or optimizer state)."""
        return whole[self.first:self.first + self.per_rank].clone()

    def whole_of(self, shard: torch.Tensor) -> torch.Tensor:
        """The inverse of rows_of: every rank's experts of a shard-shaped tensor, in order (a group collective)."""
        parts = [torch.empty_like(shard) for _ in range(self.world)]
        dist.all_gather(parts, shard.contiguous(), group=self.group)
        return torch.cat(parts)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x` (N, d) sorted by expert with `counts` (E,) rows each -> (N, d), every expert on its own rank."""
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)  # rank r: its counts for my experts
        per_source = received.view(self.world, self.per_rank)
        send = counts.view(self.world, self.per_rank).sum(1).tolist()
        recv = per_source.sum(1).tolist()
        arrived = _AllToAll.apply(x, send, recv, self.group)  # grouped by source rank, each sorted by expert
        local_expert = torch.arange(self.per_rank, device=x.device).repeat(self.world)
        order = torch.argsort(local_expert.repeat_interleave(per_source.flatten()), stable=True)
        y = super().forward(arrived[order], per_source.sum(0))
        y = y[torch.argsort(order)]  # back in arrival order
        return _AllToAll.apply(y, recv, send, self.group)


def shard_experts(model: nn.Module, group=None) -> list[ExpertParallelExperts]:
    """Replace every MoE layer's experts with this rank's share; returns the new modules."""
    sharded = []
    for layer in model.modules():
        if isinstance(layer, MoELayer) and not isinstance(layer.experts, ExpertParallelExperts):
            layer.experts = ExpertParallelExperts(layer.experts, group)
            sharded.append(layer.experts)
    return sharded


def _groups(world: int, ep: int, rank: int) -> tuple[Any, Any]:
    """(this rank's expert group, its replica group); every rank makes every group, in the same order."""
    return (own_group([list(range(first, first + ep)) for first in range(0, world, ep)], rank),
            own_group([list(range(i, world, ep)) for i in range(ep)], rank))


class ExpertParallel(nn.Module):
    """Wraps a module with MoE layers for expert parallelism within groups of `ep` ranks (default: all) and data
    parallelism over all ranks; call `finish_gradient_synchronization()` after backward. See the module docstring."""

    def __init__(self, module: nn.Module, ep: int | None = None):
        super().__init__()
        world, rank = dist.get_world_size(), dist.get_rank()
        ep = world if ep is None else ep
        if ep < 1 or world % ep:
            raise ValueError(f"ep={ep} ranks per expert group must divide the world size {world}")
        self.module, self.ep, self.dp = module, ep, world // ep
        self.expert_group, self.replica_group = _groups(world, ep, rank)
        broadcast_module(module)  # every rank starts from rank 0's weights, then keeps its share of the experts
        self.experts = shard_experts(module, self.expert_group)
        if not self.experts:
            raise ValueError("expert parallelism needs a model with MoE layers")
        self.owner = {id(p): e for e in self.experts for p in e.parameters()}  # an expert shard -> its module
        self.expert_params = [p for e in self.experts for p in e.parameters() if p.requires_grad]
        self.replicated = [p for p in module.parameters() if p.requires_grad and id(p) not in self.owner]
        for p in self.expert_params:
            p.register_hook(lambda grad: grad / ep)  # the sum over the ep ranks' mean losses -> their mean
        sum_router_load_over(module, dist.group.WORLD)  # every rank's tokens make the batch

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Average the replicated parameters' gradients over all ranks and each expert shard's over its replicas."""
        average_gradients(self.replicated)
        if self.dp > 1:
            average_gradients(self.expert_params, self.replica_group)

    @torch.no_grad()
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ by the norm of the whole model's gradient (a collective): the replicated
        gradients, equal on every rank, count once; the expert shards' are summed over the expert group."""
        params = [p for p in params if p.grad is not None]
        replicated = [p.grad for p in params if id(p) not in self.owner]
        shards = [p.grad for p in params if id(p) in self.owner]
        device = params[0].device if params else torch.device("cpu")
        shard_square = torch.nn.utils.get_total_norm(shards).to(device).square()
        dist.all_reduce(shard_square, group=self.expert_group)
        norm = (torch.nn.utils.get_total_norm(replicated).to(device).square() + shard_square).sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # -- whole tensors for checkpoints (collectives: every rank calls them, in the same order) ------------------
    @torch.no_grad()
    def gather_full_params(self, of: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The state dict of `of` (default: the wrapped module; or a module inside it, for its names) with whole
        expert tensors, on every rank: what the same module holds unsharded."""
        of = self.module if of is None else of
        return {name: self.owner[id(t)].whole_of(t.detach()) if id(t) in self.owner else t.detach()
                for name, t in of.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor], of: nn.Module | None = None,
                             strict: bool = True) -> None:
        """Load whole tensors (a gathered or an unsharded state dict): each rank keeps its experts."""
        load_whole_tensors(self.module if of is None else of, state, strict,
                           lambda t, whole: self.owner[id(t)].rows_of(whole) if id(t) in self.owner else None)

    @torch.no_grad()
    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict with each expert shard's state made whole: what the same optimizer holds
        unsharded (loadable by `load_full_optimizer_state_dict` under another ep, or by one process)."""
        def whole(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
            owner = self.owner.get(id(p))
            return owner.whole_of(value) if owner is not None and value.shape == p.shape else None

        return map_optimizer_state(optimizer, optimizer.state_dict(), whole)

    @torch.no_grad()
    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        def rows(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
            owner = self.owner.get(id(p))
            if owner is None or value.shape != (owner.total_experts, *p.shape[1:]):
                return None
            return owner.rows_of(value)

        optimizer.load_state_dict(map_optimizer_state(optimizer, state_dict, rows))
