"""The fused final norm + output head (`normed_head`) against `model._head(model.norm(x)).float()`, and the engine's
use of it. Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.nn.transformer import OutputHead
from tests.inference.test_cache_parity import VOCAB
from tests.inference.test_cache_parity import _model as tiny_model

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                                  reason="needs CUDA, or Triton's CPU interpreter (TRITON_INTERPRET=1)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x, gain, eps, head: OutputHead) -> torch.Tensor:
    from lmlab.nn.norms import rms_norm

    logits = rms_norm(x, gain, eps) @ head.weight.T
    return (logits * head.multiplier if head.multiplier != 1.0 else logits).float()


@needs_triton
# bf16: the products are summed in another order than the reference matmul's, so a logit may round to a neighbour
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 1.6e-2)])
@pytest.mark.parametrize("rows, d_model, vocab, multiplier", [(1, 96, 301, 1.0), (1, 128, 64, 0.5),
                                                              (1, 300, 1000, 1.0)])
def test_equals_the_reference(rows, d_model, vocab, multiplier, dtype, atol, rtol):
    """Widths that are not powers of two and a vocabulary that does not fill the last program's rows."""
    from lmlab.kernels.normed_head_triton import normed_head

    g = torch.Generator().manual_seed(d_model)
    x = (3 * torch.randn(rows, d_model, generator=g)).to(DEVICE, dtype)
    gain = (1 + 0.1 * torch.randn(d_model, generator=g)).to(DEVICE, dtype)
    head = OutputHead((torch.randn(vocab, d_model, generator=g) / d_model ** 0.5).to(DEVICE, dtype), multiplier, None)
    got = normed_head(x, gain, 1e-5, head)
    assert got.dtype == torch.float32 and got.shape == (rows, vocab)
    torch.testing.assert_close(got, _reference(x, gain, 1e-5, head), atol=atol, rtol=rtol)


@needs_triton
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 1.6e-2)])
@pytest.mark.parametrize("multiplier", [1.0, 0.5])
def test_int8_head_equals_its_int8_linear(dtype, atol, rtol, multiplier):
    """An int8 head (codes and row scales, lmlab.inference.quant's Int8Linear) gives that module's logits."""
    from lmlab.inference.quant.linear import Int8Linear
    from lmlab.kernels.normed_head_triton import normed_head
    from lmlab.nn.norms import rms_norm

    g = torch.Generator().manual_seed(0)
    d_model, vocab = 200, 333
    x = (3 * torch.randn(1, d_model, generator=g)).to(DEVICE, dtype)
    gain = (1 + 0.1 * torch.randn(d_model, generator=g)).to(DEVICE, dtype)
    codes = torch.randint(-127, 128, (vocab, d_model), generator=g, dtype=torch.int8).to(DEVICE)
    scales = (torch.rand(vocab, generator=g) / (127 * d_model ** 0.5)).to(DEVICE, dtype)
    linear = Int8Linear(codes, scales, None, "dequant")
    reference = linear(rms_norm(x, gain, 1e-5))
    reference = (reference * multiplier if multiplier != 1.0 else reference).float()
    got = normed_head(x, gain, 1e-5, OutputHead(codes, multiplier, None), scales)
    torch.testing.assert_close(got, reference, atol=atol, rtol=rtol)


@needs_triton
def test_refuses_what_it_cannot_take():
    from lmlab.kernels.normed_head_triton import MAX_ROWS, normed_head

    head = OutputHead(torch.randn(10, 8, device=DEVICE), 1.0, None)
    with pytest.raises(ValueError, match="rows"):
        normed_head(torch.randn(MAX_ROWS + 1, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-5, head)
    with pytest.raises(ValueError, match="soft-capped"):
        normed_head(torch.randn(1, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-5,
                    OutputHead(head.weight, 1.0, 30.0))
    with pytest.raises(ValueError, match="int8 with scales"):  # codes without their scales
        normed_head(torch.randn(1, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-5,
                    OutputHead(head.weight.to(torch.int8), 1.0, None))


@needs_triton
@pytest.mark.parametrize("int8", [False, True])
def test_engine_decodes_the_same_logits_with_it(int8):
    """At batch 1 the prompt's last token and each decode step take the kernel; an int8-quantized head too."""
    from lmlab.inference.quant import quantize

    model = tiny_model().to(DEVICE)
    if int8:
        quantize(model, "int8")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    logits = []
    for head_kernel in (False, True):
        engine = Engine(model, head_kernel=head_kernel)
        assert (engine.head_kernel is not None) == head_kernel
        engine.begin(1, 8)
        steps = [engine.extend(prompt)] + [engine.decode(torch.tensor([t])).clone() for t in range(2)]
        logits.append(torch.stack(steps, 1))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_asking_for_it_where_the_model_has_no_rmsnorm_head_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    with pytest.raises(ConfigError, match="head_kernel=True, but the final norm is LayerNorm"):
        Engine(tiny_model(norm="layernorm"), head_kernel=True)
