"""The fused Adam/AdamW update equals lmlab's reference update step for step."""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from lmlab.kernels.adam_triton import adam_update_triton  # noqa: E402
from lmlab.kernels.registry import KernelOps, install_kernels  # noqa: E402
from lmlab.optim.adam import Adam, AdamW  # noqa: E402
from lmlab.optim.composite import CompositeOptimizer  # noqa: E402


@pytest.mark.parametrize("cls,wd", [(AdamW, 0.1), (Adam, 0.0), (Adam, 0.01)])
def test_fused_update_matches_the_reference_over_many_steps(cls, wd):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 517), torch.nn.GELU(), torch.nn.Linear(517, 3)).cuda()
    fused_model = copy.deepcopy(model)
    reference = cls(model.parameters(), lr=3e-3, weight_decay=wd)
    fused = cls(fused_model.parameters(), lr=3e-3, weight_decay=wd)
    install_kernels(KernelOps(adam=adam_update_triton), fused)
    assert fused.kernel is adam_update_triton
    for _ in range(20):
        x = torch.randn(64, 300, device="cuda")
        for m, opt in ((model, reference), (fused_model, fused)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    # Both compute in float32 but round in different places (one fused expression against eight
    # kernels); m / sqrt(v) amplifies that where v is tiny, so a few weights differ by ~2e-6 after
    # 20 steps (measured on an H200). A wrong update rule moves weights by ~lr = 3e-3.
    for a, b in zip(model.parameters(), fused_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-5)
    for a, b in zip(reference.state.values(), fused.state.values()):
        torch.testing.assert_close(b["exp_avg"], a["exp_avg"], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(b["exp_avg_sq"], a["exp_avg_sq"], rtol=1e-4, atol=1e-9)


def test_non_contiguous_or_cpu_tensors_take_the_reference():
    p = torch.randn(8, 6).t()  # CPU and not contiguous
    g, m, v = torch.randn_like(p), torch.zeros_like(p), torch.zeros_like(p)
    expected = p - 1e-2 * g.sign()  # the first Adam step moves each weight by lr against its gradient's sign
    adam_update_triton(p, g, m, v, 1, 1e-2, (0.9, 0.999), 1e-12, 0.0, True)
    torch.testing.assert_close(p, expected)


def test_kernels_reach_the_adam_inside_a_composite_optimizer():
    a, b = torch.nn.Parameter(torch.randn(4, device="cuda")), torch.nn.Parameter(torch.randn(4, device="cuda"))
    inner = AdamW([a])
    composite = CompositeOptimizer({"adamw": inner, "adam": Adam([b])})
    install_kernels(KernelOps(adam=adam_update_triton), composite)
    assert inner.kernel is adam_update_triton and composite.parts["adam"].kernel is adam_update_triton
