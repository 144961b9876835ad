"""Every registered optimizer minimises a convex problem and trains a tiny MLP, through the registry
and an annealing schedule, as a training run would use them."""

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lmlab.optim import OPTIMIZERS, SCHEDULERS

# Learning rates for these toy problems; weight decay off, so the optimum is the least-squares one.
SETTINGS = {
    "adamw": {"lr": 0.05, "weight_decay": 0.0},
    "adam": {"lr": 0.05},
    "sgd": {"lr": 0.05, "momentum": 0.9},
    "lion": {"lr": 0.01, "weight_decay": 0.0},
    "adafactor": {"lr": 0.1},
    "muon": {"lr": 0.05, "adamw_lr": 0.05},
}


def test_every_entry_is_covered():
    assert set(SETTINGS) == set(OPTIMIZERS.names())


def fit(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> tuple[float, float]:
    """Full-batch MSE with a linear decay to 0, so that sign-like updates (Lion, Muon) settle; (first, last) loss."""
    cfg = SETTINGS[name]
    opt = OPTIMIZERS.build({"name": name, **cfg}, model)
    lr_at = SCHEDULERS.build({"name": "linear", "warmup_steps": 0}, cfg["lr"], steps)
    sched = LambdaLR(opt, lambda step: lr_at(step) / cfg["lr"])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    with torch.no_grad():
        return losses[0], nn.functional.mse_loss(model(x), y).item()


@pytest.mark.parametrize("name", SETTINGS)
def test_minimises_least_squares(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.5
    torch.manual_seed(0)
    first, last = fit(name, nn.Linear(8, 1), x, y, steps=300)
    assert last < 1e-2 * first, (first, last)


@pytest.mark.parametrize("name", SETTINGS)
def test_trains_a_two_layer_mlp(name):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(128, 2, generator=g) * 4 - 2
    y = torch.sin(x[:, :1]) * torch.cos(x[:, 1:])
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))
    first, last = fit(name, mlp, x, y, steps=300)
    assert last < 0.1 * first, (first, last)
