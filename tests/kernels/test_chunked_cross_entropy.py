"""chunked_cross_entropy and linear_cross_entropy against the losses of materialised logits, and their memory bound."""

from __future__ import annotations

import importlib
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lmlab.kernels import chunked_cross_entropy
from lmlab.kernels.chunked_cross_entropy import linear_cross_entropy
from lmlab.training.losses import cross_entropy

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def make(n: int, v: int, d: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, generator=gen, dtype=dtype) / d**0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, targets


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100):
    return F.cross_entropy(hidden @ weight.T, targets, ignore_index=ignore_index)


def assert_matches(hidden, weight, targets, chunk_size: int, tol: dict, ignore_index: int = -100,
                   vocab_chunk_size: int = 8192) -> None:
    loss = chunked_cross_entropy(hidden, weight, targets, ignore_index=ignore_index, chunk_size=chunk_size,
                                 vocab_chunk_size=vocab_chunk_size)
    wide = torch.promote_types(hidden.dtype, torch.float32)  # bf16 is checked against a float32 reference
    leaves = [t.detach().to(wide).requires_grad_() for t in (hidden, weight)]
    ref = reference(*leaves, targets, ignore_index)
    torch.testing.assert_close(loss.to(wide), ref, **tol)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_grads = torch.autograd.grad(ref, leaves)
    for name, g, r in zip(("hidden", "weight"), grads, ref_grads):
        assert g.dtype == hidden.dtype, name
        torch.testing.assert_close(g.to(wide), r, **tol, msg=lambda m: f"d_{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size, vocab_chunk_size", [(7, 8192), (16, 10), (64, 97), (1000, 1), (13, 32)])
def test_matches_torch(dtype: torch.dtype, chunk_size: int, vocab_chunk_size: int) -> None:
    hidden, weight, targets = make(50, 97, 24, dtype)
    assert_matches(hidden, weight, targets, chunk_size, TOL[dtype], vocab_chunk_size=vocab_chunk_size)


@pytest.mark.parametrize("label_smoothing, z_loss, multiplier, softcap", [
    (0.1, False, 1.0, None), (0.0, True, 1.0, None), (0.0, False, 0.25, None), (0.0, False, 1.0, 3.0),
    (0.2, True, 0.5, 2.0)])
def test_linear_cross_entropy_matches_the_training_loss_of_the_heads_logits(label_smoothing, z_loss, multiplier,
                                                                          softcap) -> None:
    """Against lmlab's reference loss on the model head's logits (muP multiplier, then soft-cap): both
    outputs and both gradients, with ignored rows and tiles that split rows and vocabulary unevenly."""
    hidden, weight, targets = make(40, 53, 16, torch.float32)  # the reference loss computes in float32
    targets[[3, 17, 39]] = -100
    ce, z = linear_cross_entropy(hidden, weight, targets, -100, label_smoothing, z_loss, multiplier, softcap,
                                 chunk_size=9, vocab_chunk_size=12)
    logits = (hidden @ weight.T) * multiplier
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ref_ce, ref_z = cross_entropy(logits, targets, -100, label_smoothing, z_loss)
    torch.testing.assert_close(ce, ref_ce, **TOL[torch.float32])
    total, ref_total = ce + 0.3 * z if z_loss else ce, ref_ce + 0.3 * ref_z if z_loss else ref_ce
    if z_loss:
        torch.testing.assert_close(z, ref_z, **TOL[torch.float32])
    else:
        assert z is None and ref_z is None
    for g, r in zip(torch.autograd.grad(total, (hidden, weight)), torch.autograd.grad(ref_total, (hidden, weight))):
        torch.testing.assert_close(g, r, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_ignored_rows_including_a_fully_ignored_chunk(dtype: torch.dtype, ignore_index: int) -> None:
    hidden, weight, targets = make(45, 61, 16, dtype)
    targets[10:20] = ignore_index  # with chunk_size=10: rows 10..19 are one whole chunk
    targets[[0, 33, 44]] = ignore_index
    assert_matches(hidden, weight, targets, 10, TOL[dtype], ignore_index)


def test_all_ignored_is_nan_with_zero_grads_like_torch() -> None:
    hidden, weight, targets = make(12, 20, 8, torch.float32)
    targets.fill_(-100)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=5)
    assert reference(hidden, weight, targets).isnan() and loss.isnan()
    for g in torch.autograd.grad(loss, (hidden, weight)):
        assert torch.equal(g, torch.zeros_like(g))


