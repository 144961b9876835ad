"""Ring attention in 2 and 4 gloo processes equals full attention on one process, forward and backward,
causal and not, in the zigzag layout; the layout balances causal work and round-trips."""

import pytest
import torch
import torch.nn.functional as F

from lmlab.parallel import run_processes
from lmlab.parallel.ring_attention import ring_attention, zigzag_positions, zigzag_shard, zigzag_unshard

SHAPE = (2, 3, 16, 8)  # batch, heads, tokens (divisible by 2 x 4 ranks), head_dim


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=g, dtype=torch.float64) for _ in range(4)]  # q, k, v, grad of out


def _rank(rank: int, world: int, causal: bool) -> dict:
    q, k, v, grad = (zigzag_shard(t, rank, world, dim=2) for t in _inputs())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, causal=causal)
    out.backward(grad)
    return {"out": zigzag_unshard(out.detach(), world, dim=2),
            **{name: zigzag_unshard(t.grad, world, dim=2) for name, t in (("q", q), ("k", k), ("v", v))}}


def _reference(causal: bool) -> dict:
    q, k, v, grad = _inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(grad)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


@pytest.mark.parametrize("world, causal", [(2, True), (2, False), (4, True)])
def test_ring_attention_equals_full_attention_forward_and_backward(world, causal):
    want = _reference(causal)
    for rank, got in enumerate(run_processes(_rank, world, args=(causal,), timeout=120)):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"rank {rank} of {world}, {name}: {m}")


def test_zigzag_layout_covers_the_sequence_and_balances_causal_work():
    world, length = 4, 32
    positions = [zigzag_positions(length, r, world) for r in range(world)]
    assert sorted(torch.cat(positions).tolist()) == list(range(length))
    # causal (query, key) pairs per rank: the sum of (position + 1) over its queries
    work = [int((p + 1).sum()) for p in positions]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="divisible by 8"):
        zigzag_positions(30, 0, world)
