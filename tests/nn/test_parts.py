"""Each registered model part builds from its default config, has the right shapes, and
matches its reference where one exists."""

import pytest
import torch
from torch import nn

from lmlab.nn import ATTENTION, FFNS, NORMS, POSITIONS, ModelConfig, Transformer
from lmlab.nn.ffn import glu_hidden

D = 32


@pytest.mark.parametrize("name", NORMS.names())
def test_norms_build_and_keep_shape(name):
    x = torch.randn(2, 5, D)
    assert NORMS.build(name, D)(x).shape == x.shape


def test_rmsnorm_matches_torch_forward_and_backward():
    ours, ref = NORMS.build("rmsnorm", D), nn.RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        w = torch.randn(D)
        ours.weight.copy_(w), ref.weight.copy_(w)
    x1 = torch.randn(3, 7, D, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    torch.testing.assert_close(ours(x1), ref(x2))
    ours(x1).square().sum().backward(), ref(x2).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)


def test_layernorm_matches_torch_and_bias_is_optional():
    ours, ref = NORMS.build("layernorm", D), nn.LayerNorm(D)
    x = torch.randn(4, D)
    torch.testing.assert_close(ours(x), ref(x))
    assert NORMS.build({"name": "layernorm", "bias": False}, D).bias is None


@pytest.mark.parametrize("name", FFNS.names())
def test_ffns_build_and_keep_shape(name):
    x = torch.randn(2, 5, D)
    assert FFNS.build(name, D)(x).shape == x.shape


def test_ffn_width_rules():
    assert FFNS.build("gelu", 96).up_proj.out_features == 384
    assert FFNS.build("swiglu", 96).gate_proj.out_features == glu_hidden(96) == 256
    assert FFNS.build({"name": "swiglu", "d_ff": 100}, 96).up_proj.out_features == 100


def test_swiglu_is_silu_gate_times_up():
    ffn = FFNS.build("swiglu", D)
    x = torch.randn(3, D)
    expected = ffn.down_proj(nn.functional.silu(ffn.gate_proj(x)) * ffn.up_proj(x))
    torch.testing.assert_close(ffn(x), expected)


def test_rope_scores_depend_only_on_relative_position():
    rope = POSITIONS.build("rope", 64, D, 16, 2)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        qi, _ = rope.rotate(q, q, torch.tensor([i]))
        _, kj = rope.rotate(k, k, torch.tensor([j]))
        return (qi * kj).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10))
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_rope_preserves_norm_and_identity_at_zero():
    rope = POSITIONS.build("rope", 64, D, 16, 2)
    q = torch.randn(2, 3, 10, 16)
    rq, _ = rope.rotate(q, q, torch.arange(10))
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(rq[:, :, 0], q[:, :, 0])


def test_learned_positions_add_to_embeddings():
    pos = POSITIONS.build("learned", 16, D, 8, 4)
    x = torch.zeros(2, 4, D)
    torch.testing.assert_close(pos.embed(x, torch.arange(4)), pos.embed_positions.weight[:4].expand(2, 4, D))


def test_attention_is_causal():
    attn = ATTENTION.build("mha", D)
    rope = POSITIONS.build("rope", 16, D, attn.head_dim, attn.n_heads)
    x = torch.randn(1, 8, D)
    y = x.clone()
    y[:, 5:] = torch.randn(1, 3, D)  # change only the future of position 4
    positions = torch.arange(8)
    torch.testing.assert_close(attn(x, rope, positions)[:, :5], attn(y, rope, positions)[:, :5])


def test_gqa_equals_mha_with_shared_kv_heads():
    gqa = ATTENTION.build({"name": "mha", "n_heads": 4, "n_kv_heads": 2}, D)
    mha = ATTENTION.build({"name": "mha", "n_heads": 4}, D)
    hd = gqa.head_dim
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        # Each kv head serves n_heads / n_kv_heads = 2 consecutive query heads.
        for proj in ("k_proj", "v_proj"):
            w = getattr(gqa, proj).weight.view(2, hd, D)
            getattr(mha, proj).weight.copy_(w.repeat_interleave(2, dim=0).reshape(4 * hd, D))
    rope = POSITIONS.build("rope", 16, D, hd, 4)
    x, positions = torch.randn(2, 6, D), torch.arange(6)
    torch.testing.assert_close(gqa(x, rope, positions), mha(x, rope, positions))
    assert gqa.k_proj.weight.shape[0] == 2 * hd


def test_attention_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="divisible"):
        ATTENTION.build({"name": "mha", "n_heads": 5}, D)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ATTENTION.build({"name": "mha", "n_heads": 4, "n_kv_heads": 3}, D)


def _model_cfg(**kw):
    parts = dict(norm="rmsnorm", ffn="swiglu", position="rope", attention="mha", block="prenorm")
    return ModelConfig(d_model=D, n_layers=2, max_seq_len=16, **{**parts, **kw})


@pytest.mark.parametrize("position", POSITIONS.names())
def test_transformer_logits_shape_and_llama_names(position):
    model = Transformer(_model_cfg(position=position), vocab_size=257)
    assert model.vocab_size == 320  # padded to a multiple of 64
    assert model(torch.randint(0, 257, (2, 16))).shape == (2, 16, 320)
    names = set(dict(model.named_parameters()))
    for expected in ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight",
                     "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
                     "norm.weight", "lm_head.weight"):
        assert expected in names


def test_weight_tying_shares_the_matrix():
    model = Transformer(_model_cfg(tie_embeddings=True), vocab_size=256)
    assert model.lm_head.weight is model.embed_tokens.weight
    untied = Transformer(_model_cfg(), vocab_size=256)
    assert model.num_parameters() == untied.num_parameters() - 256 * D


def test_transformer_rejects_too_long_input():
    model = Transformer(_model_cfg(), vocab_size=256)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_flops_per_token_counts_matmul_weights_and_attention():
    model = Transformer(_model_cfg(), vocab_size=256)
    gains = sum(p.numel() for n, p in model.named_parameters() if n.endswith("norm.weight"))
    assert model.flops_per_token(16) == 6 * (model.num_parameters(exclude_embeddings=True) - gains) + 12 * 2 * D * 16
    tied = Transformer(_model_cfg(tie_embeddings=True), vocab_size=256)
    assert tied.flops_per_token(16) == 6 * (tied.num_parameters() - gains) + 12 * 2 * D * 16
    windowed = Transformer(_model_cfg(attention={"name": "mha", "window": 4}), vocab_size=256)
    assert windowed.flops_per_token(16) == model.flops_per_token(16) - 12 * 2 * D * (16 - 4)


def test_kv_cache_bytes_follow_kv_heads():
    mha = Transformer(_model_cfg(), vocab_size=256)
    gqa = Transformer(_model_cfg(attention={"name": "mha", "n_heads": 4, "n_kv_heads": 1}), vocab_size=256)
    assert mha.kv_cache_bytes_per_token() == 2 * 2 * 2 * D  # bf16 x (k, v) x layers x d_model
    assert gqa.kv_cache_bytes_per_token() == mha.kv_cache_bytes_per_token() // 4
