"""Variants of the layer stack: hybrid patterns of mixers, cross-layer K/V sharing (CLA) and looped depth.
Each computes what it claims (checked against the plain stack it should equal), and bad settings fail
with one clear message when the model is built."""

import copy

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from lmlab.errors import ConfigError
from lmlab.hf import to_hf_llama
from lmlab.nn import ModelConfig, Transformer
from lmlab.nn.attention import MultiHeadAttention
from lmlab.nn.linear_attention import LinearAttention
from lmlab.registry import RegistryError
from tests.conftest import next_token_losses

VOCAB = 64


def _model(**kw) -> Transformer:
    parts = dict(d_model=32, n_layers=4, max_seq_len=16, norm="rmsnorm", ffn="swiglu", position="rope",
                 attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2}, block="prenorm")
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**parts, **kw}), vocab_size=VOCAB).eval()


def _ids(batch: int = 2, seq: int = 10) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


# --- hybrid patterns -------------------------------------------------------------------------

def test_pattern_repeats_its_entries_and_uses_model_attention_for_its_own_name():
    model = _model(layer_pattern=["linear", "mha"], mixers={"linear": {"normalize": False}})
    kinds = [type(layer.self_attn) for layer in model.layers]
    assert kinds == [LinearAttention, MultiHeadAttention] * 2
    assert not model.layers[0].self_attn.normalize  # from model.mixers
    assert model.layers[1].self_attn.n_kv_heads == 2  # model.attention's own config


def test_pattern_model_trains_and_is_causal():
    model = _model(layer_pattern=["linear", "mha"]).train()
    ids = _ids()
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])
    losses = next_token_losses(model, ids, steps=8, lr=3e-3)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("kw, message", [
    (dict(layer_pattern=["mha", "mamba9"]), "mamba9"),
    (dict(layer_pattern=["linear", "mha", "mha"]), "does not divide model.n_layers=4"),
    (dict(layer_pattern=[]), "empty"),
    (dict(layer_pattern=["linear", "mha"], mixers={"mla": {}}), "does not name"),
    (dict(layer_pattern=["mla", "mha"]), "set model.mixers.mla so that they agree"),
])
def test_bad_patterns_fail_when_built(kw, message):
    with pytest.raises((ConfigError, RegistryError), match=message):
        _model(**kw)


# --- cross-layer attention -------------------------------------------------------------------

def test_cla_layers_read_their_group_leaders_keys_and_values():
    shared = _model(kv_share=2)
    plain = _model()
    consumers = [layer.self_attn for layer in shared.layers[1::2]]
    assert all(not hasattr(attn, "k_proj") and not hasattr(attn, "v_proj") for attn in consumers)
    assert all(attn.kv_source is shared.layers[2 * i].self_attn for i, attn in enumerate(consumers))
    kv_params = sum(p.numel() for attn in consumers for p in (plain.layers[1].self_attn.k_proj.weight,
                                                              plain.layers[1].self_attn.v_proj.weight))
    assert plain.num_parameters() - shared.num_parameters() == kv_params
    assert shared.kv_cache_bytes_per_token() * 2 == plain.kv_cache_bytes_per_token()
    assert not any("kv_source" in name for name in shared.state_dict())  # no parameter listed twice


def test_cla_follower_attends_over_its_leaders_keys_and_values():
    """Layer 1's queries (from its own input) attend over layer 0's keys and values, written out."""
    model = _model(n_layers=2, kv_share=2)
    ids, positions = _ids(), torch.arange(10)
    lead, follow = model.layers
    with torch.no_grad():
        x = model.position.embed(model.embed_tokens(ids), positions)
        h = lead.input_layernorm(x)
        _, k, v = lead.self_attn.project(h, model.position, positions)
        x = x + lead.self_attn(h, model.position, positions)
        x = x + lead.mlp(lead.post_attention_layernorm(x))
        h = follow.input_layernorm(x)
        q = rearrange(follow.self_attn.q_proj(h), "b s (h d) -> b h s d", h=4)
        q, _ = model.position.rotate(q, q, positions)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + follow.self_attn.o_proj(rearrange(attended, "b h s d -> b s (h d)"))
        x = x + follow.mlp(follow.post_attention_layernorm(x))
        torch.testing.assert_close(model(ids), model._head(model.norm(x)))


