"""The few-row matmul kernel against F.linear (rows padded for tl.dot, a split K whose last program sums the
partials), its gated epilogue act(gate) * up against the unfused FFN, and DecodeMatmuls' routing of F.linear.
Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                                reason="needs CUDA, or Triton's CPU interpreter (TRITON_INTERPRET=1)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def _inputs(rows: int, k: int, n: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g).to(DEVICE, dtype),
            (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype))


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("block_n, block_k, split_k", [(16, 32, 1), (16, 32, 3), (32, 64, 2)])
def test_matches_f_linear(rows, block_n, block_k, split_k):
    from lmlab.kernels.skinny_matmul_triton import Launch, launch_skinny

    x, w = _inputs(rows, 200, 70)
    y = launch_skinny(x, w, Launch(block_n, block_k, split_k))
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)
    # the split's counters were left at zero: a second call gives the same result
    torch.testing.assert_close(launch_skinny(x, w, Launch(block_n, block_k, split_k)), y, atol=0, rtol=0)


# Triton's interpreter computes in numpy, which has no bfloat16
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the interpreter has no bfloat16"))])
def test_half_precision_rounds_like_f_linear(dtype):
    from lmlab.kernels.skinny_matmul_triton import skinny_matmul

    x, w = _inputs(8, 256, 48, seed=2, dtype=dtype)
    y = skinny_matmul(x.view(2, 4, 256), w)
    assert y.shape == (2, 4, 48) and y.dtype == dtype
    torch.testing.assert_close(y.view(8, 48), F.linear(x.float(), w.float()).to(dtype), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [2, 6])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_gated_epilogue_matches_the_unfused_ffn(rows, act):
    from lmlab.kernels.skinny_matmul_triton import gated_matmul

    x, gate_up = _inputs(rows, 96, 2 * 40, seed=1)
    gate, up = gate_up.split(40)
    out = gated_matmul(x.view(rows, 1, 96), gate_up, act)
    assert out.shape == (rows, 1, 40)
    torch.testing.assert_close(out.view(rows, 40), ACTS[act](F.linear(x, gate)) * F.linear(x, up), atol=1e-5, rtol=1e-5)


def test_decode_matmuls_routes_what_it_takes():
    from lmlab.kernels import skinny_matmul_triton as skinny

    x, w = _inputs(4, 64, 24, seed=3)
    calls = []
    launch = skinny.launch_skinny
    skinny.launch_skinny = lambda *a, **k: calls.append(a[0].shape[0]) or launch(*a, **k)
    try:
        with skinny.DecodeMatmuls():
            y = F.linear(x, w)
            F.linear(x[:1], w)  # one row: Inductor's reduction, not the kernel
            F.linear(x, w, torch.zeros(24, device=DEVICE))  # a bias: cuBLAS
            F.linear(torch.zeros(65, 64, device=DEVICE), w)  # too many rows
    finally:
        skinny.launch_skinny = launch
    assert calls == [4]
    torch.testing.assert_close(y, x @ w.T, atol=1e-5, rtol=1e-5)


def test_bad_inputs_say_why():
    from lmlab.kernels.skinny_matmul_triton import decode_gated_matmul, gated_matmul, skinny_matmul

    x, w = _inputs(3, 32, 16)
    with pytest.raises(ValueError, match="activation 'relu'"):
        gated_matmul(x, w, "relu")
    with pytest.raises(ValueError, match="65 rows"):
        skinny_matmul(torch.zeros(65, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="15 rows: not gate and up"):
        gated_matmul(x, w[:15], "silu")
    assert decode_gated_matmul(torch.zeros(65, 32, device=DEVICE), w, "silu") is None
    assert decode_gated_matmul(x[:1], w, "silu") is None
