"""The multi-tensor fused Adam/AdamW update equals lmlab's reference update step for step."""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from lmlab.kernels.adam_triton import adam_update_triton  # noqa: E402
from lmlab.kernels.registry import KernelOps, install_kernels  # noqa: E402
from lmlab.optim.adam import Adam, AdamW, adam_update, adam_update_foreach  # noqa: E402
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


def test_mixed_dtypes_steps_and_layouts_in_one_group():
    """One call with tensors of two dtypes (two launches), unequal step counts, an empty tensor, and
    a non-contiguous and a CPU tensor (the reference): each equals the float32 reference update,
    rounded to its dtype (the kernel computes in float32 and rounds once)."""
    torch.manual_seed(0)
    params = [torch.randn(5000, device="cuda"), torch.randn(3, 4097, device="cuda", dtype=torch.bfloat16),
              torch.randn(0, device="cuda"), torch.randn(8, 6, device="cuda").t(), torch.randn(7)]
    grads = [torch.randn_like(p) for p in params]
    moments = [[torch.rand_like(p) for p in params] for _ in range(2)]
    steps = [1, 7, 3, 2, 5]
    lr = 0.1  # moves weights far more than a bfloat16 rounding step, so a wrong update shows
    expected = [[t.to(torch.float32, copy=True) for t in column] for column in (params, *moments)]
    adam_update_foreach(*expected[:1], [g.float() for g in grads], *expected[1:], steps, lr, (0.9, 0.99), 1e-8, 0.1,
                        True)
    adam_update_triton(params, grads, *moments, steps, lr, (0.9, 0.99), 1e-8, 0.1, True)
    for got, want in zip((params, *moments), expected):
        for a, b in zip(got, want):
            tol = dict(rtol=1e-2, atol=1e-3) if a.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(a, b.to(a.dtype), **tol)


def test_kernels_reach_the_adam_inside_a_composite_optimizer():
    a, b = torch.nn.Parameter(torch.randn(4, device="cuda")), torch.nn.Parameter(torch.randn(4, device="cuda"))
    inner = AdamW([a])
    composite = CompositeOptimizer({"adamw": inner, "adam": Adam([b])})
    install_kernels(KernelOps(adam=adam_update_triton), composite)
    assert inner.kernel is adam_update_triton and composite.parts["adam"].kernel is adam_update_triton


def test_stochastic_rounding_draws_the_references_bits():
    """bf16 tensors rounded stochastically take the reference's very bits (the same hash of position and key); a
    float32 tensor beside them is updated as without rounding keys."""
    torch.manual_seed(0)
    sizes = [5000, 2 * 4096 + 7, 33]
    params = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in sizes] + [torch.randn(777, device="cuda")]
    grads = [torch.randn_like(p) for p in params]
    moments = [[torch.rand_like(p) for p in params] for _ in range(2)]
    steps, keys = [3, 1, 10, 4], [12345, 99, 2**31 + 5, 7]
    expected = [[t.clone() for t in column] for column in (params, *moments)]
    adam_update(*expected[:1], grads, *expected[1:], steps, 0.01, (0.9, 0.95), 1e-8, 0.1, True, round_keys=keys)
    unkeyed = [[t[-1].clone()] for t in (params, *moments)]
    adam_update_triton(*unkeyed[:1], grads[-1:], *unkeyed[1:], steps[-1:], 0.01, (0.9, 0.95), 1e-8, 0.1, True)
    adam_update_triton(params, grads, *moments, steps, 0.01, (0.9, 0.95), 1e-8, 0.1, True, round_keys=keys)
    for got, want, alone in zip((params, *moments), expected, unkeyed):
        for a, b in zip(got[:-1], want[:-1]):
            # The float32 value before rounding may differ in its last bit (FMA contraction), which moves the
            # rounding only where the noise lands on that bit: a handful of elements, by one bf16 step.
            ulp = b.float().abs().clamp_min(1e-30) * 2.0**-7
            assert ((a.float() - b.float()).abs() <= ulp).all()
            assert (a != b).float().mean() < 1e-3
        assert torch.equal(got[-1], alone[0])
