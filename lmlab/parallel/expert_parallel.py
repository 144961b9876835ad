"""Expert parallelism: each rank holds 1/world_size of every MoE layer's experts, and tokens travel to the
rank of their expert and back with two all-to-alls, written to be read.

    shard_experts(model)          # every MoELayer's experts: this rank's share; the router and the rest stay whole
    out = model(x_shard)          # each rank routes its own tokens; experts see every rank's tokens for them

An MoE layer sorts its tokens by expert and hands them to its experts with a count per expert. Here that
hand-over goes through the ranks: the counts are exchanged first (an all-to-all of E numbers), so each rank
knows how many rows it will send to and receive from every other; the rows follow (an all-to-all of the
tokens, already contiguous per destination since they are sorted by expert); the receiving rank sorts what
arrived by its local expert, runs its experts, puts the outputs back in arrival order, and a second
all-to-all returns them to the ranks whose tokens they are, in the order they left. Both all-to-alls are
differentiable (backward runs them in reverse), so the expert weights' gradients come from every rank's tokens.

With data parallelism over the same ranks, the replicated parameters (attention, router, shared experts) are
averaged across ranks as usual, and each expert's gradient, already summed over every rank's tokens, is
divided by the world size instead of all-reduced: each rank's loss is the mean over its own share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lmlab.nn.moe.experts import Experts
from lmlab.nn.moe.layer import MoELayer


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


class ExpertParallelExperts(nn.Module):
    """This rank's share of an `Experts` module (experts [rank E/W, (rank + 1) E/W)), called like it."""

    def __init__(self, experts: Experts, group=None):
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if experts.n_experts % world:
            raise ValueError(f"{experts.n_experts} experts do not divide among {world} ranks")
        self.group, self.world, self.per_rank = group, world, experts.n_experts // world
        self.n_experts = experts.n_experts
        first = rank * self.per_rank
        for name, param in list(experts.named_parameters(recurse=False)):  # keep only this rank's experts
            setattr(experts, name, nn.Parameter(param.detach()[first:first + self.per_rank].clone()))
        experts.n_experts = self.per_rank
        self.local = experts

    def params_per_expert(self) -> int:
        return self.local.params_per_expert()

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
        y = self.local(arrived[order], per_source.sum(0))
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
