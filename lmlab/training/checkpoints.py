"""Reading the checkpoints lmlab-train writes (Lightning's format plus the run's resolved config)."""

from __future__ import annotations

from pathlib import Path

import torch

from lmlab.errors import ConfigError

CONFIG_KEY = "lmlab_config"  # where checkpoints keep the run's resolved config
MODEL_PREFIX = "model."  # the LightningModule's attribute holding the Transformer


def read_checkpoint(path: str | Path, setting: str) -> dict:
    """The checkpoint at `path`, named by the `setting` that gave it; one clear error if it is not
    a file or was not written by lmlab-train."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{setting}={path} is not a file")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if CONFIG_KEY not in checkpoint:
        raise ConfigError(f"{path} was not written by lmlab-train (it has no '{CONFIG_KEY}')")
    return checkpoint


def model_weights(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The Transformer's state dict inside a checkpoint's `state_dict`."""
    return {k.removeprefix(MODEL_PREFIX): v for k, v in checkpoint["state_dict"].items() if k.startswith(MODEL_PREFIX)}


def with_model_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Transformer's state dict as a checkpoint's `state_dict`, which `init_from` reads."""
    return {MODEL_PREFIX + k: v for k, v in state.items()}
