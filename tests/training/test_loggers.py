"""The `logger` group: each entry's Lightning logger and paths, no `epoch` scalar, sweep run names."""

import importlib.util
from pathlib import Path

import pytest
from hydra.types import RunMode
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lmlab.cli.compare import read_csv, read_mlflow
from lmlab.cli.train import sweep_run_name
from lmlab.errors import ConfigError
from lmlab.training import loggers, train
from lmlab.training.loggers import LOGGERS, RunLogger, build_logger, check_installed


def installed(package: str):
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"needs {package} (lmlab[loggers])")


@pytest.mark.parametrize("run_name, folder", [("", "tb"), ("model.norm=layernorm", "tb/model.norm=layernorm")])
def test_tensorboard_writes_into_the_run_folder(tmp_path, run_name, folder):
    logger = build_logger({"name": "tensorboard", "run_name": run_name}, tmp_path)
    assert isinstance(logger, TensorBoardLogger) and isinstance(logger, RunLogger)
    assert Path(logger.log_dir) == tmp_path / folder


def test_csv_writes_into_the_run_folder_and_keeps_a_resumed_runs_rows(tmp_path):
    first = build_logger({"name": "csv", "run_name": "a=1"}, tmp_path)
    assert isinstance(first, CSVLogger) and Path(first.log_dir) == tmp_path / "csv" / "a=1"
    first.log_metrics({"train/loss": 2.0, "epoch": 0}, step=10)
    first.save()
    resumed = build_logger({"name": "csv", "run_name": "a=1"}, tmp_path)  # ckpt_path=auto: the same folder
    resumed.log_metrics({"train/loss": 1.5, "val/loss": 1.7, "epoch": 0}, step=20)
    resumed.save()
    assert read_csv(tmp_path / "csv" / "a=1" / "metrics.csv") == {"train/loss": [(10, 2.0), (20, 1.5)],
                                                                  "val/loss": [(20, 1.7)]}


@installed("wandb")
def test_wandb_is_configured_from_its_fields(tmp_path):
    cfg = {"name": "wandb", "run_name": "model.norm=layernorm", "project": "p", "group": "g", "offline": True}
    logger = build_logger(cfg, tmp_path)
    assert isinstance(logger, WandbLogger) and logger.save_dir == str(tmp_path)
    assert (logger.name, logger._wandb_init["group"]) == ("p", "g")  # Lightning's name is the project
    assert logger._wandb_init["name"] == "model.norm=layernorm"


@installed("mlflow")
def test_mlflow_defaults_to_a_file_store_inside_the_run(tmp_path):
    logger = build_logger({"name": "mlflow", "run_name": "x=1"}, tmp_path)
    assert isinstance(logger, MLFlowLogger)
    assert Path(logger.save_dir) == (tmp_path / "mlruns").resolve() and logger._run_name == "x=1"


def test_a_missing_optional_package_is_one_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match=r"^logger=wandb needs the wandb package: pip install 'lmlab\[loggers\]'$"):
        check_installed("wandb")
    check_installed("tensorboard")
    assert set(LOGGERS.names()) == {"csv", "mlflow", "tensorboard", "wandb"}


def test_no_epoch_scalar_and_the_final_numbers_in_tensorboard(make_cfg, tiny_overrides, tmp_path):
    train(make_cfg([*tiny_overrides, "trainer.max_steps=10", "trainer.val_every=5"]), tmp_path)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "val/loss", "hp/val_loss"} <= tags and "epoch" not in tags
    assert events.PluginTagToContent("hparams")  # the HParams tab has the run


def _hydra(tmp_path: Path, mode: RunMode, task: list[str], command_line: list[str], params: dict):
    OmegaConf.save({"hydra": {"overrides": {"task": command_line}}}, tmp_path / "multirun.yaml")
    return OmegaConf.create({"mode": mode, "sweep": {"dir": str(tmp_path)}, "sweeper": {"params": params},
                             "overrides": {"task": task}})


def test_a_sweep_job_is_named_by_the_values_of_the_swept_keys(tmp_path):
    params = {"model/ffn": "swiglu,gelu", "model/position": "rope"}  # one value: not swept
    command_line = ["model/norm=rmsnorm,layernorm", "trainer.max_steps=30", "+data.path=a/x:1,b"]
    job = ["model/ffn=gelu", "model/position=rope", "model/norm=layernorm", "trainer.max_steps=30", "+data.path=a/x:1"]
    hydra = _hydra(tmp_path, RunMode.MULTIRUN, job, command_line, params)
    assert sweep_run_name(hydra) == "model.ffn=gelu,model.norm=layernorm,data.path=a.x_1"  # a folder name
    assert sweep_run_name(_hydra(tmp_path, RunMode.RUN, job, command_line, params)) == ""


@pytest.mark.slow
@installed("wandb")
def test_wandb_offline_run_is_written_and_closed(make_cfg, tiny_overrides, tmp_path):
    import wandb

    train(make_cfg([*tiny_overrides, "logger=wandb", "logger.offline=true", "trainer.max_steps=5"]), tmp_path)
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert wandb.run is None  # closed: the next job of a multirun starts its own run


@pytest.mark.slow
@installed("mlflow")
def test_mlflow_run_is_readable_by_lmlab_compare(make_cfg, tiny_overrides, tmp_path):
    results = train(make_cfg([*tiny_overrides, "logger=mlflow", "trainer.max_steps=5"]), tmp_path)
    (metrics,) = (tmp_path / "mlruns").glob("*/*/metrics")
    scalars = read_mlflow(metrics)
    assert "epoch" not in scalars and scalars["val/loss"][-1][1] == pytest.approx(results["val_loss"])
    assert scalars["hp/val_loss"] == [(5, pytest.approx(results["val_loss"]))]
