"""The flash-decoding kernel against SDPA with the mask `CacheState.allowed` builds, on CUDA:
GQA/MQA, a window, left padding (and padding queries), several new tokens (speculative
verification), split and unsplit key ranges, each dtype; it compiles and replays in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import lmlab.kernels.decode_attention_triton as dec  # noqa: E402
from lmlab.inference.cache import CacheState  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _case(batch, heads, kv_heads, new, cache_len, head_dim, first, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads, new, head_dim, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, cache_len, head_dim, device="cuda", generator=g).to(dtype) for _ in range(2))
    slots = torch.arange(first, first + new, device="cuda")
    start = torch.randint(0, first + 1, (batch,), device="cuda", generator=g)
    start[0] = first + new  # sequence 0 is all padding: its queries see only themselves
    return q, k, v, slots, start


def _reference(q, k, v, slots, start, window):
    mask = CacheState(slots=slots, start=start).allowed(torch.arange(k.shape[2], device="cuda"), window)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, heads, kv_heads, new, cache_len, head_dim, first, window", [
    (1, 16, 16, 1, 384, 64, 300, None),   # batch 1: the key range is split across programs
    (2, 8, 2, 1, 256, 128, 130, None),    # GQA
    (3, 8, 1, 5, 512, 32, 400, None),     # MQA, a 5-token verification step
    (2, 4, 4, 1, 1024, 16, 900, 100),     # a window inside a full-length cache
    (64, 4, 2, 3, 128, 64, 50, 7),        # many sequences: no split
])
def test_matches_masked_sdpa(batch, heads, kv_heads, new, cache_len, head_dim, first, window, dtype):
    q, k, v, slots, start = _case(batch, heads, kv_heads, new, cache_len, head_dim, first, dtype)
    out = dec.decode_attention(q, k, v, slots, start, window=window)
    assert out.shape == q.shape and out.dtype == dtype
    ref = _reference(q, k, v, slots, start, window)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_any_split_count_gives_the_same_result(monkeypatch, splits):
    q, k, v, slots, start = _case(2, 4, 2, 2, 512, 64, 333, torch.float32)
    monkeypatch.setattr(dec, "n_splits", lambda programs, cache_len, device: splits)
    torch.testing.assert_close(dec.decode_attention(q, k, v, slots, start), _reference(q, k, v, slots, start, None),
                               atol=1e-5, rtol=1e-5)


def test_compiles_and_replays_in_a_cuda_graph():
    q, k, v, slots, start = _case(4, 8, 2, 1, 256, 64, 100, torch.bfloat16)
    step = torch.compile(lambda q, slots: dec.decode_attention(q, k, v, slots, start), fullgraph=True)
    expected = dec.decode_attention(q, k, v, slots, start)
    torch.testing.assert_close(step(q, slots), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(q, slots)
    slots.add_(50)  # the graph reads the new slots: the key range follows them
    graph.replay()
    torch.testing.assert_close(out, dec.decode_attention(q, k, v, slots, start))


def test_unsupported_shapes_say_why():
    q = torch.zeros(1, 4, 1, 48, device="cuda")
    with pytest.raises(ValueError, match="head_dim=48"):
        dec.decode_attention(q, q, q, torch.zeros(1, dtype=torch.long, device="cuda"),
                             torch.zeros(1, dtype=torch.long, device="cuda"))
    assert "rows" in dec.unsupported(torch.zeros(1, 16, 8, 64, device="cuda"), torch.zeros(1, 1, 8, 64, device="cuda"))
