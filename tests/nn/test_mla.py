"""Multi-head latent attention against a slow reference, inside the model, and from the CLI."""

import math

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.nn import ATTENTION, POSITIONS, ModelConfig, Transformer
from lmlab.nn.mla import MultiHeadLatentAttention
from lmlab.nn.positions import alibi_slopes
from tests.conftest import run_cli

D, H, SEQ = 32, 4, 12
# All widths differ (nope 6, rope 4, q/k 10, v 8, latent 12), so a mixed-up split or scale shows.
SMALL = {"name": "mla", "n_heads": H, "kv_lora_rank": 12, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4,
         "v_head_dim": 8}


def model_cfg(attention, position="rope", d_model=64):
    return ModelConfig(d_model=d_model, n_layers=2, max_seq_len=32, norm="rmsnorm", ffn="swiglu",
                       position=position, attention=attention, block="prenorm")


def rope_by_formula(x, pos, theta=10000.0):
    """Half-split RoPE: feature i pairs with i + d/2, turned by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    angle = pos[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)
    cos, sin = angle.cos().float(), angle.sin().float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rms(x, weight, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def latent_and_rope_key(attn, x, pos, rotate):
    """What an inference cache holds per token: the normalised latent and the rotated shared key."""
    r = attn.kv_lora_rank
    a = x @ attn.kv_a_proj_with_mqa.weight.T
    k_rope = a[..., r:]
    return rms(a[..., :r], attn.kv_a_layernorm.weight), rope_by_formula(k_rope, pos) if rotate else k_rope


def queries(attn, x, pos, rotate):
    if hasattr(attn, "q_proj"):
        q = x @ attn.q_proj.weight.T
    else:
        q = rms(x @ attn.q_a_proj.weight.T, attn.q_a_layernorm.weight) @ attn.q_b_proj.weight.T
    q = q.view(*x.shape[:2], attn.n_heads, -1).transpose(1, 2)  # (b, h, s, nope + rope)
    q_nope, q_rope = q[..., : attn.nope_dim], q[..., attn.nope_dim:]
    return q_nope, rope_by_formula(q_rope, pos) if rotate else q_rope


def causal_bias(n, alibi_heads=None):
    i = torch.arange(n)
    mask = torch.zeros(n, n).masked_fill(i[:, None] < i[None, :], float("-inf"))
    if alibi_heads is None:
        return mask
    return mask - alibi_slopes(alibi_heads)[:, None, None] * (i[:, None] - i[None, :]).clamp_min(0)


def reference_mla(attn, x, rotate=True, bias=None):
    """Expand the latent to full per-head K and V, then explicit softmax attention, head by head."""
    b, s, _ = x.shape
    pos = torch.arange(s)
    bias = causal_bias(s) if bias is None else bias
    latent, k_rope = latent_and_rope_key(attn, x, pos, rotate)
    kv = (latent @ attn.kv_b_proj.weight.T).view(b, s, attn.n_heads, attn.nope_dim + attn.v_dim)
    q_nope, q_rope = queries(attn, x, pos, rotate)
    heads = []
    for h in range(attn.n_heads):
        q = torch.cat([q_nope[:, h], q_rope[:, h]], dim=-1)
        k = torch.cat([kv[:, :, h, : attn.nope_dim], k_rope], dim=-1)  # every head shares k_rope
        v = kv[:, :, h, attn.nope_dim:]
        scores = q @ k.transpose(-2, -1) / math.sqrt(attn.nope_dim + attn.rope_dim)
        heads.append((scores + (bias if bias.dim() == 2 else bias[h])).softmax(-1) @ v)
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_default_config_builds_and_keeps_shape_in_the_transformer(q_lora_rank):
    model = Transformer(model_cfg({"name": "mla", "q_lora_rank": q_lora_rank}), vocab_size=256)
    attn = model.layers[0].self_attn
    assert type(attn).__name__ == "MultiHeadLatentAttention"
    assert (attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank) == (16, 16, 16, 64)
    assert model.position.cos.shape == (32, 8)  # RoPE tables sized for the decoupled rope part only
    names = set(dict(model.named_parameters()))
    q_names = ["q_proj"] if q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
    for name in [*q_names, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]:
        assert f"layers.1.self_attn.{name}.weight" in names
    logits = model(torch.randint(0, 256, (2, 20)))
    assert logits.shape == (2, 20, 256)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_matches_expanded_reference_with_decoupled_rope(q_lora_rank):
    attn = ATTENTION.build({**SMALL, "q_lora_rank": q_lora_rank}, D)
    cfg = ATTENTION.resolve(SMALL)[1]
    rope = POSITIONS.build("rope", SEQ, D, *MultiHeadLatentAttention.shape_for(D, cfg))  # head dim 4: rope part
    x = torch.randn(2, SEQ, D)
    torch.testing.assert_close(attn(x, rope, torch.arange(SEQ)), reference_mla(attn, x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("position", ["alibi", "nope"])
def test_matches_reference_without_rope(position):
    attn = ATTENTION.build(SMALL, D)
    pos_module = POSITIONS.build(position, SEQ, D, 4, H)
    x = torch.randn(2, SEQ, D)
    bias = causal_bias(SEQ, alibi_heads=H if position == "alibi" else None)
    expected = reference_mla(attn, x, rotate=False, bias=bias)
    torch.testing.assert_close(attn(x, pos_module, torch.arange(SEQ)), expected, atol=1e-5, rtol=1e-4)


def test_cached_latent_alone_gives_the_output():
    """Absorb kv_b_proj into the query and output sides: attention from the cache, never expanding K or V."""
    attn = ATTENTION.build(SMALL, D)
    rope = POSITIONS.build("rope", SEQ, D, 4, H)
    x, pos = torch.randn(1, SEQ, D), torch.arange(SEQ)
    latent, k_rope = latent_and_rope_key(attn, x, pos, rotate=True)  # (1, s, 12), (1, s, 4): all that is cached
    assert latent.shape[-1] + k_rope.shape[-1] == attn.kv_cache_elements_per_token()
    q_nope, q_rope = queries(attn, x, pos, rotate=True)
    w = attn.kv_b_proj.weight.view(H, attn.nope_dim + attn.v_dim, attn.kv_lora_rank)
    w_uk, w_uv = w[:, : attn.nope_dim], w[:, attn.nope_dim:]
    q_latent = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)  # query mapped into latent space
    scores = (q_latent @ latent[:, None].transpose(-2, -1) + q_rope @ k_rope[:, None].transpose(-2, -1))
    probs = (scores / math.sqrt(attn.nope_dim + attn.rope_dim) + causal_bias(SEQ)).softmax(-1)
    out = torch.einsum("bhsr,hvr->bshv", probs @ latent[:, None], w_uv).flatten(2) @ attn.o_proj.weight.T
    torch.testing.assert_close(attn(x, rope, pos), out, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_is_causal(q_lora_rank):
    model = Transformer(model_cfg({**SMALL, "q_lora_rank": q_lora_rank}, d_model=D), vocab_size=64)
    ids = torch.randint(0, 64, (2, 16))
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 64
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize("position", ["rope", "alibi", "nope"])
def test_kv_cache_holds_only_latent_and_shared_rope_key(position):
    mla = Transformer(model_cfg({"name": "mla", "kv_lora_rank": 32, "qk_rope_head_dim": 8}, position), 256)
    mha = Transformer(model_cfg({"name": "mha", "n_heads": 4}, position), 256)
    assert mla.kv_cache_bytes_per_token() == 2 * 2 * (32 + 8)  # bf16 x layers x (latent + rope key)
    assert mla.kv_cache_bytes_per_token() < mha.kv_cache_bytes_per_token() == 2 * 2 * 2 * 64
    assert mla(torch.randint(0, 256, (1, 32))).shape == (1, 32, 256)


def test_score_flops_reduce_to_mha_when_head_dims_match():
    mla = ATTENTION.build({"name": "mla", "n_heads": 4, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4}, D)
    mha = ATTENTION.build({"name": "mha", "n_heads": 4}, D)  # head dim 8 = 4 nope + 4 rope, v 8
    assert mla.score_flops_per_token(16) == mha.score_flops_per_token(16)
    assert ATTENTION.build(SMALL, D).score_flops_per_token(16) == 12 * H * (6 + 4 + 8) / 2 * 16


@pytest.mark.parametrize("bad, message", [
    ({"kv_lora_rank": 0}, "attention.kv_lora_rank=0 must be positive"),
    ({"q_lora_rank": -1}, "attention.q_lora_rank=-1 must be positive"),
    ({"qk_rope_head_dim": 5}, "attention.qk_rope_head_dim=5 must be even"),
    ({"v_head_dim": 0}, "attention.v_head_dim=0 must be positive"),
    ({"n_heads": 0}, "attention.n_heads=0 must be positive"),
    ({"n_heads": 3, "qk_nope_head_dim": None}, "model.d_model=32 is not divisible by attention.n_heads=3"),
])
def test_bad_configs_name_the_field(bad, message):
    with pytest.raises(ConfigError, match=message):
        ATTENTION.build({**SMALL, **bad}, D)
    with pytest.raises(ConfigError, match=message):  # caught before the position module is sized from it
        Transformer(model_cfg({**SMALL, **bad}, d_model=D), vocab_size=64)


def test_odd_head_counts_are_fine_when_head_dims_are_set():
    attn = ATTENTION.build({**SMALL, "n_heads": 3}, D)
    x = torch.randn(1, 5, D)
    assert attn(x, POSITIONS.build("rope", 8, D, 4, 3), torch.arange(5)).shape == x.shape


def test_listed_by_lmlab_list(tmp_path):
    proc = run_cli(["lmlab", "list", "attention"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "mla" in proc.stdout and "kv_lora_rank: int = 64" in proc.stdout
    assert "multi-head latent attention" in proc.stdout
