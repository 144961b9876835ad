"""FlashAttentionTriton against the plain-PyTorch reference (and float64 SDPA), forward and backward.

The parity tests need CUDA; the input checks fire before any launch, so their tests run on CPU.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from lmlab.kernels.flash_reference import FlashAttentionReference, flash_attention_reference  # noqa: E402
from tests.kernels.common import TinyAttention, assert_compiles_like_eager  # noqa: E402
from lmlab.kernels.flash_triton import (  # noqa: E402
    FlashAttentionTriton,
    flash_attention_triton,
    flash_attention_triton_forward,
)


def gpu(test):
    """Marks a test as needing CUDA (applied per test so the CPU-only input-check tests still run)."""
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test)
    return pytest.mark.gpu(test)


# Max error relative to the reference's max magnitude; float32 runs exact IEEE dots.
REL_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def assert_near(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert x.shape == ref.shape, what
    err = (x.double() - ref.double()).abs().max().item()
    bound = REL_TOL[dtype] * max(ref.abs().max().item(), 1.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def inputs(shape_q: tuple[int, ...], shape_kv: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, generator=gen, device="cuda", dtype=dtype).requires_grad_()
            for s in (shape_q, shape_kv, shape_kv)]


def check_against_reference(q, k, v, causal: bool, d_out: torch.Tensor | None = None) -> None:
    """Output, LSE and gradients of the Triton kernels vs FlashAttentionReference in float32 on the same inputs."""
    dtype = q.dtype
    out = FlashAttentionTriton.apply(q, k, v, causal)
    assert out.shape == q.shape and out.dtype == dtype
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = FlashAttentionReference.apply(*ref_inputs, causal)
    assert_near(out, ref, dtype, "out")

    _, lse = flash_attention_triton_forward(q.detach(), k.detach(), v.detach(), causal)
    _, ref_lse = flash_attention_reference(*(t.detach() for t in ref_inputs), causal)
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-4)

    d_out = torch.randn_like(out) if d_out is None else d_out
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    ref_grads = torch.autograd.grad(ref, ref_inputs, d_out.float())
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype, name
        assert_near(g, r, dtype, f"d{name}")


# Each (dtype, head_dim, causal) combination compiles and autotunes every kernel afresh, so the
# cases share a few combinations: bfloat16 at head dims 64 and 128, float32 at 64 (and 128 causal),
# float16 at 16 and 32.
CASES = [  # (q shape, k/v shape): MHA, GQA 8:2 with a ragged length, MQA ragged, 3-D single head
    ((2, 4, 128, 64), (2, 4, 128, 64)),
    ((1, 8, 257, 128), (1, 2, 257, 128)),
    ((2, 4, 100, 64), (2, 1, 100, 64)),
    ((2, 200, 64), (2, 200, 64)),
]


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape_q, shape_kv", CASES)
def test_bfloat16_matches_reference(shape_q, shape_kv, causal: bool) -> None:
    check_against_reference(*inputs(shape_q, shape_kv, torch.bfloat16), causal)


@gpu
@pytest.mark.parametrize("shape_q, shape_kv, causal", [
    ((2, 4, 128, 64), (2, 4, 128, 64), False),
    ((1, 8, 257, 128), (1, 2, 257, 128), True),
    ((2, 4, 100, 64), (2, 1, 100, 64), True),
    ((2, 200, 64), (2, 200, 64), False),
])
def test_float32_matches_reference(shape_q, shape_kv, causal: bool) -> None:
    check_against_reference(*inputs(shape_q, shape_kv, torch.float32), causal)


@gpu
@pytest.mark.parametrize("head_dim", [16, 32])
def test_float16_small_head_dims(head_dim: int) -> None:
    check_against_reference(*inputs((1, 4, 150, head_dim), (1, 2, 150, head_dim), torch.float16), True)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_causal_with_different_key_length(dtype: torch.dtype) -> None:
    q, _, _ = inputs((2, 4, 100, 64), (2, 2, 100, 64), dtype)
    _, k, v = inputs((2, 4, 100, 64), (2, 2, 300, 64), dtype, seed=1)
    check_against_reference(q, k, v, False)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_strided_views_and_grad(causal: bool) -> None:
    """q, k, v as the model makes them (b s (h d) -> b h s d views of one projection) and a strided dO."""
    b, s, h, d = 2, 130, 4, 64
    x = torch.randn(b, s, 3 * h * d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2).requires_grad_() for t in x.split(h * d, dim=-1))
    assert not q.is_contiguous() and q.stride(-1) == 1
    d_out = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    check_against_reference(q, k, v, causal, d_out)


@gpu
def test_expanded_grad_from_sum() -> None:
    q, k, v = inputs((1, 4, 90, 64), (1, 2, 90, 64), torch.float32)
    grads = torch.autograd.grad(flash_attention_triton(q, k, v, causal=True).sum(), (q, k, v))
    ref_grads = torch.autograd.grad(FlashAttentionReference.apply(q, k, v, True).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert_near(g, r, torch.float32, "grad")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_custom_scale_matches_float64_sdpa(causal: bool, dtype: torch.dtype) -> None:
    q, k, v = inputs((2, 8, 120, 64), (2, 2, 120, 64), dtype)
    out = FlashAttentionTriton.apply(q, k, v, causal, 0.3)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64.repeat_interleave(4, dim=1), v64.repeat_interleave(4, dim=1),
                                         is_causal=causal, scale=0.3)
    assert_near(out, ref, dtype, "out")
    _, lse = flash_attention_triton_forward(q.detach(), k.detach(), v.detach(), causal, scale=0.3)
    scores = (q64 @ k64.repeat_interleave(4, dim=1).transpose(-2, -1)).detach() * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(120, 120, dtype=torch.bool, device="cuda").triu(1), -math.inf)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, dim=-1), atol=1e-4 if dtype == torch.float32
                               else 3e-2, rtol=1e-4)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_out.double())
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_near(g, r, dtype, f"d{name}")


@gpu
@pytest.mark.parametrize("q_shape, kv_shape", [((1, 4, 96, 64), (1, 2, 96, 64)), ((2, 96, 64), (2, 96, 64))])
def test_saves_no_seq_by_seq_tensor_and_keeps_the_inputs_shapes(q_shape, kv_shape) -> None:
    """The saved tensors are q, k, v, the output and the LSE in the inputs' own shapes, as the reference saves
    them: for 3-D q, (batch, seq, head_dim) and a (batch, seq) LSE."""
    q, k, v = inputs(q_shape, kv_shape, torch.bfloat16)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        FlashAttentionTriton.apply(q, k, v, True)
    assert sorted(saved) == sorted([q.shape, k.shape, v.shape, q.shape, q.shape[:-1]])


@gpu
def test_torch_compile_matches_eager() -> None:
    torch.manual_seed(0)
    model = TinyAttention(256, n_heads=4, n_kv_heads=2,
                          attend=lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True)).cuda()
    assert_compiles_like_eager(model, torch.randn(2, 70, 256, device="cuda"), rtol=1e-5, atol=1e-5,
                               grad_rtol=1e-4, grad_atol=1e-4)


# The input checks run before any launch, so these need neither CUDA nor the interpreter.
cpu_checks = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="the interpreter accepts CPU tensors")


@cpu_checks
@pytest.mark.parametrize("shapes, dtype, causal, match", [
    (((1, 2, 8, 96), (1, 2, 8, 96)), torch.float16, False, "supported head dims: 16, 32, 64, 128"),
    (((1, 2, 8, 64), (1, 2, 8, 64)), torch.float64, False, "supported dtypes: float16, bfloat16, float32"),
    (((1, 2, 8, 64), (1, 2, 8, 64)), torch.float16, False, "CUDA"),
    (((1, 6, 8, 64), (1, 4, 8, 64)), torch.float16, False, "not divisible"),
    (((1, 2, 8, 64), (1, 2, 9, 64)), torch.float16, True, "q_len == k_len"),
])
def test_input_errors(shapes, dtype: torch.dtype, causal: bool, match: str) -> None:
    q, k = (torch.zeros(s, dtype=dtype) for s in shapes)
    with pytest.raises(ValueError, match=match):
        FlashAttentionTriton.apply(q, k, k.clone(), causal)


@cpu_checks
def test_dtype_mismatch_is_an_error() -> None:
    q, k = torch.zeros(1, 2, 8, 64, dtype=torch.float16), torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        flash_attention_triton(q, k, k)
