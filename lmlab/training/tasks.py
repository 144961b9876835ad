"""What `lmlab-train` trains (config group `task`): pre-training (the default) or a post-training stage.

An entry's `run(cfg, output_dir)` is the whole job and returns its final numbers, and its `check_config(cfg)`
the checks that lmlab-train runs on every job of a sweep before the first starts; the post-training
entries (`sft`, `dpo`, `reward_model`, `grpo`, `ppo`) live in `lmlab.alignment.tasks` and start from
the checkpoint `init_from` names.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from lmlab.errors import ConfigError
from lmlab.parallel.strategies import PARALLEL
from lmlab.registry import Registry
from lmlab.training.evaluation import check_eval
from lmlab.training.launch import launch
from lmlab.training.resume import AUTO
from lmlab.training.run import check_parallel, preflight

TASKS = Registry("task", group="task", doc="what lmlab-train trains: pre-training, or a post-training stage")


class Task:
    """Base of the entries."""

    recomputes = False  # applies the `recompute` group to its model
    casts_parameters = False  # runs its model on trainer.compute_dtype copies of the parameters

    def __init__(self, cfg=None):
        self.cfg = cfg

    def check_config(self, cfg: DictConfig) -> None:
        """The checks a user can fail that need no data, no weights and no processes, cheap enough to run on every
        job of a sweep before the first starts. `run` makes them too (a single run calls only `run`)."""

    def run(self, cfg: DictConfig, output_dir: str | Path) -> dict[str, float]:
        raise NotImplementedError


def check_applied_groups(task: Task, cfg: DictConfig) -> None:
    """Refuse a group setting that `task` would silently ignore."""
    if cfg.recompute.name != "none" and not task.recomputes:
        raise ConfigError(f"task={cfg.task.name} does not apply recompute={cfg.recompute.name}; activation "
                          "recomputation is for task=pretrain and the post-training stages (sft, dpo, reward_model, "
                          "grpo, ppo): leave recompute=none")
    if cfg.trainer.compute_dtype is not None and not task.casts_parameters:
        raise ConfigError(f"task={cfg.task.name} does not apply trainer.compute_dtype={cfg.trainer.compute_dtype}; "
                          "it is for task=pretrain: leave trainer.compute_dtype=null")


def check_single_process(cfg: DictConfig) -> None:
    """One clear error for a task that trains in one process on one device, asked for more."""
    if PARALLEL.build(cfg.parallel).distributed or cfg.trainer.devices != 1 or cfg.trainer.num_nodes != 1:
        raise ConfigError(f"task={cfg.task.name} runs in one process on one device; use parallel=single "
                          "trainer.devices=1")


@TASKS.register("pretrain")
class Pretrain(Task):
    """Next-token prediction on the `data` corpus, from scratch or from init_from's weights."""

    recomputes = True
    casts_parameters = True

    def check_config(self, cfg: DictConfig) -> None:
        if cfg.ckpt_path == AUTO:  # which checkpoint that is, if any, shows only in the job's folder
            cfg = cfg.copy()
            cfg.ckpt_path = None
        _, data_cfg = preflight(cfg)
        check_eval(cfg, check_parallel(cfg, data_cfg.batch_size))

    def run(self, cfg: DictConfig, output_dir: str | Path) -> dict[str, float]:
        return launch(cfg, output_dir)