def test_cla_trains_both_layers_keys_through_the_leader():
    model = _model(kv_share=2).train()
    ids = _ids()
    model(ids).sum().backward()
    leader = model.layers[0].self_attn
    alone = _model(kv_share=2).train()
    alone.layers[1].self_attn.o_proj.weight.data.zero_()  # the follower adds nothing: the leader's K/V
    alone(ids).sum().backward()                            # gradient then comes from the leader alone
    assert not torch.allclose(leader.k_proj.weight.grad, alone.layers[0].self_attn.k_proj.weight.grad)


def test_cla_refuses_attention_that_cannot_share():
    with pytest.raises(ConfigError, match="cannot read another layer's keys and values"):
        _model(kv_share=2, attention={"name": "linear", "n_heads": 4})
    with pytest.raises(ConfigError, match="earlier mha layer"):
        _model(kv_share=2, layer_pattern=["linear", "mha"])
    with pytest.raises(ConfigError, match="kv_share must be >= 1"):
        _model(kv_share=0)


def test_cla_and_loops_do_not_export_to_hugging_face():
    with pytest.raises(ConfigError, match="cross-layer attention"):
        to_hf_llama(_model(kv_share=2))
    with pytest.raises(ConfigError, match="looped depth"):
        to_hf_llama(_model(loops=2))


# --- looped depth ----------------------------------------------------------------------------

def _unrolled(looped: Transformer) -> Transformer:
    """A plain model of n_layers * loops layers whose layers are the looped model's, in order."""
    plain = copy.deepcopy(looped)
    plain.layers = torch.nn.ModuleList(looped.applied_layers())
    plain.loops = 1
    return plain


def test_one_loop_is_the_plain_stack():
    torch.testing.assert_close(_model(loops=1)(_ids()), _model()(_ids()))


def test_loops_equal_the_unrolled_stack_with_shared_weights():
    looped = _model(n_layers=2, loops=3)
    with torch.no_grad():
        torch.testing.assert_close(looped(_ids()), _unrolled(looped)(_ids()))
    assert looped.effective_depth == 6
    assert looped.num_parameters() == _model(n_layers=2).num_parameters()
    assert looped.kv_cache_bytes_per_token() == 3 * _model(n_layers=2).kv_cache_bytes_per_token()


def test_loop_injection_adds_the_embeddings_before_each_later_loop():
    looped = _model(n_layers=2, loops=2, loop_inject=True)
    ids = _ids()
    with torch.no_grad():
        positions = torch.arange(ids.shape[1])
        x = looped.position.embed(looped.embed_tokens(ids), positions)
        h = x
        for loop in range(2):
            h = h + x if loop else h
            for layer in looped.layers:
                h = layer(h, looped.position, positions)
        torch.testing.assert_close(looped(ids), looped._head(looped.norm(h)))
        assert not torch.allclose(looped(ids), _model(n_layers=2, loops=2)(ids))


def test_looped_flops_count_each_pass():
    once, thrice = _model(n_layers=2), _model(n_layers=2, loops=3)
    layer_flops = once.flops_per_token(16) - 6 * once.lm_head.weight.numel()
    assert thrice.flops_per_token(16) - once.flops_per_token(16) == pytest.approx(2 * layer_flops)


def test_bad_loops_fail_when_built():
    with pytest.raises(ConfigError, match="loops must be >= 1"):
        _model(loops=0)
    with pytest.raises(ConfigError, match="auxiliary losses"):
        _model(loops=2, moe={"name": "topk", "n_experts": 4, "k": 2})
