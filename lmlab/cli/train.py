"""`lmlab-train`: compose the config with Hydra and train one job (or a sweep with -m)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lmlab.cli.app import run_hydra_app
from lmlab.errors import RunInterrupted
from lmlab.training.resume import AUTO, check_fresh_folder

MAX_RUN_NAME = 200  # characters; a folder name may have 255 bytes


def swept_keys(hydra_cfg: DictConfig) -> list[str]:
    """The keys a multirun varies: the sweeps of `hydra.sweeper.params` (conf/experiment files) and of
    the command line. A job's own overrides hold one value each, so the command line's are read from
    the multirun.yaml that Hydra's sweeper saves in the sweep folder."""
    overrides = [f"{key}={value}" for key, value in (hydra_cfg.sweeper.get("params") or {}).items()]
    saved = Path(hydra_cfg.sweep.dir) / "multirun.yaml"
    if saved.is_file():
        overrides += list(OmegaConf.load(saved).hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(overrides)
    return list(dict.fromkeys(o.key_or_group for o in parsed if o.is_sweep_override()))


def sweep_run_name(hydra_cfg: DictConfig) -> str:
    """This job's values of the swept keys as a folder name, `model.norm=layernorm,model.ffn=gelu`,
    so TensorBoard and the other loggers tell a sweep's runs apart; "" for a single run."""
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return ""
    keys = swept_keys(hydra_cfg)
    values = {o.key_or_group: o.input_line.split("=", 1)[1]  # as the job's overrides.yaml has it
              for o in OverridesParser.create().parse_overrides(list(hydra_cfg.overrides.task)) if o.key_or_group in keys}
    name = ",".join(f"{key}={values[key]}" for key in keys if key in values)
    return re.sub(r"[^\w.,=+-]", "_", name.replace("/", "."))[:MAX_RUN_NAME]


def resume_command(hydra_cfg: DictConfig, output_dir: str) -> str:
    """The command that continues this job in its own folder from its newest checkpoint."""
    kept = [o for o in hydra_cfg.overrides.task if not o.lstrip("+~").startswith(("ckpt_path=", "init_from="))]
    args = [*kept, f"ckpt_path={AUTO}", f"hydra.run.dir={output_dir}"]
    return "lmlab-train " + " ".join(shlex.quote(a) for a in args)


def _train(cfg: DictConfig, output_dir: str) -> float:
    from lmlab.training.loggers import check_installed

    check_installed(cfg.logger)
    check_fresh_folder(cfg, Path(output_dir))
    task = _task(cfg)
    hydra_cfg = HydraConfig.get()
    if not cfg.logger.run_name:  # here: Hydra's state is gone in the processes a parallel run spawns
        cfg.logger.run_name = sweep_run_name(hydra_cfg)
    try:
        return task.run(cfg, output_dir)["val_loss"]
    except RunInterrupted as stopped:
        raise RunInterrupted(f"{stopped}\nresume with:\n  {resume_command(hydra_cfg, output_dir)}",
                             stopped.exit_code) from None


def check_job(cfg: DictConfig) -> None:
    """What every job of a sweep must pass before the first starts: its logger installed, its task's checks."""
    from lmlab.training.loggers import check_installed

    check_installed(cfg.logger)
    _task(cfg).check_config(cfg)


def _task(cfg: DictConfig):
    """The job's `task` entry, refusing the group settings it would ignore."""
    from lmlab.training.tasks import TASKS, check_applied_groups

    task = TASKS.build(cfg.task)
    check_applied_groups(task, cfg)
    return task


def main() -> None:
    run_hydra_app("lmlab-train", "train", _train, sys.argv[1:], check_job)


if __name__ == "__main__":
    main()
