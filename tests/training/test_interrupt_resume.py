"""Ctrl-C and SIGTERM save a checkpoint; `ckpt_path=auto` continues a run in its own folder."""

import logging
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from lmlab.errors import STOP_SIGNALS, RunInterrupted
from lmlab.training import module as module_lib
from lmlab.training import train
from lmlab.training.interrupt import GracefulStop

STEPS = ["trainer.max_steps=12", "trainer.val_every=6", "trainer.checkpoint_every=100", "trainer.log_every=1"]


def weights(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_the_step_and_auto_resume_finishes_the_run_exactly(make_cfg, tiny_overrides, tmp_path,
                                                                           monkeypatch, signum):
    straight = tmp_path / "straight"
    train(make_cfg([*tiny_overrides, *STEPS]), straight)
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN where pytest was started in the background

    calls = {"n": 0}
    real = module_lib.model_terms

    def signal_during_step_5(*args):
        calls["n"] += 1
        if calls["n"] == 5:
            os.kill(os.getpid(), signum)
        return real(*args)

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(module_lib, "model_terms", signal_during_step_5)
        with pytest.raises(RunInterrupted, match=f"stopped by {signum.name} after step 5 of 12") as stopped:
            train(make_cfg([*tiny_overrides, *STEPS]), run)
    assert stopped.value.exit_code == 128 + signum.value
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 5
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored

    results = train(make_cfg([*tiny_overrides, *STEPS, "ckpt_path=auto"]), run)
    assert results["val_loss"] > 0
    for key, value in weights(straight).items():
        assert torch.equal(weights(run)[key], value), key


def test_auto_resume_without_a_checkpoint_starts_and_a_finished_run_has_nothing_to_do(make_cfg, tiny_overrides,
                                                                                      tmp_path, caplog):
    run = tmp_path / "run"
    first = train(make_cfg([*tiny_overrides, *STEPS, "ckpt_path=auto"]), run)
    assert first["initial_val_loss"] > first["val_loss"]
    events = sorted((run / "tb").rglob("events.*"))
    with caplog.at_level(logging.INFO):
        again = train(make_cfg([*tiny_overrides, *STEPS, "ckpt_path=auto"]), run)
    assert "nothing to do" in caplog.text
    assert again["val_loss"] == pytest.approx(first["val_loss"]) and again["train_loss"] == pytest.approx(first["train_loss"])
    assert sorted((run / "tb").rglob("events.*")) == events  # no new, empty run in TensorBoard


def test_a_new_run_in_a_folder_that_holds_a_run_is_refused(tmp_path):
    from lmlab.errors import ConfigError
    from lmlab.training.resume import check_fresh_folder

    fresh, resumed = OmegaConf.create({"ckpt_path": None}), OmegaConf.create({"ckpt_path": "auto"})
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "tb").mkdir()  # Hydra's files and an empty logger folder: nothing of a run yet
    check_fresh_folder(fresh, tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    (tmp_path / "tb" / "events.out.tfevents.1").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints/, tb/\): resume it with ckpt_path=auto"):
        check_fresh_folder(fresh, tmp_path)
    check_fresh_folder(resumed, tmp_path)


def test_a_sigterm_lightning_took_while_the_run_set_up_stops_it_after_its_first_step(tmp_path):
    stop = GracefulStop(tmp_path / "last.ckpt", max_steps=10)
    STOP_SIGNALS.clear()
    stop.on_train_start(SimpleNamespace(global_step=0, received_sigterm=True), None)
    stop._restore()
    assert stop.received == signal.SIGTERM and STOP_SIGNALS == [signal.SIGTERM]
    STOP_SIGNALS.clear()