def test_bfloat16_against_float32_reference() -> None:
    hidden, weight, targets = make(64, 300, 32, torch.float32)
    hidden = hidden.detach().bfloat16().requires_grad_()
    weight = weight.detach().bfloat16().requires_grad_()
    targets[::5] = -100
    assert_matches(hidden, weight, targets, 24, dict(atol=2e-2, rtol=2e-2))


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements any op produced while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_logits_never_materialised_for_the_whole_batch() -> None:
    n, v, d, chunk = 2048, 8192, 16, 256
    hidden, weight, targets = make(n, v, d, torch.float32)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with LargestTensor() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk, vocab_chunk_size=v // 4)
        loss.backward()
    # Every op output (forward and backward) is at most one tile of logits or a weight-sized tensor,
    # and backward keeps only inputs and per-row statistics: nothing near N x V.
    assert mode.largest <= max(chunk * v // 4, v * d, n * d) < n * v
    assert saved and max(saved) <= max(n * d, v * d)

    # The check has teeth: the materialised version produces (and saves) N x V tensors.
    with LargestTensor() as mode:
        reference(hidden, weight, targets).backward()
    assert mode.largest >= n * v


@pytest.mark.parametrize("args, match", [
    (((4, 8), (10, 8), (5,)), "targets must be"),
    (((4, 8), (10, 6), (4,)), "share d"),
    (((4, 2, 8), (10, 8), (4,)), r"\(N, d\)"),
])
def test_shape_errors(args, match: str) -> None:
    h, w, t = args
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(torch.randn(h), torch.randn(w), torch.zeros(t, dtype=torch.long))


def test_value_errors() -> None:
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="lie in"):
        chunked_cross_entropy(hidden, weight, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="integer"):
        chunked_cross_entropy(hidden, weight, torch.zeros(4))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        chunked_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.long), vocab_chunk_size=0)
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.long), label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.long), softcap=0.0)


@pytest.mark.slow
def test_compiled_tiles_match_the_eager_ones(monkeypatch) -> None:
    """CUDA tensors take the tiles through torch.compile; here the compiled tiles run on the CPU (Inductor's C++
    backend) against the eager ones: the same lowering of every op, short of the GPU code generation."""
    module = importlib.import_module("lmlab.kernels.chunked_cross_entropy")  # the package's name is the function's

    hidden, weight, targets = make(40, 53, 16, torch.float32)
    targets[[3, 17]] = -100
    args = (hidden, weight, targets, -100, 0.1, True, 0.5, 3.0, 16, 24)
    eager = linear_cross_entropy(*args)
    eager_grads = torch.autograd.grad(eager[0] + 0.1 * eager[1], (hidden, weight))
    for name in ("_rows_forward", "_rows_backward"):
        monkeypatch.setattr(module, name, getattr(module, name).compiled)
    compiled = linear_cross_entropy(*args)
    torch.testing.assert_close(compiled, eager, **TOL[torch.float32])
    for g, e in zip(torch.autograd.grad(compiled[0] + 0.1 * compiled[1], (hidden, weight)), eager_grads):
        torch.testing.assert_close(g, e, **TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("label_smoothing, z_loss, multiplier, softcap", [(0.0, False, 1.0, None), (0.1, True, 0.5, 30.0)])
def test_cuda_bf16_autocast_matches_the_logits_loss(label_smoothing, z_loss, multiplier, softcap) -> None:
    """The compiled CUDA tiles under bf16 autocast, as training runs them, against the head's logits and lmlab's loss."""
    torch.manual_seed(0)
    hidden = torch.randn(4096, 512, device="cuda", requires_grad=True)
    weight = (torch.randn(20000, 512, device="cuda") / 512 ** 0.5).requires_grad_()
    targets = torch.randint(0, 20000, (4096,), device="cuda")
    targets[::7] = -100
    with torch.autocast("cuda", torch.bfloat16):
        ce, z = linear_cross_entropy(hidden, weight, targets, -100, label_smoothing, z_loss, multiplier, softcap)
        logits = torch.nn.functional.linear(hidden, weight) * multiplier
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        ref_ce, ref_z = cross_entropy(logits, targets, -100, label_smoothing, z_loss)
    torch.testing.assert_close(ce, ref_ce, atol=2e-3, rtol=2e-3)
    total, ref_total = (ce + 0.1 * z, ref_ce + 0.1 * ref_z) if z_loss else (ce, ref_ce)
    for g, r in zip(torch.autograd.grad(total, (hidden, weight)), torch.autograd.grad(ref_total, (hidden, weight))):
        assert ((g - r).norm() / r.norm()).item() < 2e-2
