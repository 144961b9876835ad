"""Expert parallelism in 2 and 4 gloo processes: an MoE layer whose experts are spread over the ranks gives
each rank's tokens the output of the whole layer on one process, and each expert's weights the gradient of
every rank's tokens; for a top-k router with and without a capacity, and a shared expert."""

import pytest
import torch

from lmlab.nn.moe.layer import MoELayer
from lmlab.parallel import run_processes
from lmlab.parallel.expert_parallel import shard_experts

D, TOKENS = 16, 24
ROUTERS = {"topk": {"name": "topk", "n_experts": 4, "k": 2, "d_ff": 24},
           "capacity": {"name": "topk", "n_experts": 4, "k": 2, "d_ff": 24, "capacity_factor": 1.0},
           "shared": {"name": "topk", "n_experts": 4, "k": 1, "d_ff": 24, "n_shared_experts": 1}}


def _layer(router: str) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(D, {"name": "swiglu"}, ROUTERS[router])


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank routes its own tokens
    return torch.randn(TOKENS, D, generator=g), torch.randn(TOKENS, D, generator=g)


def _rank(rank: int, world: int, router: str) -> dict:
    layer = _layer(router)
    (experts,) = shard_experts(layer)
    x, grad = _tokens(rank)
    out = layer(x)
    out.backward(grad)
    return {"out": out.detach(), "gate": layer.gate.weight.grad,
            "experts": {name: p.grad for name, p in experts.local.named_parameters(recurse=False)}}


@pytest.mark.parametrize("world, router", [(2, "topk"), (2, "capacity"), (2, "shared"), (4, "topk")])
def test_spread_experts_compute_what_the_whole_layer_computes(world, router):
    ranks = run_processes(_rank, world, args=(router,), timeout=120)
    whole = _layer(router)
    for rank, got in enumerate(ranks):
        x, grad = _tokens(rank)
        whole.zero_grad()
        out = whole(x)
        out.backward(grad)
        torch.testing.assert_close(got["out"], out.detach())
        torch.testing.assert_close(got["gate"], whole.gate.weight.grad)  # the router sees only this rank's tokens
    whole.zero_grad()
    for rank in range(world):  # an expert's gradient: every rank's tokens routed to it
        x, grad = _tokens(rank)
        whole(x).backward(grad)
    per_rank = whole.experts.n_experts // world
    for rank, got in enumerate(ranks):
        for name, value in got["experts"].items():
            want = getattr(whole.experts, name).grad[rank * per_rank:(rank + 1) * per_rank]
            torch.testing.assert_close(value, want, msg=lambda m: f"rank {rank}, {name}: {m}")
