"""Fused projections (lmlab.nn.fused): the same outputs from one matmul, weights shared with the
Linears, the module's own Linears whenever autograd runs or the group went stale."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lmlab.nn import ModelConfig, Transformer
from lmlab.nn.fused import fuse_projections


def _model(**overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(**{"d_model": 32, "n_layers": 2, "max_seq_len": 32, "norm": "rmsnorm", "ffn": "swiglu",
                         "position": "rope", "attention": {"name": "mha", "n_heads": 4, "n_kv_heads": 2},
                         "block": "prenorm", **overrides})
    return Transformer(cfg, vocab_size=64).eval()


IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def test_fused_forward_equals_unfused_and_shares_the_weights():
    model = _model()
    with torch.no_grad():
        expected = model(IDS)
    assert fuse_projections(model) == 4  # q/k/v and gate/up of two layers
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.fused_projections.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), expected, atol=1e-5, rtol=1e-5)
        attn.k_proj.weight.mul_(2.0)  # an in-place update (optimizer step, load_state_dict) reaches the fused weight
        rows = attn.q_proj.out_features
        torch.testing.assert_close(attn.fused_projections.weight[rows:rows + attn.k_proj.out_features],
                                   attn.k_proj.weight)
    assert fuse_projections(model) == 4  # still current: nothing is rebuilt


def test_autograd_runs_the_linears_and_their_gradients_arrive():
    model = _model()
    with torch.inference_mode():
        fuse_projections(model)  # made under inference mode, the weights still train
    model.train()
    model(IDS).square().mean().backward()
    for name in ("q_proj", "k_proj", "v_proj"):
        assert getattr(model.layers[0].self_attn, name).weight.grad.abs().sum() > 0
    assert model.layers[1].mlp.up_proj.weight.grad.abs().sum() > 0


def test_a_replaced_linear_or_parameter_returns_to_the_modules_own_linears():
    model = _model()
    fuse_projections(model)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    attn.v_proj = nn.Linear(32, attn.v_proj.out_features, bias=False)  # e.g. quantization swaps a module
    mlp.up_proj.weight = nn.Parameter(mlp.up_proj.weight.detach() * 3)  # e.g. sharding swaps a parameter
    reference = copy.deepcopy(model)
    for module in (reference.layers[0].self_attn, reference.layers[0].mlp):
        module.fused_projections = None
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), reference(IDS))
    assert fuse_projections(model) == 4  # both groups fused again around the new parameters
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), reference(IDS), atol=1e-5, rtol=1e-5)


def test_a_moved_model_is_fused_again():
    model = _model()
    fuse_projections(model)
    model.double()  # the Linears' weights are no longer views of the fused (float32) weights
    fuse_projections(model)
    assert model.layers[0].self_attn.fused_projections.weight.dtype == torch.float64
    with torch.no_grad():
        model(IDS)


def test_modules_that_cannot_fuse_are_left_alone():
    model = _model(ffn="gelu")  # two-matrix FFN: nothing to fuse
    assert fuse_projections(model) == 2
    assert "fused_projections" not in vars(model.layers[0].mlp)


def test_hooked_linears_see_their_own_calls():
    model = _model()
    fuse_projections(model)
    seen = []
    attn = model.layers[0].self_attn
    handles = [attn.k_proj.register_forward_pre_hook(lambda m, args: seen.append("k")),
               nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m).__name__))]
    with torch.no_grad():
        model(IDS)
    assert seen.count("k") == 1 and seen.count("Linear") == 2 * 7 + 1  # seven per layer, and the head
    for handle in handles:
        handle.remove()
    seen.clear()
    with torch.no_grad():
        model(IDS)
    assert not seen
