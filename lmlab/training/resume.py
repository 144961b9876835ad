"""Resuming: `ckpt_path=auto` (continue in the run folder from its newest checkpoint) and runs that
are already finished."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig
from torch.optim.lr_scheduler import LambdaLR

from lmlab.errors import ConfigError
from lmlab.training.checkpoints import read_checkpoint
from lmlab.training.module import METRICS_KEY

log = logging.getLogger(__name__)

AUTO = "auto"


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint written last in `folder` (step checkpoints, last.ckpt, one saved on Ctrl-C)."""
    checkpoints = [p for p in folder.glob("*.ckpt") if p.is_file()]
    return max(checkpoints, key=lambda p: p.stat().st_mtime_ns) if checkpoints else None


def resolve_auto_resume(cfg: DictConfig, output_dir: Path) -> DictConfig:
    """`ckpt_path=auto`: the newest checkpoint under `output_dir/checkpoints`, or a fresh start when
    there is none, so one command both starts a run and continues it after an interruption (e.g. a
    requeued SLURM job). The run keeps writing into the same folder, so its curves stay one run."""
    if cfg.ckpt_path != AUTO:
        return cfg
    latest = latest_checkpoint(output_dir / "checkpoints")
    cfg = cfg.copy()
    cfg.ckpt_path = None if latest is None else str(latest)
    log.info("ckpt_path=auto: %s", f"resuming from {latest}" if latest else f"no checkpoint in {output_dir}, starting")
    return cfg


# What a run writes into its folder besides Hydra's own files: checkpoints and each logger's folder
RUN_OUTPUTS = ("checkpoints", "tb", "csv", "wandb", "mlruns")


def check_fresh_folder(cfg: DictConfig, output_dir: Path) -> None:
    """A new run (no ckpt_path) in a folder that holds an earlier run's checkpoints or logs would add its curves to
    that run's (two step 0s in one plot) and overwrite its checkpoints: one clear error instead, before any work."""
    if cfg.ckpt_path or rank_zero_only.rank != 0:  # ranks started by torchrun or srun: rank 0 speaks for the run
        return
    if earlier := [name for name in RUN_OUTPUTS if (output_dir / name).is_dir() and any((output_dir / name).iterdir())]:
        raise ConfigError(f"{output_dir} already holds a run ({', '.join(f'{name}/' for name in earlier)}): resume it "
                          f"with ckpt_path={AUTO}, or give this run a folder of its own (hydra.run.dir=...)")


def finished_run(ckpt_path: str, max_steps: int) -> dict[str, float] | None:
    """The saved results when the checkpoint has reached `max_steps` already (nothing to train),
    else None."""
    checkpoint = read_checkpoint(ckpt_path, "ckpt_path")  # memory-mapped: the weights are not read
    step = checkpoint.get("global_step", 0)
    if step < max_steps:
        return None
    metrics = checkpoint.get(METRICS_KEY, {})
    log.info("%s is at step %d and trainer.max_steps=%d: nothing to do (raise trainer.max_steps to train on)",
             ckpt_path, step, max_steps)
    return {"initial_val_loss": math.nan, "val_loss": metrics.get("val/loss", math.nan),
            "val_bpb": metrics.get("val/bpb", math.nan), "train_loss": metrics.get("train/loss", math.nan),
            "train_lm_loss": metrics.get("train/lm_loss", metrics.get("train/loss", math.nan)),
            "tokens_per_s": math.nan, "skipped_steps": 0}


class ScheduleFromResumedStep(L.Callback):
    """A resumed run's optimizer comes back holding the learning rates its checkpoint's schedule gave: with another
    trainer.max_steps or sched, its first step ran at the old schedule's rate (a 6-step run resumed to 12 took its
    first step at the 6-step floor, then jumped). Here each group starts at this run's schedule at the resumed step,
    as every later step is; a fresh run is unchanged (its scheduler set the same rates)."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if isinstance(scheduler, LambdaLR):
                rates = [base * rate(scheduler.last_epoch) for base, rate in zip(scheduler.base_lrs,
                                                                                 scheduler.lr_lambdas)]
                for group, lr in zip(scheduler.optimizer.param_groups, rates):
                    group["lr"] = lr
                scheduler._last_lr = rates
