"""Position schemes and attention options, each against a hand-written reference."""

import math

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.nn import ATTENTION, POSITIONS
from lmlab.nn.positions import alibi_slopes

D, H = 32, 4
HD = D // H


def reference_attention(q, k, v, bias):
    """softmax(q k^T / sqrt(d) + bias) v with an explicit additive bias (heads, q, k)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias
    return scores.softmax(-1) @ v


def causal(n, window=None):
    i = torch.arange(n)
    offset = i[:, None] - i[None, :]
    allowed = (offset >= 0) & (offset < (window or n + 1))
    return torch.zeros(n, n).masked_fill(~allowed, float("-inf"))


def heads(attn, x):
    split = lambda t, h: t.view(x.shape[0], x.shape[1], h, -1).transpose(1, 2)
    return split(attn.q_proj(x), attn.n_heads), split(attn.k_proj(x), attn.n_kv_heads), split(attn.v_proj(x), attn.n_kv_heads)


def merge(attn, out):
    return attn.o_proj(out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1))


def test_rope_interleaved_is_half_split_on_permuted_features():
    half = POSITIONS.build({"name": "rope", "layout": "half"}, 32, D, HD, H)
    inter = POSITIONS.build({"name": "rope", "layout": "interleaved"}, 32, D, HD, H)
    x = torch.randn(2, H, 10, HD)
    to_half = torch.cat([torch.arange(0, HD, 2), torch.arange(1, HD, 2)])  # pair (2i, 2i+1) -> (i, i + HD/2)
    rq, _ = inter.rotate(x, x, torch.arange(10))
    hq, _ = half.rotate(x[..., to_half], x[..., to_half], torch.arange(10))
    torch.testing.assert_close(rq[..., to_half], hq)
    with pytest.raises(ConfigError, match="layout='zigzag'"):
        POSITIONS.build({"name": "rope", "layout": "zigzag"}, 32, D, HD, H)


def test_rope_rejects_odd_head_dim_naming_both_fields():
    with pytest.raises(ConfigError, match="model.d_model / attention.n_heads = 7"):
        POSITIONS.build("rope", 16, 21, 7, 3)


def test_sinusoidal_table_follows_the_formula():
    pos = POSITIONS.build("sinusoidal", 50, D, HD, H)
    p, i = 17, 3
    assert pos.table[p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / D)), abs=1e-6)
    assert pos.table[p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / D)), abs=1e-6)
    x = torch.zeros(1, 5, D)
    torch.testing.assert_close(pos.embed(x, torch.arange(5))[0], pos.table[:5])


def test_nope_changes_nothing():
    pos = POSITIONS.build("nope", 16, D, HD, H)
    x = torch.randn(1, 4, D)
    assert pos.embed(x, torch.arange(4)) is x and pos.attn_bias(torch.arange(4), torch.arange(4)) is None
    assert not list(pos.parameters())


def test_alibi_slopes_and_attention():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -k for k in range(1, 9)]))
    twelve = alibi_slopes(12)  # 8 from the power of two, 4 more from every other slope of 16
    torch.testing.assert_close(twelve[8:], torch.tensor([2.0 ** -(k + 0.5) for k in range(4)]))
    alibi = POSITIONS.build("alibi", 16, D, HD, H)
    attn = ATTENTION.build({"name": "mha", "n_heads": H}, D)
    x, pos = torch.randn(2, 9, D), torch.arange(9)
    bias = -alibi.slopes[:, None, None] * (pos[:, None] - pos[None, :]).clamp_min(0) + causal(9)
    q, k, v = heads(attn, x)
    torch.testing.assert_close(attn(x, alibi, pos), merge(attn, reference_attention(q, k, v, bias)))


def test_sliding_window_matches_banded_mask_and_ignores_old_tokens():
    attn = ATTENTION.build({"name": "mha", "n_heads": H, "window": 3}, D)
    nope = POSITIONS.build("nope", 16, D, HD, H)
    x, pos = torch.randn(1, 10, D), torch.arange(10)
    q, k, v = heads(attn, x)
    torch.testing.assert_close(attn(x, nope, pos), merge(attn, reference_attention(q, k, v, causal(10, 3))))
    y = x.clone()
    y[:, 6] += 1.0  # position 9 sees 7, 8, 9 only
    torch.testing.assert_close(attn(x, nope, pos)[:, 9], attn(y, nope, pos)[:, 9])
    assert not torch.allclose(attn(x, nope, pos)[:, 8], attn(y, nope, pos)[:, 8])


def test_local_global_layer_pattern_and_window_checks():
    cfg = {"name": "mha", "n_heads": H, "window": 4, "global_every": 3}
    windows = [ATTENTION.build(cfg, D, layer_idx=i).window for i in range(6)]
    assert windows == [4, 4, None, 4, 4, None]
    with pytest.raises(ConfigError, match="attention.window=64 is larger than data.context_length=32"):
        ATTENTION.build({**cfg, "window": 64}, D).check_context(32)
    with pytest.raises(ConfigError, match="global_every needs attention.window"):
        ATTENTION.build({"name": "mha", "global_every": 2}, D)


def test_qk_norm_makes_attention_invariant_to_query_and_key_scale():
    attn = ATTENTION.build({"name": "mha", "n_heads": H, "qk_norm": True}, D)
    rope = POSITIONS.build("rope", 16, D, HD, H)
    x, pos = torch.randn(2, 6, D), torch.arange(6)
    before = attn(x, rope, pos)
    with torch.no_grad():
        attn.q_proj.weight.mul_(50.0)
        attn.k_proj.weight.mul_(5.0)
    torch.testing.assert_close(attn(x, rope, pos), before, atol=1e-4, rtol=1e-4)
    assert attn.q_norm.weight.shape == (HD,)


def test_softcap_matches_reference_and_vanishes_for_large_caps():
    plain = ATTENTION.build({"name": "mha", "n_heads": H, "n_kv_heads": 2}, D)
    capped = ATTENTION.build({"name": "mha", "n_heads": H, "n_kv_heads": 2, "softcap": 5.0}, D)
    capped.load_state_dict(plain.state_dict())
    nope = POSITIONS.build("nope", 16, D, HD, H)
    x, pos = torch.randn(2, 7, D) * 4, torch.arange(7)
    q, k, v = heads(capped, x)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(HD)
    expected = (5.0 * torch.tanh(scores / 5.0) + causal(7)).softmax(-1) @ v
    torch.testing.assert_close(capped(x, nope, pos), merge(capped, expected))
    capped.softcap = 1e6
    torch.testing.assert_close(capped(x, nope, pos), plain(x, nope, pos), atol=1e-5, rtol=1e-4)


def test_output_logit_softcap_bounds_logits():
    from lmlab.nn import ModelConfig, Transformer

    parts = dict(norm="rmsnorm", ffn="swiglu", position="rope", attention="mha", block="prenorm")
    plain = Transformer(ModelConfig(d_model=D, n_layers=1, max_seq_len=16, **parts), vocab_size=64)
    capped = Transformer(ModelConfig(d_model=D, n_layers=1, max_seq_len=16, logit_softcap=2.0, **parts), vocab_size=64)
    capped.load_state_dict(plain.state_dict())
    with torch.no_grad():
        capped.lm_head.weight.mul_(100)
        plain.lm_head.weight.mul_(100)
    ids = torch.randint(0, 64, (2, 8))
    out = capped(ids)
    assert out.abs().max() <= 2.0
    torch.testing.assert_close(out, 2.0 * torch.tanh(plain(ids) / 2.0))


def test_layer_pattern_reaches_the_model_and_postnorm_has_no_second_final_norm():
    from lmlab.nn import ModelConfig, Transformer

    parts = dict(norm="rmsnorm", ffn="swiglu", position="rope", block="prenorm")
    attention = {"name": "mha", "n_heads": H, "window": 4, "global_every": 2}
    model = Transformer(ModelConfig(d_model=D, n_layers=4, max_seq_len=16, attention=attention, **parts), 64)
    assert [layer.self_attn.window for layer in model.layers] == [4, None, 4, None]
    post = Transformer(ModelConfig(d_model=D, n_layers=2, max_seq_len=16, attention="mha",
                                   **{**parts, "block": "postnorm"}), 64)
    assert isinstance(post.norm, torch.nn.Identity)
