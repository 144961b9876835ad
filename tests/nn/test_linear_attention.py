"""Linear attention: shapes in a model, causality, parallel == recurrent == a slow reference loop."""

import pytest
import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError
from lmlab.nn import ATTENTION, POSITIONS, ModelConfig, Transformer

D, H, S = 32, 4, 12
HD = D // H


def build(**fields):
    return ATTENTION.build({"name": "linear", "n_heads": H, **fields}, D)


def position(name):
    return POSITIONS.build(name, 64, D, HD, H)


def run_recurrent(attn, pos, x):
    state = attn.init_state(x.shape[0], x.device, x.dtype)
    ys = []
    for t in range(x.shape[1]):
        y, state = attn.step(x[:, t : t + 1], pos, torch.tensor([t]), state)
        ys.append(y)
    return torch.cat(ys, dim=1)


@pytest.mark.parametrize("pos_name", ["rope", "nope"])
def test_default_config_keeps_shape_in_a_transformer(pos_name):
    cfg = ModelConfig(d_model=64, n_layers=2, max_seq_len=32, norm="rmsnorm", ffn="swiglu", position=pos_name,
                      attention={"name": "linear", "n_heads": 4}, block="prenorm")
    model = Transformer(cfg, vocab_size=100)
    assert type(model.layers[0].self_attn).__name__ == "LinearAttention"
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= {n for n, _ in model.layers[0].self_attn.named_children()}
    logits = model(torch.randint(0, 100, (2, 20)))
    assert logits.shape == (2, 20, model.vocab_size) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert model.kv_cache_bytes_per_token() == 0
    assert model.layers[0].self_attn.state_elements() == 4 * (16 * 16 + 16)
    assert model.flops_per_token(32) > 0


@pytest.mark.parametrize("pos_name", ["rope", "nope"])
def test_causal_future_tokens_do_not_change_the_past(pos_name):
    attn, pos = build(), position(pos_name)
    x = torch.randn(2, S, D)
    x2 = x.clone()
    x2[:, 7:] = torch.randn(2, S - 7, D)
    positions = torch.arange(S)
    torch.testing.assert_close(attn(x, pos, positions)[:, :7], attn(x2, pos, positions)[:, :7])


@pytest.mark.parametrize("fields", [{}, {"normalize": False}, {"feature_map": "relu"}])
@pytest.mark.parametrize("pos_name", ["nope", "rope"])
def test_parallel_equals_recurrent(pos_name, fields):
    torch.manual_seed(0)
    attn, pos = build(**fields), position(pos_name)
    x = torch.randn(3, S, D)
    with torch.no_grad():
        parallel = attn(x, pos, torch.arange(S))
        recurrent = run_recurrent(attn, pos, x)
    torch.testing.assert_close(recurrent, parallel, atol=1e-5, rtol=1e-5)


def test_parallel_equals_slow_reference_loop():
    """y_i = sum_{j<=i} phi(q_i).phi(k_j) v_j / (sum_{j<=i} phi(q_i).phi(k_j) + eps), one scalar at a time."""
    torch.manual_seed(1)
    attn, pos = build(), position("rope")
    x = torch.randn(2, S, D)
    with torch.no_grad():
        got = attn(x, pos, torch.arange(S))
        split = lambda t: t.view(2, S, H, HD).transpose(1, 2)  # noqa: E731
        q, k = pos.rotate(split(attn.q_proj(x)), split(attn.k_proj(x)), torch.arange(S))
        q, k, v = F.elu(q) + 1, F.elu(k) + 1, split(attn.v_proj(x))
        y = torch.zeros(2, H, S, HD)
        for b in range(2):
            for h in range(H):
                for i in range(S):
                    num, den = torch.zeros(HD), 0.0
                    for j in range(i + 1):
                        w = float((q[b, h, i] * k[b, h, j]).sum())
                        num += w * v[b, h, j]
                        den += w
                    y[b, h, i] = num / (den + 1e-6)
        want = attn.o_proj(y.transpose(1, 2).reshape(2, S, D))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_alibi_is_refused_with_a_clear_error():
    attn, pos = build(), position("alibi")
    with pytest.raises(ConfigError, match="model/position=alibi.*model/attention=linear"):
        attn(torch.randn(1, 4, D), pos, torch.arange(4))
    with pytest.raises(ConfigError, match="model/position=alibi"):
        attn.step(torch.randn(1, 1, D), pos, torch.tensor([0]), attn.init_state(1, "cpu", torch.float32))


def test_bad_fields_name_the_field():
    with pytest.raises(ConfigError, match="attention.n_heads=5"):
        build(n_heads=5)
    with pytest.raises(ConfigError, match="attention.feature_map='softmax'"):
        build(feature_map="softmax")


def test_alibi_is_refused_when_the_model_is_built():
    cfg = ModelConfig(d_model=64, n_layers=1, max_seq_len=32, norm="rmsnorm", ffn="swiglu", position="alibi",
                      attention={"name": "linear"}, block="prenorm")
    with pytest.raises(ConfigError, match="model/position=alibi"):
        Transformer(cfg, 64)
    with torch.device("meta"), pytest.raises(ConfigError, match="model/position=alibi"):
        Transformer(cfg, 64)  # as lmlab-train's start-up check builds it
