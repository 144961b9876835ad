"""Top-k sparse attention: dense when k covers the sequence, each query over exactly its indexer's top-k keys
(recomputed here from the weights), causal, the indexer trained by its KL loss only, and a tiny model trains."""

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError
from lmlab.nn import ATTENTION, POSITIONS, ModelConfig, Transformer

D, H, S = 32, 4, 10
HD = D // H
MAIN = ("q_proj", "k_proj", "v_proj", "o_proj")
INDEXER = ("index_q_proj", "index_k_proj", "index_weights")


def build(**fields):
    torch.manual_seed(0)
    return ATTENTION.build({"name": "topk_sparse", "n_heads": H, **fields}, D)


def position(name):
    return POSITIONS.build(name, 64, D, HD, H)


def rope(t, pos, theta=10000.0):
    """Half-split RoPE on t (..., s, [heads,] d) at positions pos (s,), written out for the reference."""
    d = t.shape[-1]
    angles = pos[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)
    cos, sin = angles.cos().float(), angles.sin().float()
    if t.dim() == 4:  # (b, s, heads, d)
        cos, sin = cos[:, None], sin[:, None]
    a, b = t.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_index_scores(attn, x):
    """I[b, t, s] = sum_j w[t, j] relu(qI[t, j] . kI[s]), qI and kI rotated by their positions."""
    pos = torch.arange(x.shape[1])
    q = rope(attn.index_q_proj(x).unflatten(-1, (-1, attn.index_dim)), pos)
    k = rope(attn.index_k_proj(x), pos)
    w = attn.index_weights(x)
    return sum(w[:, :, j, None] * F.relu(q[:, :, j] @ k.transpose(1, 2)) for j in range(q.shape[2]))


@pytest.mark.parametrize("pos_name", ["rope", "alibi"])
@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_top_k_covering_the_sequence_is_dense_causal_attention(pos_name, n_kv_heads):
    sparse = build(top_k=S, n_kv_heads=n_kv_heads)
    dense = ATTENTION.build({"name": "mha", "n_heads": H, "n_kv_heads": n_kv_heads}, D)
    assert not dense.load_state_dict(sparse.state_dict(), strict=False).missing_keys  # the same q, k, v, o
    pos, positions = position(pos_name), torch.arange(S)
    x = torch.randn(2, S, D, requires_grad=True)
    outs, grads = [], []
    for attn in (sparse, dense):
        out = attn(x, pos, positions)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        outs.append(out)
        grads.append([x.grad.clone(), *(getattr(attn, n).weight.grad for n in MAIN)])
        x.grad = None
    torch.testing.assert_close(outs[0], outs[1])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("top_k", [1, 3])
def test_each_query_attends_over_exactly_its_top_k_keys(top_k):
    attn, pos = build(top_k=top_k, n_kv_heads=2), position("rope")
    x, positions = torch.randn(2, S, D), torch.arange(S)
    with torch.no_grad():
        got = attn(x, pos, positions)
        q, k, v = attn.project(x, pos, positions)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = reference_index_scores(attn, x)
        for b in range(2):
            for t in range(S):
                keys = scores[b, t, :t + 1].argsort(descending=True)[:top_k]
                weights = (q[b, :, t, None] @ k[b, :, keys].transpose(-2, -1) / math.sqrt(HD)).softmax(-1)
                want = attn.o_proj((weights @ v[b, :, keys]).flatten())
                torch.testing.assert_close(got[b, t], want, rtol=1e-5, atol=1e-6)


def test_no_query_sees_the_future():
    attn, pos, positions = build(top_k=3), position("rope"), torch.arange(S)
    x = torch.randn(1, S, D, requires_grad=True)
    out = attn(x, pos, positions)
    for t in range(S):  # no gradient from a future key's value or key
        (grad,) = torch.autograd.grad(out[0, t].sum(), x, retain_graph=True)
        assert grad[0, t + 1:].abs().sum() == 0 and grad[0, t].abs().sum() > 0
    changed = x.detach().clone()
    changed[:, 6:] = torch.randn(1, S - 6, D)  # nor from its index score, which could take a top-k place
    torch.testing.assert_close(attn(changed, pos, positions)[:, :6], out[:, :6])


