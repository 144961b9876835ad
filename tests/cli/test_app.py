"""run_hydra_app around jobs that fail or are stopped, run in this process with a stand-in job."""

import pytest
from hydra.core.global_hydra import GlobalHydra

from lmlab.cli.app import ERROR_FILE, run_hydra_app
from lmlab.errors import ConfigError, RunInterrupted


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
