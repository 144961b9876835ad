"""run_hydra_app around jobs that fail or are stopped, run in this process with a stand-in job; and
lmlab-train's sweeps, whose jobs pass their checks before the first starts, with a stand-in task run."""

import signal

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from lmlab.alignment.tasks.stage import PostTraining
from lmlab.cli import train
from lmlab.cli.app import ERROR_FILE, run_hydra_app
from lmlab.errors import STOP_SIGNALS, ConfigError, RunInterrupted
from lmlab.training.checkpoints import CONFIG_KEY
from lmlab.training.tasks import Pretrain


@pytest.fixture(autouse=True)
def fresh_hydra(monkeypatch):
    monkeypatch.setattr("sys.argv", ["pytest"])  # run_hydra_app hands its argv to Hydra through sys.argv
    yield
    GlobalHydra.instance().clear()  # Hydra's app leaves itself initialized; the next compose needs it cleared


def _job_failing_at(seeds: dict[int, Exception]):
    ran = []

    def job(cfg, output_dir):
        ran.append(cfg.seed)
        if cfg.seed in seeds:
            raise seeds[cfg.seed]
        return 1.0

    return job, ran


def test_a_sweep_goes_on_after_a_failed_job_then_lists_the_failures_and_exits_1(tmp_path, capsys):
    job, ran = _job_failing_at({0: ConfigError("seed 0 is refused"), 1: RuntimeError("boom")})
    with pytest.raises(SystemExit) as ended:
        run_hydra_app("lmlab-train", "train", job, ["-m", "seed=0,1,2", f"hydra.sweep.dir={tmp_path}"])
    assert ended.value.code == 1 and ran == [0, 1, 2]
    assert (tmp_path / "0" / ERROR_FILE).read_text() == "seed 0 is refused\n"
    error = (tmp_path / "1" / ERROR_FILE).read_text().splitlines()
    assert error[0] == "RuntimeError: boom" and error[1] == "Traceback (most recent call last):"
    assert not (tmp_path / "2" / ERROR_FILE).exists()
    assert capsys.readouterr().err.splitlines()[-3:] == [
        "lmlab-train: error: 2 of 3 jobs failed (each folder has error.txt):",
        f"  {tmp_path / '0'}: seed 0 is refused",
        f"  {tmp_path / '1'}: RuntimeError: boom",
    ]


def test_a_single_run_keeps_one_line_and_exit_2_for_a_config_error(tmp_path, capsys):
    job, _ = _job_failing_at({0: ConfigError("seed 0 is refused")})
    with pytest.raises(SystemExit) as ended:
        run_hydra_app("lmlab-train", "train", job, [f"hydra.run.dir={tmp_path}"])
    assert ended.value.code == 2 and not (tmp_path / ERROR_FILE).exists()
    assert capsys.readouterr().err == "lmlab-train: error: seed 0 is refused\n"


@pytest.mark.parametrize("sweep", [False, True])
def test_an_interrupted_run_prints_how_to_resume_and_stops_the_sweep(tmp_path, capsys, sweep):
    stop = RunInterrupted("stopped by SIGTERM after step 5 of 12; resume with: lmlab-train ckpt_path=auto", 143)
    job, ran = _job_failing_at({1: stop})
    argv = ["-m", "seed=1,2", f"hydra.sweep.dir={tmp_path}"] if sweep else ["seed=1", f"hydra.run.dir={tmp_path}"]
    with pytest.raises(SystemExit) as ended:
        run_hydra_app("lmlab-train", "train", job, argv)
    assert ended.value.code == 143 and ran == [1]  # the sweep's second job never starts
    assert capsys.readouterr().err == f"{stop}\n"


@pytest.fixture
def runs(monkeypatch):
    """lmlab-train in this process, its tasks' `run` a stand-in that records the job's data.context_length
    (post-training: its task.reference); the checks are real. Returns what happened, in order."""
    events = []
    check = Pretrain.check_config

    def run(self, cfg, output_dir):
        events.append(("run", cfg.task.get("reference", cfg.data.context_length)))
        return {"val_loss": 1.0}

    def check_config(self, cfg):
        events.append(("check", cfg.data.context_length))
        check(self, cfg)

    monkeypatch.setattr(Pretrain, "run", run)
    monkeypatch.setattr(PostTraining, "run", run)
    monkeypatch.setattr(Pretrain, "check_config", check_config)
    return events


def lmlab_train(monkeypatch, *argv: str) -> int:
    monkeypatch.setattr("sys.argv", ["lmlab-train", *argv])
    try:
        train.main()
    except SystemExit as ended:
        return ended.code
    return 0


def test_a_sweep_whose_second_job_fails_its_checks_stops_before_the_first_starts(tiny_overrides, tmp_path, runs,
                                                                                   monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    code = lmlab_train(monkeypatch, "-m", *tiny_overrides, "data.context_length=16,64", f"hydra.sweep.dir={sweep}")
    assert code == 2 and runs == [("check", 16), ("check", 64)] and not sweep.exists()
    assert capsys.readouterr().err == (
        "lmlab-train: error: job #1 (data.context_length=64): data.context_length=64 is larger than "
        "model.max_seq_len=32; raise model.max_seq_len or shorten the context\n")


def test_a_valid_sweep_checks_every_job_then_runs_them_all(tiny_overrides, tmp_path, runs, monkeypatch):
    code = lmlab_train(monkeypatch, "-m", *tiny_overrides, "data.context_length=16,32",
                       f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert code == 0 and runs == [("check", 16), ("check", 32), ("run", 16), ("run", 32)]


def test_a_post_training_stages_own_check_runs_for_every_job_before_the_first(tmp_path, runs, monkeypatch, capsys):
    policy, data = tmp_path / "policy.ckpt", tmp_path / "pairs.jsonl"
    torch.save({CONFIG_KEY: {}}, policy)  # what the checks read of init_from: a checkpoint that lmlab wrote
    data.write_text("")
    argv = ["task=dpo", f"init_from={policy}", f"task.data={data}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    assert lmlab_train(monkeypatch, "-m", "task.reference=null,/missing.ckpt", *argv) == 2 and runs == []
    assert capsys.readouterr().err == ("lmlab-train: error: job #1 (task.reference=/missing.ckpt): "
                                       "task.reference=/missing.ckpt is not a file\n")
    assert lmlab_train(monkeypatch, "-m", "task.reference=null", "seed=1,2", *argv) == 0
    assert runs == [("run", None), ("run", None)]


def test_a_stop_signal_that_came_as_a_job_finished_ends_the_sweep_with_its_status(tiny_overrides, tmp_path, runs,
                                                                                   monkeypatch, capsys):
    def run_taking_sigterm_at_its_last_step(self, cfg, output_dir):
        runs.append(("run", cfg.data.context_length))
        STOP_SIGNALS.append(signal.SIGTERM)  # as GracefulStop records one it was too late to act on
        return {"val_loss": 1.0}

    monkeypatch.setattr(Pretrain, "run", run_taking_sigterm_at_its_last_step)
    code = lmlab_train(monkeypatch, "-m", *tiny_overrides, "data.context_length=16,32",
                       f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert code == 128 + signal.SIGTERM and runs[2:] == [("run", 16)]  # job #1 never started
    assert "SIGTERM received while a job finished its last step; the sweep stops before job #1" in capsys.readouterr().err
    assert lmlab_train(monkeypatch, *tiny_overrides, f"hydra.run.dir={tmp_path / 'single'}") == 0  # a single run ends
