"""On CUDA: the Triton RMSNorm against lmlab's reference formula, forward and backward, eager and compiled."""

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from lmlab.kernels.rmsnorm_triton import add_rms_norm_triton, rms_norm_triton  # noqa: E402
from lmlab.nn.norms import add_rms_norm  # noqa: E402
from tests.kernels.common import assert_compiles_like_eager  # noqa: E402

# Relative to the largest reference value: low-precision outputs may land one rounding step apart,
# and the reference rounds its backward intermediates to the low precision where the kernel does not.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol,
                               atol=tol * expected.float().abs().max().item())


@pytest.mark.parametrize("x_dtype,w_dtype,shape", [
    (torch.float32, torch.float32, (4, 37, 1000)),
    (torch.bfloat16, torch.bfloat16, (300, 4096)),
    (torch.bfloat16, torch.float32, (2, 65, 1000)),
    (torch.float16, torch.float16, (129, 768)),
    (torch.bfloat16, torch.bfloat16, (7, 16384)),
    (torch.float32, torch.float32, (1000, 5)),
])
def test_matches_reference_forward_and_backward(x_dtype, w_dtype, shape):
    torch.manual_seed(0)
    x = (3 * torch.randn(shape, device="cuda")).to(x_dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(w_dtype).requires_grad_()
    y = rms_norm_triton(x, w, 1e-6)
    y_ref = reference(x, w, 1e-6)
    assert y.dtype == torch.promote_types(x_dtype, w_dtype)
    assert_close(y, y_ref, x_dtype)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    assert_close(dx, dx_ref, x_dtype)
    assert_close(dw, dw_ref, x_dtype)


def test_strided_rows_are_read_in_place():
    torch.manual_seed(0)
    base = torch.randn(64, 2, 512, device="cuda", requires_grad=True)
    x = base[:, 0]  # rows 1024 elements apart
    w = torch.randn(512, device="cuda", requires_grad=True)
    y, y_ref = rms_norm_triton(x, w, 1e-5), reference(x, w, 1e-5)
    assert_close(y, y_ref, torch.float32)
    dy = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, (base, w), dy), torch.autograd.grad(y_ref, (base, w), dy)):
        assert_close(got, want, torch.float32)


class _Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_triton(self.proj(x), self.weight, 1e-6).square().mean()


def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = _Norm(1000).cuda()
    assert_compiles_like_eager(model, torch.randn(3, 50, 1000, device="cuda"), grad_rtol=1e-4, grad_atol=1e-5)


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (4, 37, 1000)), (torch.bfloat16, (300, 4096)),
                                         (torch.float16, (129, 768))])
@pytest.mark.parametrize("used", ["both", "norm", "sum"])
def test_add_rms_norm_matches_reference(dtype, shape, used):
    """Forward (sum and norm) and the gradients of x, residual and weight, whichever outputs the loss uses."""
    torch.manual_seed(0)
    x = (3 * torch.randn(shape, device="cuda")).to(dtype).requires_grad_()
    r = torch.randn(shape, device="cuda").to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(dtype).requires_grad_()
    (s, y), (s_ref, y_ref) = add_rms_norm_triton(x, r, w, 1e-6), add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)  # the same rounded add
    assert_close(y, y_ref, dtype)
    ds, dy = torch.randn_like(s), torch.randn_like(y)

    def loss(s, y):
        return {"both": (s * ds).sum() + (y * dy).sum(), "norm": (y * dy).sum(), "sum": (s * ds).sum()}[used]

    inputs = (x, r, w) if used != "sum" else (x, r)
    for got, want in zip(torch.autograd.grad(loss(s, y), inputs), torch.autograd.grad(loss(s_ref, y_ref), inputs)):
        assert_close(got, want, dtype)


class _AddNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, y = add_rms_norm_triton(x, self.proj(x), self.weight, 1e-6)
        return s.mean() + y.square().mean()


def test_add_rms_norm_compiles_like_eager():
    torch.manual_seed(0)
    model = _AddNorm(1000).cuda()
    assert_compiles_like_eager(model, torch.randn(3, 50, 1000, device="cuda"), grad_rtol=1e-4, grad_atol=1e-5)
