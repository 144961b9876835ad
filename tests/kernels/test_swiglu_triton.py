"""On CUDA: the Triton SwiGLU against F.silu(gate) * up, forward and backward, eager and compiled."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from lmlab.kernels.swiglu_triton import swiglu_triton  # noqa: E402
from tests.kernels.common import assert_compiles_like_eager  # noqa: E402

# The kernel computes in float32 and rounds once; the reference rounds silu(gate) before the product.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 33, 1000), (257, 2816), (3, 1)])
@pytest.mark.parametrize("chunked", [False, True])
def test_matches_reference_forward_and_backward(dtype, shape, chunked):
    torch.manual_seed(0)
    if chunked:  # the two halves of one fused projection: strided rows, no copies
        h = (2 * torch.randn(*shape[:-1], 2 * shape[-1], device="cuda")).to(dtype).requires_grad_()
        gate, up = h.chunk(2, -1)
        leaves = [h]
    else:
        gate = (2 * torch.randn(shape, device="cuda")).to(dtype).requires_grad_()
        up = (2 * torch.randn(shape, device="cuda")).to(dtype).requires_grad_()
        leaves = [gate, up]
    y = swiglu_triton(gate, up)
    y_ref = F.silu(gate) * up
    rtol, atol = TOL[dtype]
    assert y.dtype == dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    dy = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, leaves, dy)):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        swiglu_triton(torch.randn(4, 8, device="cuda"), torch.randn(4, 9, device="cuda"))


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.up(x).chunk(2, -1)
        return self.down(swiglu_triton(gate, up)).square().mean()


def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = _MLP(96, 300).cuda()
    assert_compiles_like_eager(model, torch.randn(2, 40, 96, device="cuda"), grad_rtol=1e-4, grad_atol=1e-6)
