"""End to end, in process: optimizers, parameter groups, schedules and step skipping inside lmlab-train."""

import logging
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lmlab.errors import ConfigError
from lmlab.training import module as module_lib
from lmlab.training import train


def scalars(run_dir, tag):
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


@pytest.mark.parametrize("optim", ["muon", "lion"])
def test_resume_continues_bit_for_bit_with_optimizer_state(make_cfg, tiny_overrides, tmp_path, optim):
    extra = [*tiny_overrides, f"optim={optim}", "optim.lr=1e-3", "trainer.max_steps=20", "trainer.spike_factor=3"]
    train(make_cfg(extra), tmp_path / "straight")
    ckpt = tmp_path / "straight" / "checkpoints" / "step000010.ckpt"
    assert torch.load(ckpt, weights_only=False)["optimizer_states"][0]["state"]  # momentum buffers are saved
    train(make_cfg([*extra, f"ckpt_path={ckpt}"]), tmp_path / "resumed")
    a = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=False)
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    assert a["lmlab_step_guard"] == b["lmlab_step_guard"]


def test_muon_run_prints_its_groups_and_logs_both_learning_rates(make_cfg, tiny_overrides, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        train(make_cfg([*tiny_overrides, "optim=muon", "trainer.max_steps=10"]), tmp_path / "run")
    table = next(r.getMessage() for r in caplog.records if "optimizer parameter groups" in r.getMessage())
    assert "muon" in table and "matrix" in table and "adamw" in table and "embedding" in table
    lrs = scalars(tmp_path / "run", "lr/adamw")
    assert lrs and max(lrs.values()) <= 3e-3
    assert max(scalars(tmp_path / "run", "train/grad_norm").values()) > 0


def test_a_nan_step_is_skipped_and_counted(make_cfg, tiny_overrides, tmp_path, monkeypatch, caplog):
    calls = {"n": 0}
    real = module_lib.model_terms

    def nan_at_step_7(*args):
        terms = real(*args)
        calls["n"] += 1
        if calls["n"] == 7:
            terms["loss"] = terms["loss"] * math.nan
        return terms

    monkeypatch.setattr(module_lib, "model_terms", nan_at_step_7)
    results = train(make_cfg([*tiny_overrides, "trainer.max_steps=10", "trainer.log_every=1"]), tmp_path / "run")
    assert math.isfinite(results["val_loss"])
    skipped = scalars(tmp_path / "run", "train/skipped_steps")
    assert skipped[5] == 0 and skipped[6] == 1 and skipped[9] == 1
    assert any("skipped (non-finite)" in r.getMessage() for r in caplog.records)


def test_wsd_decays_from_a_stable_phase_checkpoint(make_cfg, tiny_overrides, tmp_path):
    stable = [*tiny_overrides, "sched=wsd", "sched.warmup_steps=2", "sched.decay_fraction=0", "trainer.max_steps=20"]
    train(make_cfg(stable), tmp_path / "stable")
    ckpt = tmp_path / "stable" / "checkpoints" / "step000010.ckpt"
    decay = [*stable, "trainer.max_steps=16", "sched.decay_start=10", "sched.decay_shape=linear",
             "trainer.log_every=1", f"ckpt_path={ckpt}"]
    train(make_cfg(decay), tmp_path / "decayed")
    lr = scalars(tmp_path / "decayed", "lr")
    assert lr[10] == pytest.approx(1e-2) and lr[13] == pytest.approx(1e-2 * 3 / 6) and lr[15] == pytest.approx(1e-2 / 6)


@pytest.mark.parametrize("extra,match", [
    (["optim.groups=[{roles:[matrix]}]"], "no group in optim.groups matches"),
    (["optim=muon", "optim.groups.1.roles=[embedding,matrix]"], "role 'matrix' is in optim.groups"),
    (["optim.betas=[0.9,1.0]"], "betas must be two numbers in"),
    (["optim=sgd", "optim.lr=0"], "learning rate must be > 0"),
    (["sched=wsd", "sched.decay_start=100"], "outside the stable phase"),
    (["trainer.spike_factor=0.5"], "spike_factor must be > 1"),
])
def test_bad_optimizer_settings_fail_before_training(make_cfg, tiny_overrides, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        train(make_cfg([*tiny_overrides, *extra]), tmp_path / "run")
    assert not (tmp_path / "run").exists()
