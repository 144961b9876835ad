"""`lmlab-train eval=[...] trainer.eval_every=N`: the tasks run every N steps and at the end, log
eval/<task>/<metric>, leave the model training, and show as lmlab-compare columns; bad settings and
a sharding strategy fail before training."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lmlab.cli.compare import main as compare, read_csv
from lmlab.cli.compose import check_jobs
from lmlab.cli.train import check_job
from lmlab.errors import ConfigError
from lmlab.parallel.strategies import PARALLEL
from lmlab.training import train
from lmlab.training.evaluation import eval_tasks
from lmlab.training.launch import launch

MMLU = Path(__file__).parents[1] / "eval" / "fixtures" / "mmlu"
EVAL = ["eval=[mmlu]", f"eval.mmlu.path={MMLU}", "eval.mmlu.shots=0", "eval.limit=2"]


def test_tasks_run_every_n_steps_and_show_in_compare(make_cfg, tiny_overrides, tmp_path, capsys):
    run = tmp_path / "sweep" / "0"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(["eval=[mmlu]"], run / ".hydra" / "overrides.yaml")
    train(make_cfg([*tiny_overrides, *EVAL, "logger=csv", "trainer.max_steps=5", "trainer.eval_every=2",
                    "trainer.val_every=5"]), run)
    scalars = read_csv(next(run.rglob("metrics.csv")))
    assert [step for step, _ in scalars["eval/mmlu/acc"]] == [2, 4, 5]  # every 2 steps, and the last
    assert all(0 <= value <= 1 for _, value in scalars["eval/mmlu/acc_micro"])
    assert compare([str(tmp_path / "sweep")]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "eval/mmlu/acc" in header and "eval/mmlu/acc_micro" in header


def test_bad_eval_settings_fail_before_training(make_cfg, tiny_overrides, tmp_path):
    with pytest.raises(ConfigError, match="eval.mmlu.path"):
        train(make_cfg([*tiny_overrides, "eval=[mmlu]"]), tmp_path)
    assert not (tmp_path / "checkpoints").exists()
    with pytest.raises(ConfigError, match="leaves no room"):  # TINY's context is 32 tokens
        train(make_cfg([*tiny_overrides, "eval=[mmlu_generative]", f"eval.mmlu_generative.path={MMLU}"]), tmp_path)


def test_a_sweeps_eval_settings_are_checked_on_every_job_before_the_first_starts(tiny_overrides):
    # from the settings alone (no question read): job 1's 32-token context has no room for 32 new tokens
    sweep = ["-m", *tiny_overrides, "eval=[mmlu_generative]", f"eval.mmlu_generative.path={MMLU}",
             "data.context_length=16", "model.max_seq_len=64,32"]
    with pytest.raises(ConfigError, match=r"^job #1 \(model.max_seq_len=32\): eval.mmlu_generative.max_new_tokens=32 "
                                          "leaves no room"):
        check_jobs(sweep, check_job=check_job)
    # a data folder that is not there, from a look at the folder
    with pytest.raises(ConfigError, match=r"^job #1 \(eval.mmlu.path=/no/such/folder\): MMLU folder /no/such/folder "
                                          "does not exist"):
        check_jobs(["-m", *tiny_overrides, *EVAL[:1], *EVAL[2:], f"eval.mmlu.path={MMLU},/no/such/folder"],
                   check_job=check_job)
    with pytest.raises(ConfigError, match=r"^job #1 \(eval.limit=0\): eval.limit must be > 0"):
        check_jobs(["-m", *tiny_overrides, *EVAL[:3], "eval.limit=1,0"], check_job=check_job)


def test_a_distributed_job_checks_its_eval_tasks_before_any_process_starts(make_cfg, tiny_overrides, tmp_path):
    with pytest.raises(ConfigError, match="eval.mmlu.path"):
        launch(make_cfg([*tiny_overrides, "eval=[mmlu]", "parallel=ddp", "trainer.devices=2"]), tmp_path / "run")
    with pytest.raises(ConfigError, match="parallel=zero3 shards its parameters"):
        launch(make_cfg([*tiny_overrides, *EVAL, "parallel=zero3", "trainer.devices=2"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_strategy_that_shards_the_weights_is_refused(make_cfg, tiny_overrides):
    cfg = make_cfg([*tiny_overrides, *EVAL, "parallel=fsdp"])
    with pytest.raises(ConfigError, match="parallel=fsdp shards its parameters"):
        eval_tasks(cfg, PARALLEL.build(cfg.parallel))
    assert eval_tasks(make_cfg(tiny_overrides), PARALLEL.build(cfg.parallel)) == ([], None)  # no task: nothing to check
