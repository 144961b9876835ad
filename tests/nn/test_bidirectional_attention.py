"""mha with causal=false (an encoder's attention): every query sees every key, on each path."""

import pytest
import torch
from lmlab.errors import ConfigError
from lmlab.inference.cache import CacheState, mha_cache
from lmlab.nn import ATTENTION, POSITIONS

D, H, S = 16, 2, 5


def _full_attention(attn, x, position, positions, cap=None):
    """Softmax over all keys, written out from the layer's own projections."""
    q, k, v = attn.project(x, position, positions)
    scores = q @ k.transpose(-2, -1) / attn.head_dim ** 0.5
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    out = scores.softmax(-1) @ v
    return attn.o_proj(out.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_bidirectional_attention_sees_later_tokens(softcap):
    torch.manual_seed(0)
    attn = ATTENTION.build({"name": "mha", "n_heads": H, "causal": False, "softcap": softcap}, D)
    position = POSITIONS.build("rope", S, D, D // H, H)
    x, positions = torch.randn(2, S, D), torch.arange(S)
    out = attn(x, position, positions)
    torch.testing.assert_close(out, _full_attention(attn, x, position, positions, softcap))
    changed = x.clone()
    changed[:, -1] += 1.0
    assert not torch.allclose(attn(changed, position, positions)[:, 0], out[:, 0])  # the first token sees the last


def test_causal_is_still_the_default():
    torch.manual_seed(0)
    attn = ATTENTION.build({"name": "mha", "n_heads": H}, D)
    position = POSITIONS.build("nope", S, D, D // H, H)
    x, positions = torch.randn(1, S, D), torch.arange(S)
    changed = x.clone()
    changed[:, -1] += 1.0
    torch.testing.assert_close(attn(changed, position, positions)[:, :-1], attn(x, position, positions)[:, :-1])


def test_bidirectional_attention_refuses_what_only_causal_attention_has():
    with pytest.raises(ConfigError, match="window"):
        ATTENTION.build({"name": "mha", "n_heads": H, "causal": False, "window": 2}, D)
    with pytest.raises(ConfigError, match="causal=false is for mha"):
        ATTENTION.build({"name": "topk_sparse", "n_heads": H, "causal": False}, D)
    attn = ATTENTION.build({"name": "mha", "n_heads": H, "causal": False}, D)
    position = POSITIONS.build("nope", S, D, D // H, H)
    with pytest.raises(ValueError, match="packed documents"):
        attn(torch.randn(1, S, D), position, torch.arange(S)[None])
    with pytest.raises(ValueError, match="token by token"):
        mha_cache(attn, CacheState.empty(1, "cpu"), 1, S, "cpu", torch.float32)


def test_a_language_model_refuses_bidirectional_attention():
    """With causal=false every position reads its own target: a 300-step byte run reached 0.27 bits per byte."""
    from lmlab.nn import ModelConfig, Transformer

    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=16, norm="rmsnorm", ffn="swiglu", position="rope",
                      block="prenorm", attention={"name": "mha", "n_heads": 4, "causal": False})
    with pytest.raises(ConfigError, match="layer 0's attention has causal=false.*model.attention.causal=true"):
        Transformer(cfg, vocab_size=64)
