"""Initialisation schemes, and muP's promise: what is tuned at one width holds at others."""

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.nn import ModelConfig, Transformer
from lmlab.optim import OPTIMIZERS


def model(width=64, init="gpt2", n_layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=width, n_layers=n_layers, max_seq_len=16, norm="rmsnorm",
                      ffn={"name": "swiglu", "d_ff": 4 * width}, position="rope", attention={"name": "mha", "n_heads": 4},
                      block="prenorm", init=init, vocab_size=64)
    return Transformer(cfg, 64)


def test_standard_init_is_one_over_sqrt_fan_in():
    m = model(256, "standard")
    assert m.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(1024 ** -0.5, rel=0.05)
    assert m.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(256 ** -0.5, rel=0.05)
    assert m.embed_tokens.weight.std().item() == pytest.approx(1.0, rel=0.05)


def test_gpt2_init_scales_residual_outputs_by_depth():
    m = model(256, {"name": "gpt2", "std": 0.02}, n_layers=8)
    assert m.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert m.layers[3].self_attn.o_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert m.layers[3].mlp.down_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert m.lr_multipliers == {} and m.output_multiplier == 1.0


def test_mup_multipliers_and_parameter_groups():
    m = model(256, {"name": "mup", "base_d_model": 64})
    assert m.output_multiplier == 0.25
    assert m.layers[0].self_attn.score_scale == pytest.approx(1 / math.sqrt(64 * 4))
    assert m.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.02 / 2, rel=0.05)
    assert m.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(0.02 / 2 / 2, rel=0.05)  # and depth's 1/sqrt(4)
    assert m.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert m.lr_multipliers["layers.1.self_attn.k_proj.weight"] == 0.25
    assert "embed_tokens.weight" not in m.lr_multipliers and "lm_head.weight" not in m.lr_multipliers
    groups = OPTIMIZERS.build({"name": "adamw", "lr": 1e-2}, m).param_groups
    hidden = next(g for g in groups if g["lr"] == pytest.approx(2.5e-3))
    assert any(p is m.layers[0].mlp.gate_proj.weight for p in hidden["params"])
    assert sum(len(g["params"]) for g in groups) == len(list(m.parameters()))


def test_mup_at_its_base_width_is_the_gpt2_scheme():
    mup, gpt2 = model(64, {"name": "mup", "base_d_model": 64}, n_layers=4), model(64, "gpt2", n_layers=4)
    for (name, a), (_, b) in zip(mup.named_parameters(), gpt2.named_parameters()):
        assert torch.equal(a, b), name
    assert set(mup.lr_multipliers.values()) == {1.0} and mup.output_multiplier == 1.0
    assert mup.layers[0].self_attn.score_scale == pytest.approx(1 / math.sqrt(16))  # 1/sqrt(head_dim), the default


def logit_change(width: int, init) -> float:
    """How much 5 AdamW steps at one learning rate move the logits (a muP coordinate check)."""
    m = model(width, init)
    opt = OPTIMIZERS.build({"name": "adamw", "lr": 1e-2, "weight_decay": 0.0}, m)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
    with torch.no_grad():
        before = m(x)
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    with torch.no_grad():
        return (m(x) - before).std().item()


def test_mup_keeps_the_update_size_constant_as_width_grows():
    widths = (64, 128, 256, 512)
    mup = [logit_change(w, {"name": "mup", "base_d_model": 64}) for w in widths]
    sp = [logit_change(w, "gpt2") for w in widths]
    assert max(mup) / min(mup) < 1.3, mup  # measured 0.61, 0.54, 0.53, 0.52
    assert sp[-1] / sp[0] > 3, sp  # standard parametrisation: 0.59 -> 2.31, the updates blow up with width
