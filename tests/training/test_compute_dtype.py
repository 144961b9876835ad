"""trainer.compute_dtype: forward and backward on bf16 copies of the float32 parameters, which stay the masters."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.nn.transformer import Transformer
from lmlab.training import train
from lmlab.training.compute_dtype import CastParameters, _Linked
from lmlab.training.losses import LOSSES
from lmlab.training.objective import model_terms
from tests.conftest import OpCounts

MOE_MTP = ["model/moe=topk", "model.moe.n_experts=4", "model.moe.k=2", "model.mtp.depth=1"]


def _model(make_cfg, overrides) -> tuple[Transformer, torch.nn.Module]:
    cfg = make_cfg(overrides)
    torch.manual_seed(0)
    return Transformer(cfg.model, 320), LOSSES.build(cfg.loss)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("extra", [[], ["model.tie_embeddings=true"], MOE_MTP], ids=["dense", "tied", "moe-mtp"])
def test_blocks_run_in_bf16_and_float32_parameters_get_float32_gradients(make_cfg, tiny_overrides, extra):
    model, loss_fn = _model(make_cfg, [*tiny_overrides, *extra])
    tokens = _tokens()
    want = model_terms(model, loss_fn, tokens[:, :-1], tokens[:, 1:])["loss"]
    want.backward()
    want_grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    residual = []
    hook = model.layers[0].register_forward_hook(lambda module, args, out: residual.append(out.dtype))
    got = CastParameters(model, torch.bfloat16)(model_terms, model, loss_fn, tokens[:, :-1], tokens[:, 1:])["loss"]
    hook.remove()
    got.backward()

    assert residual == [torch.bfloat16]  # the residual stream itself, not only the matmuls
    assert got.item() == pytest.approx(want.item(), rel=2e-2)
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and p.dtype == torch.float32, name  # the masters are put back
        assert (p.grad is None) == (want_grads[name] is None), name
        if p.grad is not None:
            assert p.grad.dtype == torch.float32, name
            assert (p.grad - want_grads[name]).norm() <= 0.05 * want_grads[name].norm() + 1e-6, name
    if "model.tie_embeddings=true" in extra:
        assert model.lm_head.weight is model.embed_tokens.weight


def test_one_cast_launch_forward_and_one_per_block_backward(make_cfg, tiny_overrides):
    model, loss_fn = _model(make_cfg, tiny_overrides)
    tokens = _tokens()
    cast = CastParameters(model, torch.bfloat16)
    forward, backward = OpCounts(), OpCounts()
    with forward:
        loss = cast(model_terms, model, loss_fn, tokens[:, :-1], tokens[:, 1:])["loss"]
    with backward:
        loss.backward()
    assert forward.counts["_foreach_copy_"] == 1
    assert backward.counts["_foreach_copy_"] == len(model.blocks()) + 1  # then embedding, final norm, head together


def test_an_unused_copy_leaves_its_parameter_without_gradient():
    used, unused = torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)
    a, b = _Linked.apply(2, used, unused, used.detach().bfloat16(), unused.detach().bfloat16())
    assert a.dtype == b.dtype == torch.bfloat16
    (a.float() * 2).sum().backward()
    assert used.grad.dtype == torch.float32 and torch.equal(used.grad, torch.full((3,), 2.0))
    assert unused.grad is None


def test_lmlab_train_with_bf16_compute_trains_float32_weights(make_cfg, tiny_overrides, tmp_path):
    results = train(make_cfg([*tiny_overrides, "trainer.max_steps=15", "trainer.val_every=15",
                              "trainer.compute_dtype=bfloat16"]), tmp_path / "run")
    assert results["val_loss"] < results["initial_val_loss"] - 1.0
    weights = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert {w.dtype for w in weights.values() if w.is_floating_point()} == {torch.float32}


@pytest.mark.parametrize("extra,match", [
    (["trainer.compute_dtype=int8"], "trainer.compute_dtype must be one of bfloat16, float16"),
    (["trainer.compute_dtype=bfloat16", "recompute=full"], "Set recompute=none or trainer.compute_dtype=null"),
    (["trainer.compute_dtype=bfloat16", "parallel=zero3"], "parallel=zero3 shards or splits them"),
    (["trainer.compute_dtype=bfloat16", "trainer.precision=bf16-true"], "stores them in 16 bits already"),
])
def test_what_cannot_run_on_cast_copies_fails_before_training(make_cfg, tiny_overrides, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        train(make_cfg([*tiny_overrides, *extra]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_task_that_would_ignore_compute_dtype_refuses_it(make_cfg, tiny_overrides):
    from lmlab.cli.train import check_job

    with pytest.raises(ConfigError, match="task=contrastive does not apply trainer.compute_dtype=bfloat16"):
        check_job(make_cfg([*tiny_overrides, "task=contrastive", "trainer.compute_dtype=bfloat16"]))
    check_job(make_cfg([*tiny_overrides, "trainer.compute_dtype=bfloat16"]))  # pretrain applies it


@pytest.mark.slow
def test_compiled_blocks_on_cast_copies_match_eager(make_cfg, tiny_overrides):
    """Per-block torch.compile (trainer.compile) sees the bf16 copies: the loss and gradients of eager casting."""
    from lmlab.training.compile import compile_for_training

    grads = []
    for compiled in (False, True):
        model, loss_fn = _model(make_cfg, tiny_overrides)
        if compiled:
            compile_for_training(model, loss_fn)
        tokens = _tokens()
        loss = CastParameters(model, torch.bfloat16)(model_terms, model, loss_fn, tokens[:, :-1], tokens[:, 1:])
        loss["loss"].backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=5e-2, atol=1e-3)


@pytest.mark.slow
def test_the_whole_step_compiled_casts_as_eager_does(make_cfg, tiny_overrides):
    """trainer.cuda_graphs' whole-step compile (on a CPU: the compile alone) with the casts inside its graph."""
    from lmlab.training.compile import graphed_model_terms

    losses = []
    for graphed in (False, True):
        model, loss_fn = _model(make_cfg, tiny_overrides)
        cast = CastParameters(model, torch.bfloat16)
        terms = graphed_model_terms(model, loss_fn, cast) if graphed else (
            lambda x, y, positions=None: cast(model_terms, model, loss_fn, x, y, positions))
        tokens = _tokens()
        loss = terms(tokens[:, :-1], tokens[:, 1:], None)["loss"]
        loss.backward()
        losses.append((loss.item(), model.layers[0].mlp.down_proj.weight.grad))
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-2)
    torch.testing.assert_close(losses[1][1], losses[0][1], rtol=5e-2, atol=1e-3)


@pytest.mark.parametrize("strategy", ["ddp", "bucketed_ddp"])
def test_two_data_parallel_processes_on_cast_copies_match_one(make_cfg, tiny_overrides, tmp_path, strategy):
    """The float32 gradients reach the data-parallel reduction (DDP's hooks, lmlab's buckets) as without casting.
    bf16 rounds the halves of the batch apart from the whole, and Adam's step turns that into sign flips on a few
    near-zero gradients, so weights agree on average (a run on half the batch ends up to 55% off, on average)."""
    from lmlab.training.launch import launch

    common = [*tiny_overrides, "trainer.max_steps=4", "trainer.val_every=4", "sched.warmup_steps=1",
              "trainer.compute_dtype=bfloat16"]
    states = []
    for name, extra in (("one", []), ("two", [f"parallel={strategy}", "trainer.devices=2"])):
        launch(make_cfg([*common, *extra]), tmp_path / name)
        states.append(torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"])
    assert states[0].keys() == states[1].keys()
    for key, value in states[0].items():
        if key.startswith("model."):
            assert (states[1][key] - value).abs().mean() <= 0.01 * value.abs().mean(), key
