"""`lmlab-train`: compose the config with Hydra and train one job (or a sweep with -m)."""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lmlab.catalog import load_catalog
from lmlab.cli.overrides import CONF_DIR, check_choices, parse, plugin_modules
from lmlab.errors import ConfigError


def _fail(err: ConfigError) -> None:
    print(f"lmlab-train: error: {err}", file=sys.stderr)
    raise SystemExit(2)


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def _job(cfg: DictConfig) -> float:
    from lmlab.training.run import train

    try:
        return train(cfg, HydraConfig.get().runtime.output_dir)["val_loss"]
    except ConfigError as err:
        _fail(err)


def main() -> None:
    if not (CONF_DIR / "train.yaml").is_file():
        _fail(ConfigError(f"no config tree at {CONF_DIR}; install lmlab from its checkout with `pip install -e .`"))
    try:
        overrides = parse(sys.argv[1:])
        load_catalog(plugin_modules(overrides))
        check_choices(overrides)
    except ConfigError as err:
        _fail(err)
    _job()


if __name__ == "__main__":
    main()
