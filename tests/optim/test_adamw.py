import pytest
import torch

from lmlab.optim import OPTIMIZERS, AdamW


def _copy_params(n=3):
    torch.manual_seed(0)
    base = [torch.randn(5, 4), torch.randn(4), torch.randn(3, 3)][:n]
    return [p.clone().requires_grad_() for p in base], [p.clone().requires_grad_() for p in base]


@pytest.mark.parametrize("kwargs", [{}, {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}])
def test_adamw_matches_torch_over_100_steps(kwargs):
    ours_p, ref_p = _copy_params()
    ours, ref = AdamW(ours_p, **kwargs), torch.optim.AdamW(ref_p, **kwargs)
    for step in range(100):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours_p, ref_p):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        ours.step(), ref.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_adamw_minimises_a_quadratic():
    x = torch.tensor([3.0, -2.0], requires_grad=True)
    opt = AdamW([x], lr=0.1, weight_decay=0.0)
    for _ in range(300):
        opt.zero_grad()
        (x**2).sum().backward()
        opt.step()
    assert x.abs().max() < 1e-2


@pytest.mark.parametrize("kwargs,match", [({"lr": 0.0}, "learning rate"), ({"lr": -1.0}, "learning rate"),
                                          ({"betas": (0.9, 1.0)}, "betas"), ({"betas": (-0.1, 0.9)}, "betas")])
def test_adamw_rejects_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW([torch.zeros(1, requires_grad=True)], **kwargs)


def test_registered_adamw_decays_matrices_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = OPTIMIZERS.build({"name": "adamw", "lr": 1e-3, "weight_decay": 0.2}, model)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.2 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3
