"""What every Hydra console script of lmlab does around its job.

Before Hydra composes the config: check the config tree is there, import the built-in parts
and the plugins, and check each `GROUP=NAME` so a misspelt name gets the closest match. While
the job runs: turn a `ConfigError` into one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lmlab.cli.overrides import CONF_DIR, prepare
from lmlab.errors import ConfigError


def fail(prog: str, err: Exception) -> None:
    print(f"{prog}: error: {err}", file=sys.stderr)
    raise SystemExit(2)


def run_hydra_app(prog: str, config_name: str, job: Callable[[DictConfig, str], object], argv: list[str]) -> None:
    """Run `job(cfg, output_dir)` for each job Hydra composes from `argv` (one, or a sweep with -m)."""
    if not (CONF_DIR / f"{config_name}.yaml").is_file():
        fail(prog, ConfigError(f"no config tree at {CONF_DIR}; install lmlab from its checkout with `pip install -e .`"))
    try:
        prepare(argv, config_name)
    except ConfigError as err:
        fail(prog, err)

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")
    def _job(cfg: DictConfig):
        try:
            return job(cfg, HydraConfig.get().runtime.output_dir)
        except ConfigError as err:
            fail(prog, err)

    sys.argv = [prog, *argv]
    _job()
