"""trainer.precision=bf16-true: bf16 weights and Adam moments, rounded stochastically, trained by lmlab-train."""

import logging

import pytest
import torch
import torchmetrics

from lmlab.training import train
from lmlab.training.precision import Float32Metrics, precision_plugin


@pytest.mark.parametrize("extra,moments", [([], torch.bfloat16), (["optim.state_dtype=float32"], torch.float32)])
def test_lmlab_train_in_bf16_trains_bf16_weights(make_cfg, tiny_overrides, tmp_path, caplog, extra, moments):
    with caplog.at_level(logging.WARNING, logger="lmlab.training.module"):
        results = train(make_cfg([*tiny_overrides, "trainer.max_steps=15", "trainer.val_every=15",
                                  "trainer.precision=bf16-true", *extra]), tmp_path / "run")
    assert results["val_loss"] < results["initial_val_loss"] - 1.0
    assert "rounded to nearest" not in caplog.text  # adamw rounds its bf16 writes stochastically
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert {w.dtype for w in saved["state_dict"].values() if w.is_floating_point()} == {torch.bfloat16}
    states = [t for state in saved["optimizer_states"][0]["state"].values() for t in state.values()
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert states and {t.dtype for t in states} == {moments}


def test_an_optimizer_that_rounds_bf16_to_nearest_is_warned_about(make_cfg, tiny_overrides, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lmlab.training.module"):
        train(make_cfg([*tiny_overrides, "trainer.max_steps=5", "trainer.val_every=5", "trainer.precision=bf16-true",
                        "optim=sgd"]), tmp_path / "run")
    assert "optim=sgd writes" in caplog.text and "rounded to nearest" in caplog.text


def test_metric_states_cast_with_the_module_come_back_to_float32():
    module = torch.nn.Module()
    module.val_loss = torchmetrics.MeanMetric()
    module = precision_plugin("bf16-true", torch.device("cpu")).convert_module(module)
    assert module.val_loss.mean_value.dtype == torch.bfloat16  # what Lightning's cast does to a metric
    Float32Metrics().on_validation_start(None, module)
    module.val_loss.update(torch.tensor(6.34567), weight=10)
    assert module.val_loss.compute().item() == pytest.approx(6.34567, rel=1e-6)
