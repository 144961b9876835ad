"""FlashAttentionReference against torch's scaled_dot_product_attention, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.kernels import FlashAttentionReference, flash_attention_reference
from tests.kernels.common import TinyAttention, assert_compiles_like_eager

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-5)}


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The oracle: K/V repeated per query head (only here), 3-D inputs as a single head."""
    if q.dim() == 3:
        return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=causal)[:, 0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def inputs(shape_q: tuple[int, ...], shape_kv: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype, requires_grad=True) for s in (shape_q, shape_kv, shape_kv)]


CASES = [  # (q shape, k/v shape): MHA, GQA 8:2, MQA, 3-D single head
    ((2, 4, 37, 16), (2, 4, 37, 16)),
    ((1, 8, 45, 8), (1, 2, 45, 8)),
    ((2, 4, 33, 8), (2, 1, 33, 8)),
    ((3, 29, 16), (3, 29, 16)),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape_q, shape_kv", CASES)
def test_forward_and_backward_match_sdpa(shape_q, shape_kv, causal: bool, dtype: torch.dtype) -> None:
    q, k, v = inputs(shape_q, shape_kv, dtype)
    out = FlashAttentionReference.apply(q, k, v, causal, 16, 16)
    ref = sdpa(q, k, v, causal)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), d_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape and g.dtype == dtype, name
        torch.testing.assert_close(g, r, **TOL[dtype], msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("seq", [1, 17, 100])
@pytest.mark.parametrize("block_q, block_k", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_not_multiple_of_block(seq: int, block_q: int, block_k: int, causal: bool) -> None:
    q, k, v = inputs((2, 4, seq, 8), (2, 2, seq, 8), torch.float64, seed=seq)
    out = FlashAttentionReference.apply(q, k, v, causal, block_q, block_k)
    ref = sdpa(q, k, v, causal)
    torch.testing.assert_close(out, ref, **TOL[torch.float64])
    d_out = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(ref, (q, k, v), d_out)):
        torch.testing.assert_close(g, r, **TOL[torch.float64])


def test_non_causal_with_different_key_length() -> None:
    q, _, _ = inputs((2, 4, 19, 8), (2, 2, 19, 8), torch.float64)
    _, k, v = inputs((2, 4, 19, 8), (2, 2, 50, 8), torch.float64, seed=1)
    out = FlashAttentionReference.apply(q, k, v, False, 16, 16)
    ref = sdpa(q, k, v, False)
    torch.testing.assert_close(out, ref, **TOL[torch.float64])
    d_out = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(ref, (q, k, v), d_out)):
        torch.testing.assert_close(g, r, **TOL[torch.float64])


@pytest.mark.parametrize("causal", [False, True])
def test_lse_is_logsumexp_of_scaled_masked_scores(causal: bool) -> None:
    q, k, v = inputs((2, 6, 41, 8), (2, 3, 41, 8), torch.float32)
    _, lse = flash_attention_reference(q.detach(), k.detach(), v.detach(), causal, 16, 16)
    scores = q.detach() @ k.detach().repeat_interleave(2, dim=1).transpose(-2, -1) / math.sqrt(8)
    if causal:
        scores = scores.masked_fill(torch.ones(41, 41, dtype=torch.bool).triu(1), -math.inf)
    assert lse.shape == (2, 6, 41) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_shape, kv_shape", [((1, 4, 96, 8), (1, 2, 96, 8)), ((2, 96, 8), (2, 96, 8))])
def test_saves_no_seq_by_seq_tensor_and_keeps_the_inputs_shapes(q_shape, kv_shape) -> None:
    q, k, v = inputs(q_shape, kv_shape, torch.float32)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        FlashAttentionReference.apply(q, k, v, True, 32, 32)
    assert sorted(saved) == sorted([q.shape, k.shape, v.shape, q.shape, q.shape[:-1]])


def test_bfloat16_runs_and_returns_input_dtype() -> None:
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in inputs((1, 4, 40, 16), (1, 2, 40, 16), torch.float32))
    out = FlashAttentionReference.apply(q, k, v, True, 16, 16)
    ref = sdpa(q.float(), k.float(), v.float(), True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert all(g.dtype == torch.bfloat16 for g in torch.autograd.grad(out.sum(), (q, k, v)))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal: bool) -> None:
    q, k, v = inputs((1, 4, 7, 3), (1, 2, 7, 3), torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: FlashAttentionReference.apply(q, k, v, causal, 4, 2), (q, k, v))


def test_torch_compile_matches_eager() -> None:
    torch.manual_seed(0)
    model = TinyAttention(32, n_heads=4, n_kv_heads=2,
                          attend=lambda q, k, v: FlashAttentionReference.apply(q, k, v, True, 16, 16))
    assert_compiles_like_eager(model, torch.randn(2, 40, 32), backend="aot_eager")


@pytest.mark.parametrize("shapes, causal, match", [
    (((2, 4, 8, 8), (2, 4, 8, 8), (2, 4, 9, 8)), False, "same shape"),
    (((2, 4, 8, 8), (3, 4, 8, 8), (3, 4, 8, 8)), False, "batch"),
    (((2, 4, 8, 8), (2, 4, 8, 4), (2, 4, 8, 4)), False, "head_dim"),
    (((2, 6, 8, 8), (2, 4, 8, 8), (2, 4, 8, 8)), False, "not divisible"),
    (((2, 4, 8, 8), (2, 8, 8), (2, 8, 8)), False, "all be 3-D or all be 4-D"),
    (((2, 8, 8), (2, 4, 8, 8), (2, 4, 8, 8)), False, "all be 3-D or all be 4-D"),
    (((8, 8), (8, 8), (8, 8)), False, "got shape"),
    (((2, 4, 8, 8), (2, 4, 9, 8), (2, 4, 9, 8)), True, "q_len == k_len"),
])
def test_errors(shapes, causal: bool, match: str) -> None:
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        FlashAttentionReference.apply(q, k, v, causal)


def test_dtype_mismatch_is_an_error() -> None:
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).double(), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="one dtype"):
        flash_attention_reference(q, k, v, False)