@pytest.mark.parametrize("fields, field", [({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"),
                                           ({"index_heads": 0}, "index_heads"), ({"index_dim": 7}, "index_dim"),
                                           ({"indexer_loss_weight": -1.0}, "indexer_loss_weight")])
def test_bad_sizes_are_refused_when_built(fields, field):
    with pytest.raises(ConfigError, match=f"attention.{field}"):
        build(**fields)


def test_indexer_learns_from_its_kl_loss_only():
    attn, pos = build(top_k=3), position("rope")
    x = torch.randn(2, S, D)
    out = attn(x, pos, torch.arange(S))
    kl = attn.losses["indexer_kl_loss"]
    assert torch.isfinite(kl) and kl >= 0 and attn.loss_weights == {"indexer_kl_loss": 1.0}
    out.sum().backward(retain_graph=True)  # the top-k selection passes no gradient to the indexer
    assert all(getattr(attn, n).weight.grad is None for n in INDEXER)
    main_grad = attn.q_proj.weight.grad.clone()
    assert main_grad.abs().sum() > 0
    kl.backward()  # and the KL loss trains the indexer, not the attention it imitates (its target is detached)
    assert all(getattr(attn, n).weight.grad.abs().sum() > 0 for n in INDEXER)
    torch.testing.assert_close(attn.q_proj.weight.grad, main_grad, rtol=0, atol=0)


def test_kl_loss_trains_the_indexer_toward_the_attention_distribution():
    attn, pos = build(top_k=S), position("rope")
    with torch.no_grad():  # peaked attention, far from the indexer's near-uniform start
        attn.q_proj.weight.mul_(10)
        attn.k_proj.weight.mul_(10)
    x = torch.randn(2, S, D)
    optimizer = torch.optim.Adam([getattr(attn, n).weight for n in INDEXER], lr=1e-2)
    kls = []
    for _ in range(20):
        attn(x, pos, torch.arange(S))
        kl = attn.losses["indexer_kl_loss"]
        optimizer.zero_grad()
        kl.backward()
        optimizer.step()
        kls.append(kl.item())
    assert kls[-1] < 0.5 * kls[0]


def test_kl_loss_is_zero_where_the_indexer_matches_attention():
    """With one key per query (top_k=1) both distributions are a point mass."""
    attn = build(top_k=1)
    attn(torch.randn(2, S, D), position("rope"), torch.arange(S))
    assert attn.losses["indexer_kl_loss"].abs() < 1e-6


def test_cost_counts_k_keys_and_the_indexer_over_all():
    attn = build(top_k=4, n_kv_heads=2, index_heads=2, index_dim=16)
    assert attn.kv_cache_elements_per_token() == 2 * 2 * HD + 16
    indexer = 6 * 2 * 16
    assert attn.score_flops_per_token(100) == 12 * D * 4 + indexer * 100
    assert attn.score_flops_per_token(2) == 12 * D * 2 + indexer * 2


def test_tiny_transformer_trains():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=D, n_layers=2, max_seq_len=32, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "topk_sparse", "n_heads": H, "top_k": 4}, block="prenorm")
    model = Transformer(cfg, vocab_size=64)
    ids = torch.randint(0, 64, (4, 24))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    indexer_before = model.layers[0].self_attn.index_q_proj.weight.clone()
    losses = []
    for _ in range(25):
        output = model.forward_train(ids[:, :-1])
        lm = F.cross_entropy(output.logits.flatten(0, 1), ids[:, 1:].flatten())
        weight, kl = output.aux_losses["indexer_kl_loss"]  # the layers' KL losses, averaged
        optimizer.zero_grad()
        (lm + weight * kl).backward()
        optimizer.step()
        losses.append(lm.item())
    assert losses[-1] < 0.5 * losses[0]
    assert not torch.equal(model.layers[0].self_attn.index_q_proj.weight, indexer_before)
