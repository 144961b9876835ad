"""lmlab's optimizers against torch.optim: same arguments, same weights after 100 steps (float32)."""

import pytest
import torch

from lmlab.optim import SGD, Adafactor, Adam, AdamW

SHAPES = [(5, 4), (4,), (3, 3), (2, 3, 4)]  # matrices, a vector, a stack (Adafactor factors the last two dims)

CASES = [
    (AdamW, torch.optim.AdamW, {}),
    (AdamW, torch.optim.AdamW, {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}),
    (Adam, torch.optim.Adam, {}),
    (Adam, torch.optim.Adam, {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}),
    (SGD, torch.optim.SGD, {"lr": 1e-2}),
    (SGD, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}),
    (SGD, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    (Adafactor, torch.optim.Adafactor, {}),
    (Adafactor, torch.optim.Adafactor, {"lr": 5e-2, "beta2_decay": -0.5, "eps": (1e-20, 1e-2), "d": 1.5,
                                        "weight_decay": 0.1}),
]


@pytest.mark.parametrize("ours_cls,ref_cls,kwargs", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_matches_torch_over_100_steps(ours_cls, ref_cls, kwargs):
    torch.manual_seed(0)
    base = [torch.randn(shape) for shape in SHAPES]
    ours_p = [p.clone().requires_grad_() for p in base]
    ref_p = [p.clone().requires_grad_() for p in base]
    ours, ref = ours_cls(ours_p, **kwargs), ref_cls(ref_p, **kwargs)
    for step in range(100):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours_p, ref_p):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        ours.step(), ref.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_steps_a_group_whose_first_parameter_is_empty(dtype):
    """An empty tensor (first, where the update's runs of parameters begin) is stepped with the rest: bf16 weights
    go through the packed float32 update (rounded stochastically, so within a bf16 step of torch's float32 one)."""
    torch.manual_seed(0)
    base = [torch.randn(shape).to(dtype).float() for shape in [(0,), (5, 4), (3,)]]
    ours_p = [p.to(dtype, copy=True).requires_grad_() for p in base]
    ref_p = [p.clone().requires_grad_() for p in base]
    ours, ref = AdamW(ours_p, lr=0.1), torch.optim.AdamW(ref_p, lr=0.1)
    for p, q in zip(ours_p, ref_p):
        grad = torch.randn(p.shape)
        p.grad, q.grad = grad.to(dtype), grad
    ours.step(), ref.step()
    tolerance = 1e-6 if dtype == torch.float32 else 2**-6
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.float(), q, rtol=tolerance, atol=tolerance)
