"""MoE: routers, dispatch against a slow per-token reference, capacity, losses, stats, errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError
from lmlab.nn.moe import MoELayer, grouped_linear
from lmlab.nn.moe.routers import load_balancing_loss
from lmlab.nn.transformer import ModelConfig, Transformer

D = 32


def make_layer(router="topk", ffn="swiglu", **fields):
    torch.manual_seed(0)
    layer = MoELayer(D, {"name": ffn}, {"name": router, "n_experts": 4, "k": 2, "d_ff": 48, **fields})
    for p in layer.parameters():  # larger gate weights than the default init: uneven, capacity-bound routing
        torch.nn.init.normal_(p, std=0.3)
    return layer


def reference(layer: MoELayer, x: torch.Tensor, token_ids=None) -> torch.Tensor:
    """One token and one expert at a time, with the capacity rule written out."""
    logits = layer.gate(x) if layer.gate is not None else None
    routing = layer.router(logits, token_ids)
    capacity = layer.router.capacity(len(x))
    taken = [0] * layer.router.n_experts
    out = torch.zeros_like(x)
    for e, t, w in zip(routing.expert_index.tolist(), routing.token_index.tolist(), routing.weight):
        if capacity is not None and taken[e] >= capacity:
            continue
        taken[e] += 1
        weights = {name: getattr(layer.experts, name)[e] for name in layer.experts.ffn.projections}
        y = layer.experts.ffn.combine(x[t:t + 1], lambda name, h: F.linear(h, weights[name]))
        out[t] += w * y[0]
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x)
    return out


CASES = [
    ("topk", "swiglu", {}),
    ("topk", "gelu", {"score": "sigmoid", "renormalize": False}),
    ("topk", "swiglu", {"capacity_factor": 0.5}),
    ("topk", "relu", {"capacity_factor": 1.0, "n_shared_experts": 1}),
    ("aux_free", "swiglu", {"capacity_factor": 0.75}),
    ("expert_choice", "swiglu", {"capacity_factor": 0.5}),
    ("hash", "swiglu", {"capacity_factor": 0.6}),
]


@pytest.mark.parametrize("router,ffn,fields", CASES)
def test_dispatch_matches_per_token_reference_forward_and_backward(router, ffn, fields):
    layer = make_layer(router, ffn, **fields).eval().double()  # float64: the two sum in different orders
    if router == "hash":
        layer.router.bind_vocab(50)
    x = torch.randn(2, 13, D, dtype=torch.float64)
    token_ids = torch.randint(0, 50, (2, 13))
    layer.token_ids = token_ids
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(x1)
    params = list(layer.parameters())
    grads = torch.autograd.grad(y.square().sum(), [x1, *params])
    y_ref = reference(layer, x2.reshape(-1, D), token_ids.reshape(-1)).reshape(x.shape)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [x2, *params], allow_unused=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, torch.zeros_like(g) if g_ref is None else g_ref, rtol=1e-10, atol=1e-10)


def test_grouped_linear_equals_one_matmul_per_expert():
    x, w = torch.randn(10, 8), torch.randn(3, 5, 8)
    counts = torch.tensor([3, 0, 7])
    expected = torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T])
    torch.testing.assert_close(grouped_linear(x, w, counts), expected)


def test_capacity_drops_tokens_which_pass_through_as_zero():
    layer = make_layer(capacity_factor=0.25).eval()
    x = torch.randn(64, D)
    out = layer(x)
    dropped = layer.stats()["dropped"]
    assert 0 < dropped < 1
    zero_rows = (out.abs().sum(-1) == 0).float().mean()
    assert zero_rows == pytest.approx(float(dropped))  # no expert: nothing added to the residual
    loads = torch.stack([layer.stats()[f"load/expert{e}"] for e in range(4)])
    assert loads.sum() == pytest.approx(1.0)


def test_expert_choice_gives_every_expert_exactly_its_capacity():
    layer = make_layer("expert_choice", capacity_factor=1.0)
    layer(torch.randn(40, D))
    for e in range(4):
        assert layer.stats()[f"load/expert{e}"] == pytest.approx(0.25)


def test_hash_router_is_a_fixed_function_of_the_token_id():
    model = tiny_model(moe={"name": "hash", "n_experts": 4, "k": 1})
    router = model.layers[0].mlp.router
    assert router.expert_of_token.shape == (model.vocab_size,)
    assert torch.bincount(router.expert_of_token, minlength=4).tolist() == [model.vocab_size // 4] * 4
    ids = torch.tensor([[5, 9, 5, 9]])
    routing = router(None, ids.reshape(-1))
    assert routing.expert_index[0] == routing.expert_index[2] and routing.expert_index[1] == routing.expert_index[3]


def test_load_balancing_loss_is_one_when_balanced_and_trains_the_gate():
    probs = torch.full((8, 4), 0.25)
    assert load_balancing_loss(probs, torch.arange(8) % 4, 4) == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    assert load_balancing_loss(skewed, torch.zeros(8, dtype=torch.long), 4) == pytest.approx(2.8)
    layer = make_layer()
    layer(torch.randn(16, D))
    assert set(layer.losses) == {"moe_aux_loss", "router_z_loss"}
    (grad,) = torch.autograd.grad(layer.losses["moe_aux_loss"], layer.gate.weight)
    assert grad.abs().sum() > 0


def test_aux_free_bias_moves_load_toward_balance_only_in_training():
    layer = make_layer("aux_free", bias_update_rate=0.1)
    with torch.no_grad():
        layer.gate.weight[0] += 2.0  # expert 0 wins most tokens
    x = torch.randn(64, D).abs()
    layer.eval()(x)
    assert torch.equal(layer.router.expert_bias, torch.zeros(4))
    layer.train()(x)
    bias = layer.router.expert_bias
    assert bias[0] < 0 and bias[1:].max() > 0
    assert layer.stats()["load/expert0"] == 0.5  # chosen by every token: as loaded as top-2 allows
    late_loads = []
    for step in range(40):
        layer(x)
        if step >= 20:
            late_loads.append(layer.stats()["load/expert0"])
    assert torch.stack(late_loads).mean() < 0.4


def test_only_the_selected_layers_are_moe_and_shared_experts_see_every_token():
    model = tiny_model(n_layers=4, moe={"name": "topk", "n_experts": 4, "k": 1, "first_layer": 1, "every": 2,
                                        "n_shared_experts": 2})
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["SwiGLU", "MoELayer", "SwiGLU", "MoELayer"]
    moe = model.layers[1].mlp
    assert moe.shared_experts.down_proj.in_features == 2 * moe.experts.gate_proj.shape[1]


def test_experts_are_initialised_like_dense_matrices():
    model = tiny_model(n_layers=2, moe={"name": "topk", "n_experts": 16})
    experts = model.layers[0].mlp.experts
    assert experts.gate_proj.std().item() == pytest.approx(0.02, rel=0.05)
    assert experts.down_proj.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.05)  # GPT-2 residual scaling
    assert not torch.equal(experts.gate_proj[0], experts.gate_proj[1])


def test_top2_of_8_at_half_width_has_the_dense_active_parameters():
    dense = tiny_model(ffn={"name": "swiglu", "d_ff": 128})
    moe = tiny_model(ffn={"name": "swiglu"}, moe={"name": "topk", "n_experts": 8, "k": 2, "d_ff": 64})
    gates = sum(layer.mlp.gate.weight.numel() for layer in moe.layers)
    assert moe.num_active_parameters() - gates == dense.num_parameters()
    dense_ffn = sum(p.numel() for layer in dense.layers for p in layer.mlp.parameters())
    assert moe.num_parameters() - gates == dense.num_parameters() + 3 * dense_ffn  # 8 half-width experts = 4 FFNs
    assert moe.flops_per_token(16) - 6 * gates == dense.flops_per_token(16)


@pytest.mark.parametrize("fields,match", [
    ({"k": 5}, "k=5 must be between 1 and n_experts=4"),
    ({"capacity_factor": 0.0}, "capacity_factor must be > 0"),
    ({"capacity_factor": -1.0}, "capacity_factor must be > 0"),
    ({"score": "tanh"}, "score must be one of softmax, sigmoid"),
    ({"name": "hash", "vocab_size": 100}, "vocab_size=100 does not match the model's vocabulary of 320"),
])
def test_bad_moe_config_fails_when_the_model_is_built(fields, match):
    with pytest.raises(ConfigError, match=match):
        tiny_model(moe={"name": "topk", "n_experts": 4, **fields})


def test_moe_composes_from_the_command_line_and_fails_in_preflight(make_cfg, tiny_overrides, tmp_path):
    from lmlab.training import train

    cfg = make_cfg([*tiny_overrides, "model/moe=topk", "model.moe.n_experts=8", "model.moe.k=2"])
    assert cfg.model.moe.name == "topk" and cfg.model.moe.k == 2 and cfg.model.moe.capacity_factor is None
    with pytest.raises(ConfigError, match="k=9 must be between 1 and n_experts=8"):
        train(make_cfg([*tiny_overrides, "model/moe=topk", "model.moe.k=9"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def tiny_model(n_layers=2, ffn="swiglu", moe=None, **extra) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=D, n_layers=n_layers, max_seq_len=16, norm="rmsnorm", ffn=ffn, position="rope",
                      attention={"name": "mha", "n_heads": 2}, block="prenorm", moe=moe, **extra)
    return Transformer(cfg, vocab_size=300)
