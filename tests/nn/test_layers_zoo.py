"""The zoo of norms, FFNs and block layouts: each builds from its default config, keeps shapes,
and computes exactly its formula; the FFN width rules keep parameter counts comparable."""

import pytest
import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError
from lmlab.nn import BLOCKS, FFNS, NORMS, ModelConfig, SiluMLP, Transformer
from lmlab.nn.ffn import glu_hidden

D = 32


def _model_cfg(**kw):
    parts = dict(norm="rmsnorm", ffn="swiglu", position="rope", attention="mha", block="prenorm")
    return ModelConfig(d_model=D, n_layers=2, max_seq_len=16, **{**parts, **kw})


def _rope():
    # Taken from a Transformer, which knows the position modules' constructor arguments.
    return Transformer(_model_cfg(), vocab_size=64).position


def _randomize_(module):
    # Default norm gains are all ones, which would hide a norm applied in the wrong place;
    # random gains make every norm slot distinguishable.
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0.0, 0.2)
    return module


# --- norms ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NORMS.names())
def test_every_norm_builds_and_keeps_shape(name):
    x = torch.randn(2, 5, D)
    assert NORMS.build(name, D)(x).shape == x.shape


def test_none_norm_is_identity_without_parameters():
    norm = NORMS.build("none", D)
    x = torch.randn(3, 4, D)
    assert torch.equal(norm(x), x)
    assert list(norm.parameters()) == []


# --- FFNs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FFNS.names())
def test_every_ffn_builds_and_keeps_shape(name):
    x = torch.randn(2, 5, D)
    assert FFNS.build(name, D)(x).shape == x.shape


def _two_matrix(act):
    return lambda f, x: (act(x @ f.up_proj.weight.T)) @ f.down_proj.weight.T


def _gated(act):
    return lambda f, x: (act(x @ f.gate_proj.weight.T) * (x @ f.up_proj.weight.T)) @ f.down_proj.weight.T


FFN_FORMULAS = {
    "relu": _two_matrix(torch.relu),
    "silu": _two_matrix(lambda h: h * torch.sigmoid(h)),
    "squared_relu": _two_matrix(lambda h: torch.relu(h) ** 2),
    "gelu": _two_matrix(lambda h: F.gelu(h, approximate="tanh")),
    "swiglu": _gated(lambda h: h * torch.sigmoid(h)),
    # tanh approximation of gelu, written out
    "geglu": _gated(lambda h: 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))),
}


@pytest.mark.parametrize("name", FFN_FORMULAS)
def test_ffn_equals_its_formula(name):
    ffn = FFNS.build(name, D)
    x = torch.randn(4, 3, D)
    torch.testing.assert_close(ffn(x), FFN_FORMULAS[name](ffn, x))


def test_geglu_exact_gelu_option():
    ffn = FFNS.build({"name": "geglu", "approximate": "none"}, D)
    x = torch.randn(4, D)
    gelu = lambda h: 0.5 * h * (1 + torch.erf(h / 2**0.5))
    torch.testing.assert_close(ffn(x), _gated(gelu)(ffn, x))


def test_bad_gelu_approximation_fails_when_building():
    for name in ("gelu", "geglu"):
        with pytest.raises(ConfigError, match="approximate"):
            FFNS.build({"name": name, "approximate": "fast"}, D)


def test_ffn_width_defaults_and_override():
    for name in ("relu", "silu", "squared_relu", "gelu"):
        assert FFNS.build(name, 96).up_proj.out_features == 384
    for name in ("swiglu", "geglu"):
        assert FFNS.build(name, 96).gate_proj.out_features == glu_hidden(96) == 256
    assert FFNS.build({"name": "squared_relu", "d_ff": 100}, 96).up_proj.out_features == 100
    assert FFNS.build({"name": "geglu", "d_ff": 100}, 96).gate_proj.out_features == 100


def test_config_instance_selects_its_own_entry():
    # Entries of one family have distinct Config classes, so a Config instance is unambiguous.
    assert type(FFNS.build(SiluMLP.Config(d_ff=64), D)) is SiluMLP


