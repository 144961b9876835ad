"""The paged flash-decoding kernel against float32 attention over keys gathered through the block
table, on CUDA: MHA/GQA/MQA, shuffled block tables, context lengths of 1 and off block boundaries, a
window, split and unsplit key ranges, each dtype; table entries it must not read hold addresses far
outside the pool; it compiles and replays in a CUDA graph."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import lmlab.kernels.paged_decode_attention_triton as paged  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
FAR = 2**31 - 1  # a block id far past the pool: reading it would fault or give garbage


def _case(batch, heads, kv_heads, head_dim, block_size, lens, dtype, window=None, seed=0):
    """Pools of shuffled blocks and each sequence's table; `lens` lists context lengths, or is the
    longest of random ones (sequence 0 then gets 1). Entries a sequence does not see are FAR."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if isinstance(lens, int):
        lens = torch.randint(1, lens + 1, (batch,), device="cuda", generator=g)
        lens[0] = 1
    lens = torch.as_tensor(lens, dtype=torch.int32, device="cuda")
    max_blocks = math.ceil(int(lens.max()) / block_size) + 2  # spare entries past every sequence's last block
    num_blocks = batch * max_blocks + 3
    q = torch.randn(batch, heads, head_dim, device="cuda", generator=g).to(dtype)
    k_pool, v_pool = (torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
                      for _ in range(2))
    order = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * max_blocks]
    tables = order.view(batch, max_blocks).to(torch.int32)
    index = torch.arange(max_blocks, device="cuda")
    first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0) // block_size
    unseen = (index >= (lens[:, None] + block_size - 1) // block_size) | (index < first[:, None])
    return q, k_pool, v_pool, tables.masked_fill(unseen, FAR), lens


def _reference(q, k_pool, v_pool, tables, lens, window=None, scale=None):
    """float32 softmax attention over the keys gathered through the table (FAR entries are masked)."""
    block_size = k_pool.shape[1]
    pos = torch.arange(tables.shape[1] * block_size, device=q.device)
    blocks = tables.long().clamp(max=k_pool.shape[0] - 1)[:, pos // block_size]  # (batch, keys)
    k, v = (pool[blocks, pos % block_size].float().transpose(1, 2) for pool in (k_pool, v_pool))
    seen = pos < lens[:, None]
    if window is not None:
        seen &= (lens[:, None] - 1 - pos) < window
    out = F.scaled_dot_product_attention(q.float()[:, :, None], k, v, attn_mask=seen[:, None, None, :],
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, block_size, lens, window", [
    (1, 16, 16, 64, 16, [300], None),                      # batch 1: the key range is split across programs
    (32, 8, 2, 128, 16, [1, 15, 16, 17, 33, 250] * 5 + [64, 3], None),  # GQA, lengths on and off block edges
    (128, 8, 1, 32, 16, 200, None),                        # MQA
    (128, 4, 4, 64, 16, 100, None),                        # enough programs without a split
    (4, 4, 2, 64, 16, [1, 19, 20, 999], 100),              # a window (blocks before it are never read)
    (6, 4, 4, 16, 32, [1, 2, 31, 32, 33, 500], 7),         # larger blocks, a window smaller than a block
    (3, 32, 2, 64, 128, [5, 129, 700], None),              # blocks longer than a loop step; 16 heads per kv head
])
def test_matches_gathered_reference(batch, heads, kv_heads, head_dim, block_size, lens, window, dtype):
    q, k_pool, v_pool, tables, lens = _case(batch, heads, kv_heads, head_dim, block_size, lens, dtype, window)
    out = paged.paged_decode_attention(q, k_pool, v_pool, tables, lens, window=window)
    assert out.shape == q.shape and out.dtype == dtype
    ref = _reference(q, k_pool, v_pool, tables, lens, window)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("window", [None, 50])
def test_any_split_count_gives_the_same_result(monkeypatch, splits, window):
    q, k_pool, v_pool, tables, lens = _case(3, 4, 2, 64, 16, [1, 90, 333], torch.float32, window)
    monkeypatch.setattr(paged, "n_splits", lambda programs, capacity, device: splits)
    out = paged.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale=0.3, window=window)
    torch.testing.assert_close(out, _reference(q, k_pool, v_pool, tables, lens, window, scale=0.3),
                               atol=1e-5, rtol=1e-5)


def test_compiles_and_replays_in_a_cuda_graph():
    q, k_pool, v_pool, tables, lens = _case(4, 8, 2, 64, 16, [1, 40, 100, 17], torch.bfloat16)
    tables = tables.masked_fill(tables == FAR, 0)  # the lengths grow into these blocks below
    step = torch.compile(lambda q, tables, lens: paged.paged_decode_attention(q, k_pool, v_pool, tables, lens),
                         fullgraph=True)
    expected = paged.paged_decode_attention(q, k_pool, v_pool, tables, lens)
    torch.testing.assert_close(step(q, tables, lens), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(q, tables, lens)
    lens.add_(13)  # the graph reads the new lengths and table: the key range follows them
    tables.copy_(tables.roll(1, dims=0))
    graph.replay()
    torch.testing.assert_close(out, paged.paged_decode_attention(q, k_pool, v_pool, tables, lens))
    torch.testing.assert_close(out.float(), _reference(q, k_pool, v_pool, tables, lens), atol=2e-2, rtol=2e-2)


def test_unsupported_shapes_say_why():
    q, pool = torch.zeros(1, 4, 64, device="cuda"), torch.zeros(4, 16, 2, 64, device="cuda")
    tables, lens = torch.zeros(1, 2, dtype=torch.int32, device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="head_dim=48"):
        q48 = torch.zeros(1, 4, 48, device="cuda")
        paged.paged_decode_attention(q48, q48[:, :, None], q48[:, :, None], tables, lens)
    with pytest.raises(ValueError, match="int32"):
        paged.paged_decode_attention(q, pool, pool, tables.float(), lens)
    with pytest.raises(ValueError, match="window=0"):
        paged.paged_decode_attention(q, pool, pool, tables, lens, window=0)
    assert "power of two" in paged.unsupported(q, torch.zeros(4, 24, 2, 64, device="cuda"))
    assert "kv head" in paged.unsupported(torch.zeros(1, 130, 64, device="cuda"), pool[:, :, :1])
    assert "dtype" in paged.unsupported(q, pool.half())
    assert paged.unsupported(q, pool) is None
