"""Where a run's scalars and hyperparameters go (config group `logger`): Lightning's own loggers.

    lmlab-train logger=csv
    lmlab-train logger=wandb logger.project=ablations logger.offline=true
    lmlab-train logger=mlflow logger.tracking_uri=http://mlflow.internal:5000

Every entry writes inside the run folder unless pointed elsewhere, drops the `epoch` scalar
that Lightning adds to each write (lmlab counts steps; the epoch is always 0), and ends a
finished run with `finish`: the whole config with the final numbers. wandb and mlflow are
optional packages (`pip install 'lmlab[loggers]'`).

The x-axis is the number of optimizer steps the model had taken when the scalar was measured: a
step's training scalars (its loss, computed before its update, and its learning rate) at its 0-based
index, as Lightning writes them, and a validation or evaluation after N steps at N (`ValidationStep`),
so the validation before training sits at 0 and the one after the first step at 1.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from lmlab.errors import ConfigError
from lmlab.registry import Registry

LOGGERS = Registry("logger", group="logger", doc="where a run's scalars and hyperparameters go (Lightning loggers)")


def final_scalars(trainer: L.Trainer) -> dict[str, float]:
    """The run's latest scalars (callback_metrics): what a run reports, what its checkpoint keeps, and its row in
    TensorBoard's HParams tab."""
    return {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}


class ValidationStep(L.Callback):
    """Validation scalars at the steps taken (global_step). Lightning writes them at the 0-based index of the last
    step: the validation before training and the one after the first step both landed at 0, and one after 10 steps
    at 9 while the progress line, the checkpoint's name and the eval tasks said 10. Lightning's own override, a
    logged `step` scalar, would also name the checkpoints (ModelCheckpoint formats `step` from the logged scalars),
    so each `RunLogger` is told the step of the validation's write instead."""

    def on_validation_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._tell(trainer, trainer.global_step)  # before Lightning writes the scalars this validation logged

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._tell(trainer, None)

    @staticmethod
    def _tell(trainer: L.Trainer, step: int | None) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, RunLogger):
                logger.validation_step = step


@dataclass
class LoggerConfig:
    """Fields every logger entry has; a plugin logger's Config subclasses this."""

    run_name: str = ""  # tb/<run_name>, csv/<run_name> or the wandb/mlflow run; a multirun sets its swept overrides
    package: ClassVar[str | None] = None  # the optional package the entry needs


class RunLogger(Logger):
    """What lmlab adds to each Lightning logger it builds (a mixin, listed before the logger class)."""

    validation_step: int | None = None  # set by ValidationStep while a validation's scalars are written

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        step = step if self.validation_step is None else self.validation_step
        super().log_metrics({k: v for k, v in metrics.items() if k != "epoch"}, step)

    @rank_zero_only
    def finish(self, config: dict[str, Any], results: dict[str, float], step: int) -> None:
        """Record a finished run's whole config with its final numbers, then close the run."""
        self.log_hyperparams(config)
        self.log_metrics(results, step)
        self.finalize("success")


class TensorBoard(RunLogger, TensorBoardLogger):
    @rank_zero_only
    def finish(self, config: dict[str, Any], results: dict[str, float], step: int) -> None:
        # Together, so the HParams tab pairs the config with the final numbers, one row per run.
        self.log_hyperparams(config, results)
        self.finalize("success")


class CSV(RunLogger, CSVLogger):
    @property
    @rank_zero_experiment
    def experiment(self):
        """Lightning's writer deletes a metrics.csv it finds; a run resumed in its own folder keeps its rows."""
        if self._experiment is None:
            earlier = Path(self.log_dir) / "metrics.csv"
            rows = list(csv.DictReader(earlier.read_text().splitlines())) if earlier.is_file() else []
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Experiment logs directory")  # "will be deleted": not so
                writer = super().experiment
            writer.metrics = [{k: v for k, v in row.items() if v != ""} for row in rows]  # saved with the next rows
        return self._experiment


class Wandb(RunLogger, WandbLogger):
    """Closes its wandb run, which Lightning leaves open: the next job of a multirun would log into it."""

    @rank_zero_only
    def finish(self, config: dict[str, Any], results: dict[str, float], step: int) -> None:
        super().finish(config, results, step)
        self.experiment.finish()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if status == "failed" and self._experiment is not None:
            self._experiment.finish(exit_code=1)


class MLflow(RunLogger, MLFlowLogger):
    pass


@dataclass
class TensorBoardConfig(LoggerConfig):
    pass


@LOGGERS.register("tensorboard", TensorBoardConfig)
def tensorboard_logger(output_dir: Path, cfg: TensorBoardConfig) -> TensorBoard:
    """TensorBoard event files in <run>/tb/ (or tb/<run_name>/): `tensorboard --logdir outputs`."""
    return TensorBoard(str(output_dir), name="tb", version=cfg.run_name, default_hp_metric=False)


@dataclass
class CSVConfig(LoggerConfig):
    pass


@LOGGERS.register("csv", CSVConfig)
def csv_logger(output_dir: Path, cfg: CSVConfig) -> CSV:
    """One metrics.csv per run in <run>/csv/ (or csv/<run_name>/), plus hparams.yaml."""
    return CSV(str(output_dir), name="csv", version=cfg.run_name)


@dataclass
class WandbConfig(LoggerConfig):
    project: str = "lmlab"
    entity: str | None = None  # team or user; None: the logged-in user's default
    group: str | None = None  # groups runs in the UI, e.g. one sweep
    tags: list[str] = field(default_factory=list)
    offline: bool = False  # write <run>/wandb/ only; `wandb sync` uploads it later
    package: ClassVar[str | None] = "wandb"


@LOGGERS.register("wandb", WandbConfig)
def wandb_logger(output_dir: Path, cfg: WandbConfig) -> Wandb:
    """Weights & Biases; its local files go to <run>/wandb/."""
    return Wandb(name=cfg.run_name or None, save_dir=str(output_dir), project=cfg.project, entity=cfg.entity,
                 group=cfg.group, tags=list(cfg.tags), offline=cfg.offline)


@dataclass
class MLflowConfig(LoggerConfig):
    experiment_name: str = "lmlab"
    tracking_uri: str | None = None  # a server (http://...) or store; None: a file store in <run>/mlruns
    package: ClassVar[str | None] = "mlflow"


@LOGGERS.register("mlflow", MLflowConfig)
def mlflow_logger(output_dir: Path, cfg: MLflowConfig) -> MLflow:
    """MLflow: a file store in <run>/mlruns, or the server or store at `tracking_uri`."""
    tracking_uri = cfg.tracking_uri
    if tracking_uri is None:
        tracking_uri = f"file:{(output_dir / 'mlruns').resolve()}"
        # MLflow 3 refuses file stores unless asked: a store inside the run needs no database or server.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MLflow(experiment_name=cfg.experiment_name, run_name=cfg.run_name or None, tracking_uri=tracking_uri)


def check_installed(cfg: DictConfig | Mapping | str) -> None:
    """Fail before any work when the selected logger's optional package is missing."""
    entry, config = LOGGERS.resolve(cfg)
    if config.package and importlib.util.find_spec(config.package) is None:
        raise ConfigError(f"logger={entry.name} needs the {config.package} package: pip install 'lmlab[loggers]'")


def build_logger(cfg: DictConfig | Mapping | str, output_dir: str | Path) -> RunLogger:
    check_installed(cfg)
    return LOGGERS.build(cfg, Path(output_dir))
