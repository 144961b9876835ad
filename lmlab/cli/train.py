"""`lmlab-train`: compose the config with Hydra and train one job (or a sweep with -m)."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from lmlab.cli.app import run_hydra_app


def _train(cfg: DictConfig, output_dir: str) -> float:
    from lmlab.training.launch import launch

    return launch(cfg, output_dir)["val_loss"]


def main() -> None:
    run_hydra_app("lmlab-train", "train", _train, sys.argv[1:])


if __name__ == "__main__":
    main()
