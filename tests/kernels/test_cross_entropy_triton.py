"""On CUDA: the Triton cross-entropy against F.cross_entropy on float32 logits (plus z-loss), its memory use,
and its behaviour under torch.compile."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from lmlab.kernels.cross_entropy_triton import cross_entropy_triton  # noqa: E402
from tests.kernels.common import assert_compiles_like_eager  # noqa: E402


def reference(logits, targets, ignore_index=-100, label_smoothing=0.0):
    lf = logits.float()
    ce = F.cross_entropy(lf.reshape(-1, lf.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
                         label_smoothing=label_smoothing)
    z = torch.logsumexp(lf, -1)[targets != ignore_index].square().mean()
    return ce, z


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,ignore_index,label_smoothing,z_loss", [
    ((37, 1003), -100, 0.0, False),
    ((2, 19, 50304), -100, 0.1, True),
    ((3, 5, 4096), 7, 0.0, True),
    ((130, 1003), 0, 0.2, False),
])
def test_matches_reference_forward_and_backward(dtype, shape, ignore_index, label_smoothing, z_loss):
    torch.manual_seed(0)
    V = shape[-1]
    logits = (4 * torch.randn(shape, device="cuda")).to(dtype).requires_grad_()
    targets = torch.randint(0, V, shape[:-1], device="cuda")
    targets.view(-1)[::3] = ignore_index  # a third of the rows ignored
    ce, z = cross_entropy_triton(logits, targets, ignore_index, label_smoothing, z_loss)
    ce_ref, z_ref = reference(logits, targets, ignore_index, label_smoothing)
    assert ce.dtype == torch.float32
    torch.testing.assert_close(ce, ce_ref, rtol=1e-5, atol=1e-5)
    if z_loss:
        torch.testing.assert_close(z, z_ref, rtol=1e-5, atol=1e-4)
        loss, loss_ref = ce + 1e-2 * z, ce_ref + 1e-2 * z_ref
    else:
        assert z is None
        loss, loss_ref = ce, ce_ref
    (grad,) = torch.autograd.grad(loss, logits)
    (grad_ref,) = torch.autograd.grad(loss_ref, logits)
    assert grad.dtype == dtype
    ignored = targets == ignore_index
    assert torch.all(grad[ignored] == 0)
    # The reference gradient is float32 rounded once to dtype; the kernel's likewise, but from its own exp.
    scale = grad_ref.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad.float(), grad_ref.float(), rtol=tol, atol=tol * scale)


def test_only_z_loss_gets_gradient_and_all_ignored_is_nan():
    torch.manual_seed(0)
    logits = torch.randn(6, 1003, device="cuda", requires_grad=True)
    targets = torch.randint(0, 1003, (6,), device="cuda")
    _, z = cross_entropy_triton(logits, targets, z_loss=True)
    (grad,) = torch.autograd.grad(z, logits)
    (grad_ref,) = torch.autograd.grad(reference(logits, targets)[1], logits)
    torch.testing.assert_close(grad, grad_ref)

    ce, _ = cross_entropy_triton(logits, torch.full_like(targets, -100))
    assert torch.isnan(ce)
    (grad,) = torch.autograd.grad(ce, logits)
    assert torch.all(grad == 0)


def _peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_memory_stays_near_logits_plus_their_gradient():
    N, V = 8192, 50304
    logits_bytes = N * V * 2
    targets = torch.randint(0, V, (N,), device="cuda")

    def run(loss_fn):
        logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        loss_fn(logits).backward()

    fused = _peak_bytes(lambda: run(lambda lg: cross_entropy_triton(lg, targets, z_loss=True)[0]))
    eager = _peak_bytes(lambda: run(lambda lg: F.cross_entropy(lg.float(), targets)))
    assert fused < 2.3 * logits_bytes, fused / logits_bytes
    assert eager > 2.3 * logits_bytes, eager / logits_bytes


class _Head(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce, z = cross_entropy_triton(self.out(h), targets, label_smoothing=0.1, z_loss=True)
        return ce + 1e-3 * z


def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = _Head(64, 1003).cuda()
    h = torch.randn(4, 30, 64, device="cuda")
    targets = torch.randint(0, 1003, (4, 30), device="cuda")
    targets[:, -3:] = -100
    assert_compiles_like_eager(model, h, targets, grad_rtol=1e-4, grad_atol=1e-6)
