"""What a person sees: steps of max_steps, plain lines without a terminal, final numbers that agree."""

import logging
import re

from lmlab.training import train
from lmlab.training.progress import quiet_library_noise


def test_without_a_bar_a_line_is_logged_every_log_every_steps_and_after_each_validation(make_cfg, tiny_overrides,
                                                                                       tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        results = train(make_cfg([*tiny_overrides, "trainer.max_steps=12", "trainer.val_every=5",
                                  "trainer.log_every=4"]), tmp_path / "run")
    lines = [r.getMessage() for r in caplog.records if r.name == "lmlab.training.progress"]
    assert [line.split(":")[0] for line in lines if "train/loss" in line] == ["step 4/12", "step 8/12", "step 12/12"]
    val_lines = [line for line in lines if "val/loss" in line]
    assert [line.split(":")[0] for line in val_lines] == ["step 0/12", "step 5/12", "step 10/12", "step 12/12"]
    # 12 is not a multiple of val_every: the closing validation runs inside fit and is the summary's number
    last = float(re.search(r"val/loss ([0-9.]+)", val_lines[-1]).group(1))
    assert abs(last - results["val_loss"]) < 1e-4


def test_library_noise_is_dropped(caplog):
    quiet_library_noise()
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO):
        rank_zero.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        rank_zero.info("GPU available: False, used: False")
    assert "litlogger" not in caplog.text and "GPU available" in caplog.text


def test_training_scalars_are_logged_on_logging_steps_and_the_last_only(make_cfg, tiny_overrides, tmp_path,
                                                                           monkeypatch):
    """`self.log` costs a small model's step its own length in host time: steps whose scalars no logger takes skip it.
    The last step's reach the logger even when log_every does not land on it; the run validates once there."""
    from lmlab.cli.compare import read_csv
    from lmlab.training.module import LanguageModelTask

    logged_at = []
    log = LanguageModelTask.log

    def recording(self, name, value, *args, **kwargs):
        if name == "train/grad_norm":
            logged_at.append(self.global_step + 1)
        return log(self, name, value, *args, **kwargs)

    monkeypatch.setattr(LanguageModelTask, "log", recording)
    results = train(make_cfg([*tiny_overrides, "trainer.max_steps=10", "trainer.val_every=10", "trainer.log_every=4",
                              "logger=csv"]), tmp_path / "run")
    assert logged_at == [4, 8, 10]
    assert results["train_loss"] > 0
    scalars = read_csv(next((tmp_path / "run").rglob("metrics.csv")))
    # a step's own scalars at its 0-based index (the steps taken before it), as Lightning counts
    for tag in "train/loss", "train/grad_norm", "lr", "perf/tokens_per_s":
        assert [step for step, _ in scalars[tag]] == [3, 7, 9], tag
    tokens_per_s = [value for _, value in scalars["perf/tokens_per_s"]]
    assert tokens_per_s[2] != tokens_per_s[1]  # the last window's own figure
    assert scalars["train/loss"][-1][1] == results["train_loss"]
    # validations at the steps taken: before training, and after the 10th step (Lightning wrote 9)
    assert [step for step, _ in scalars["val/loss"]] == [0, 10]
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step*.ckpt"))
    assert checkpoints == ["step000010.ckpt"]


def test_validating_after_every_step_gives_each_validation_its_own_step(make_cfg, tiny_overrides, tmp_path):
    """Lightning wrote the validation before training and the one after the first step both at step 0."""
    from lmlab.cli.compare import read_csv

    train(make_cfg([*tiny_overrides, "trainer.max_steps=3", "trainer.val_every=1", "sched.warmup_steps=1", "logger=csv"]),
          tmp_path / "run")
    scalars = read_csv(next((tmp_path / "run").rglob("metrics.csv")))
    assert [step for step, _ in scalars["val/loss"]] == [0, 1, 2, 3]
