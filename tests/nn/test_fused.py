"""Fused projections (lmlab.nn.fused): the same outputs from one matmul. Inference groups share their weights
with the Linears and step aside under autograd; training groups concatenate the weights at each call and give
the unfused gradients. Both return to the module's own Linears once the group went stale or hooks watch them."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch import nn

from lmlab.cli.compose import compose_config
from lmlab.errors import ConfigError
from lmlab.nn import ModelConfig, Transformer
from lmlab.nn.fused import FusedLinears, fuse_for_training, fuse_projections
from lmlab.training.launch import launch
from lmlab.training.run import check_parallel
from tests.conftest import TINY


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


def _loss_and_grads(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(IDS).square().mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_training_groups_give_the_unfused_loss_and_gradients_from_one_matmul_per_group(monkeypatch):
    model = _model().train()
    loss, grads = _loss_and_grads(model)
    assert fuse_for_training(model) == 4
    params = {name: p for name, p in model.named_parameters()}
    calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, *a: calls.append(w.shape[0]) or real_linear(x, w, *a))
    fused_loss, fused_grads = _loss_and_grads(model)
    # per layer: q/k/v (32 + 16 + 16 rows), o, gate/up (2 x 128), down; then the head
    assert calls == [64, 32, 256, 32] * 2 + [64]
    assert {name: p for name, p in model.named_parameters()} == params  # the parameters themselves, untouched
    torch.testing.assert_close(fused_loss, loss, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_training_groups_step_aside_for_hooks_and_replaced_linears_and_give_way_to_inference_packing():
    model = _model().train()
    fuse_for_training(model)
    attn = model.layers[0].self_attn
    seen = []
    handle = attn.q_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    model(IDS).sum().backward()
    assert len(seen) == 1  # the hooked Linear ran itself
    handle.remove()
    attn.v_proj = nn.Linear(32, attn.v_proj.out_features, bias=False)  # e.g. float8 training swaps a module
    model.zero_grad()
    model(IDS).sum().backward()
    assert attn.v_proj.weight.grad is not None and attn.q_proj.weight.grad is not None
    assert fuse_projections(model) == 4  # an inference engine packs every group, the stale one too
    assert all(isinstance(m.fused_projections, FusedLinears) for m in (attn, model.layers[1].mlp))


def test_fused_projections_is_refused_with_a_strategy_that_shards_the_parameters():
    cfg = compose_config([*TINY, "parallel=fsdp", "trainer.devices=2", "trainer.fused_projections=true"])
    with mock.patch("os.cpu_count", return_value=2), pytest.raises(ConfigError, match="trainer.fused_projections"):
        check_parallel(cfg, cfg.data.batch_size)
    cfg.parallel = compose_config([*TINY, "parallel=ddp"]).parallel  # one copy of the weights per rank: fine
    with mock.patch("os.cpu_count", return_value=2):
        check_parallel(cfg, cfg.data.batch_size)


def test_lmlab_train_with_fused_projections_ends_where_the_unfused_run_does(tmp_path):
    common = [*TINY, f"cache_dir={tmp_path / 'cache'}", "trainer.max_steps=4", "trainer.val_every=4",
              "sched.warmup_steps=1"]
    plain = launch(compose_config(common), tmp_path / "plain")
    with mock.patch("lmlab.training.module.fuse_for_training", wraps=fuse_for_training) as fuse:
        fused = launch(compose_config([*common, "trainer.fused_projections=true"]), tmp_path / "fused")
    assert fuse.call_count == 1
    assert fused["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-5)