def test_ffn_parameter_counts_are_comparable():
    d = 192
    counts = {name: sum(p.numel() for p in FFNS.build(name, d).parameters()) for name in FFNS.names()}
    assert max(counts.values()) <= 1.1 * min(counts.values()), counts
    for name, n in counts.items():
        assert abs(n - 8 * d * d) <= 0.1 * 8 * d * d, (name, n)


# --- block layouts -------------------------------------------------------------------------

def prenorm(b, x, attn):
    x = x + attn(b.input_layernorm(x))
    return x + b.mlp(b.post_attention_layernorm(x))


def postnorm(b, x, attn):
    x = b.post_attention_layernorm(x + attn(x))
    return b.post_mlp_layernorm(x + b.mlp(x))


def sandwich(b, x, attn):
    x = x + b.attn_output_layernorm(attn(b.input_layernorm(x)))
    return x + b.mlp_output_layernorm(b.mlp(b.post_attention_layernorm(x)))


def parallel(b, x, attn):
    h = b.input_layernorm(x)
    return x + attn(h) + b.mlp(h)


BLOCK_FORMULAS = {f.__name__: f for f in (prenorm, postnorm, sandwich, parallel)}
NORM_NAMES = {
    "prenorm": {"input_layernorm", "post_attention_layernorm"},
    "postnorm": {"post_attention_layernorm", "post_mlp_layernorm"},
    "sandwich": {"input_layernorm", "attn_output_layernorm", "post_attention_layernorm", "mlp_output_layernorm"},
    "parallel": {"input_layernorm"},
}


def test_every_block_has_a_formula_here():
    assert set(BLOCKS.names()) == set(BLOCK_FORMULAS)


@pytest.mark.parametrize("name", BLOCKS.names())
@pytest.mark.parametrize("norm", NORMS.names())
def test_every_block_builds_keeps_shape_and_uses_every_parameter(name, norm):
    block = BLOCKS.build(name, _model_cfg(norm=norm))
    rope = _rope()
    x = torch.randn(2, 8, D)
    out = block(x, rope, torch.arange(8))
    assert out.shape == x.shape
    out.square().sum().backward()
    unused = [n for n, p in block.named_parameters() if p.grad is None or not p.grad.any()]
    assert not unused, f"{name}: parameters that get no gradient: {unused}"


@pytest.mark.parametrize("name", BLOCK_FORMULAS)
def test_block_norms_have_their_names(name):
    block = BLOCKS.build(name, _model_cfg())
    assert {n.split(".")[0] for n, _ in block.named_parameters()} == {"self_attn", "mlp"} | NORM_NAMES[name]


def test_sandwich_block_equals_its_formula():
    block = _randomize_(BLOCKS.build("sandwich", _model_cfg()))
    rope = _rope()
    x, positions = torch.randn(2, 10, D), torch.arange(10)
    attn = lambda h: block.self_attn(h, rope, positions)
    torch.testing.assert_close(block(x, rope, positions), sandwich(block, x, attn))
    # The output norms matter: without them the block is a different function.
    assert not torch.allclose(block(x, rope, positions), prenorm(block, x, attn))


@pytest.mark.parametrize("name", BLOCK_FORMULAS)
def test_transformer_with_each_block_equals_the_formula(name):
    model = _randomize_(Transformer(_model_cfg(block=name), vocab_size=100))
    ids = torch.randint(0, 100, (2, 16))
    positions = torch.arange(16)
    x = model.position.embed(model.embed_tokens(ids), positions)
    for layer in model.layers:
        x = BLOCK_FORMULAS[name](layer, x, lambda h: layer.self_attn(h, model.position, positions))
    expected = model.lm_head(model.norm(x))
    logits = model(ids)
    assert logits.shape == (2, 16, model.vocab_size)
    torch.testing.assert_close(logits, expected)


def test_new_parts_compose_from_the_command_line(make_cfg):
    cfg = make_cfg(["model/norm=none", "model/ffn=geglu", "model.ffn.approximate=none", "model/block=sandwich",
                    "model.d_model=32", "model.attention.n_heads=2"])
    model = Transformer(cfg.model, vocab_size=64)
    assert model.layers[0].mlp.approximate == "none"
    assert model(torch.randint(0, 64, (1, 8))).shape == (1, 8, 64)
