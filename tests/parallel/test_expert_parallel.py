"""Expert parallelism in 2 and 4 gloo processes: an MoE layer whose experts are spread over the ranks gives
each rank's tokens the output of the whole layer on one process, and each expert's weights the gradient of
every rank's tokens; for a top-k router with and without a capacity, and a shared expert. ExpertParallel (experts
split, the rest data parallel) trains a tiny MoE Transformer to the weights of one process on the whole batches."""

import math

import pytest
import torch

from lmlab.nn.moe.layer import MoELayer
from lmlab.parallel import run_processes
from lmlab.parallel.expert_parallel import ExpertParallel, shard_experts
from tests.parallel.common import MODELS, RECIPES, assert_same_weights, batches, build, reference, shard, train

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
            "experts": {name: p.grad for name, p in experts.named_parameters(recurse=False)}}


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


def _train_rank(rank: int, world: int, ep: int) -> dict:
    model = ExpertParallel(build("moe", rank), ep)  # rank r builds from seed 100 + r: rank 0's weights win
    optimizer = RECIPES["adamw"](model.module)
    train(model, optimizer, "moe", rank, world, sync=model.finish_gradient_synchronization)
    # copies: the gathered replicated tensors are the live ones, and the norm's forward below moves the router's bias
    whole = {name: t.clone() for name, t in model.gather_full_params().items()}
    result = {"weights": whole, "state": model.full_optimizer_state_dict(optimizer),
              "local": sum(p.numel() for e in model.experts for p in e.parameters())}
    fresh = ExpertParallel(build("moe", rank), ep)  # whole tensors load back into shards
    fresh_optimizer = RECIPES["adamw"](fresh.module)
    fresh.load_full_state_dict(result["weights"])
    fresh.load_full_optimizer_state_dict(fresh_optimizer, result["state"])
    result["reloaded"] = (fresh.gather_full_params(), fresh.full_optimizer_state_dict(fresh_optimizer))
    x, y = batches("moe")[0]  # one more backward: the norm of the whole model's gradient
    model.module.zero_grad(set_to_none=True)
    MODELS["moe"][2](model(shard(x, rank, world)), shard(y, rank, world)).backward()
    model.finish_gradient_synchronization()
    params = list(model.parameters())
    result["norm"] = float(model.clip_grad_norm_(params, math.inf))
    model.clip_grad_norm_(params, result["norm"] / 2)  # every rank's gradients scaled by the same factor
    result["clipped"] = float(model.clip_grad_norm_(params, math.inf))
    return result


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2)])  # (4, 2): two expert groups, each expert shard on 2 ranks
def test_expert_parallel_training_matches_one_process(world, ep):
    ranks = run_processes(_train_rank, world, args=(ep,), timeout=180)
    want, reference_optimizer = reference("moe", "adamw")
    assert want["layers.0.mlp.router.expert_bias"].abs().sum() > 0  # the balancing bias moved: its load counts
    whole = build("moe")
    experts = sum(p.numel() for n, p in whole.named_parameters() if ".experts." in n)
    whole.load_state_dict(want)
    x, y = batches("moe")[0]
    MODELS["moe"][2](whole(x), y).backward()
    want_norm = float(torch.nn.utils.get_total_norm([p.grad for p in whole.parameters() if p.grad is not None]))
    for rank, got in enumerate(ranks):
        assert_same_weights(got["weights"], want, f"rank {rank} of {world}, ep={ep}")
        assert got["local"] == experts // ep
        torch.testing.assert_close(got["state"]["state"], reference_optimizer.state_dict()["state"])
        assert got["state"]["param_groups"] == reference_optimizer.state_dict()["param_groups"]
        reloaded_weights, reloaded_state = got["reloaded"]
        assert_same_weights(reloaded_weights, got["weights"], "reloaded")
        torch.testing.assert_close(reloaded_state["state"], got["state"]["state"], rtol=0, atol=0)
        assert got["norm"] == pytest.approx(want_norm, rel=1e-4)
        assert got["clipped"] == pytest.approx(want_norm / 2, rel=1e-4)
