"""The few-row matmul kernel against F.linear: one row (a product and a row sum), several rows (tl.dot), a split K
whose last program sums the partials, and the gated prologue act(gate) * up of each supported activation.
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


def _inputs(rows: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g).to(DEVICE), torch.randn(rows, k, generator=g).to(DEVICE),
            torch.randn(n, k, generator=g).to(DEVICE) / k ** 0.5)


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("block_n, block_k, split_k", [(16, 32, 1), (16, 32, 3), (32, 64, 2)])
def test_matches_f_linear(rows, block_n, block_k, split_k):
    from lmlab.kernels.skinny_matmul_triton import Launch, launch_skinny

    x, _, w = _inputs(rows, 200, 70)
    y = launch_skinny(x, w, Launch(block_n, block_k, split_k))
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)
    # the split's counters were left at zero: a second call gives the same result
    torch.testing.assert_close(launch_skinny(x, w, Launch(block_n, block_k, split_k)), y, atol=0, rtol=0)


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_gated_prologue_matches_the_unfused_ffn(rows, act):
    from lmlab.kernels.skinny_matmul_triton import gated_matmul

    gate, up, w = _inputs(rows, 300, 40, seed=1)
    fused = torch.randn(2, 1, 600).to(DEVICE)  # gate and up as views of one (batch, 1, 2K) buffer, as an engine's
    gate, up = fused.split(300, dim=-1)
    out = gated_matmul(gate, up, w, act)
    assert out.shape == (2, 1, 40)
    torch.testing.assert_close(out, F.linear(ACTS[act](gate) * up, w), atol=1e-5, rtol=1e-5)


def test_bad_inputs_say_why():
    from lmlab.kernels.skinny_matmul_triton import decode_gated_matmul, gated_matmul, skinny_matmul

    gate, up, w = _inputs(3, 32, 16)
    with pytest.raises(ValueError, match="activation 'relu'"):
        gated_matmul(gate, up, w, "relu")
    with pytest.raises(ValueError, match="65 rows"):
        skinny_matmul(torch.zeros(65, 32, device=DEVICE), w)
    assert decode_gated_matmul(torch.zeros(65, 32, device=DEVICE), torch.zeros(65, 32, device=DEVICE), w, "silu") is None
