"""The decode kernel given this step's own keys and values (`new_keys`, `new_values`, `rotary`): it rotates q and
the keys as RoPE does, attends them, and stores them in the caches, which equals rotating and storing first and
then attending over the caches. Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1); the
engine's cached decoding with it is checked in tests/inference/test_engine_kernels.py."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from lmlab.nn.positions import RoPE

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                                reason="needs CUDA, or Triton's CPU interpreter (TRITON_INTERPRET=1)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rope(head_dim: int, layout: str) -> RoPE:
    return RoPE(64, head_dim * 4, head_dim, 4, RoPE.Config(layout=layout)).to(DEVICE)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layout", ["half", "interleaved", None])
@pytest.mark.parametrize("batch, heads, kv_heads, new, head_dim, first, window", [
    (2, 4, 2, 1, 32, 20, None),  # GQA, one new token
    (1, 2, 1, 3, 16, 9, 5),      # MQA, a 3-token verification step, a window
])
def test_equals_rotating_and_storing_first(monkeypatch, batch, heads, kv_heads, new, head_dim, first, window, layout,
                                           splits):
    import lmlab.kernels.decode_attention_triton as dec

    monkeypatch.setattr(dec, "n_splits", lambda programs, cache_len, device: splits)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, new, head_dim, generator=g).to(DEVICE)
    k_new, v_new = (torch.randn(batch, kv_heads, new, head_dim, generator=g).to(DEVICE) for _ in range(2))
    cache = [torch.randn(batch, kv_heads, 32, head_dim, generator=g).to(DEVICE) for _ in range(2)]
    slots = torch.arange(first, first + new, device=DEVICE)
    start = torch.tensor([0, 3][:batch], device=DEVICE)
    rope = _rope(head_dim, layout or "half")
    rotary = (rope.cos, rope.sin, layout == "interleaved") if layout else None
    expected_k, expected_v = (t.clone() for t in cache)
    q_ref, k_ref = q, k_new
    if layout:
        q_ref, k_ref = rope.rotate(q, k_new, (slots[None] - start[:, None]).clamp_min(0))
    expected_k[:, :, first:first + new], expected_v[:, :, first:first + new] = k_ref, v_new
    expected = dec.decode_attention(q_ref, expected_k, expected_v, slots, start, window=window)

    out = dec.decode_attention(q, *cache, slots, start, window=window, new_keys=k_new, new_values=v_new, rotary=rotary)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache[0], expected_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache[1], expected_v, atol=0, rtol=0)


def test_bad_new_keys_say_why():
    import lmlab.kernels.decode_attention_triton as dec

    q = torch.zeros(1, 4, 1, 16, device=DEVICE)
    cache = torch.zeros(1, 2, 8, 16, device=DEVICE)
    slots, start = torch.zeros(1, dtype=torch.long, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="new_keys and new_values must both be"):
        dec.decode_attention(q, cache, cache, slots, start, new_keys=torch.zeros(1, 2, 1, 16, device=DEVICE))
    with pytest.raises(ValueError, match="without new keys"):
        dec.decode_attention(q, cache, cache, slots, start, rotary=(cache, cache, False))
