"""Checkpoints: reading the ones lmlab-train writes (Lightning's format plus the run's resolved
config and its tokenizer), `load` to use one outside the trainer, and the plain
`save_checkpoint` / `load_checkpoint` (the Stanford CS336 shape) for any training loop."""

from __future__ import annotations

import logging
import os
import zipfile
from pathlib import Path
from typing import IO

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lmlab.atomic import atomic_write
from lmlab.catalog import load_catalog
from lmlab.data import SOURCES
from lmlab.errors import ConfigError
from lmlab.nn.transformer import Transformer
from lmlab.tokenizers import TOKENIZERS
from lmlab.tokenizers.base import Tokenizer, unpack_tokenizer

log = logging.getLogger(__name__)

CONFIG_KEY = "lmlab_config"  # where checkpoints keep the run's resolved config
TOKENIZER_KEY = "lmlab_tokenizer"  # and its tokenizer (`pack_tokenizer`), so its token ids travel with the weights
MODEL_PREFIX = "model."  # the LightningModule's attribute holding the Transformer

PathOrFile = str | os.PathLike | IO[bytes]


def _torch_load(src: PathOrFile, name: str, **kwargs) -> dict:
    """torch.load on the CPU; a file torch cannot read (truncated, not a checkpoint) is one ConfigError line."""
    try:
        return torch.load(src, map_location="cpu", **kwargs)
    except Exception as err:  # noqa: BLE001 - torch fails with many types (zip, pickle, EOF) on a bad file
        reason = (str(err).strip().splitlines() or [""])[0]
        raise ConfigError(f"{name} cannot be read as a checkpoint ({type(err).__name__}: {reason})") from None


def read_checkpoint(path: str | Path, setting: str) -> dict:
    """The checkpoint at `path`, named by the `setting` that gave it; one clear error if it is not
    a file, cannot be read or was not written by lmlab-train. Memory-mapped: reading it again is cheap."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{setting}={path} is not a file")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive, whose index comes last
        raise ConfigError(f"{setting}={path} cannot be read as a checkpoint: it is not a whole file written by "
                          "torch.save (truncated, or another format)")
    checkpoint = _torch_load(path, f"{setting}={path}", mmap=True, weights_only=False)
    if not isinstance(checkpoint, dict) or CONFIG_KEY not in checkpoint:
        raise ConfigError(f"{path} was not written by lmlab-train (it has no '{CONFIG_KEY}')")
    return checkpoint


def model_weights(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The Transformer's state dict inside a checkpoint's `state_dict`."""
    return {k.removeprefix(MODEL_PREFIX): v for k, v in checkpoint["state_dict"].items() if k.startswith(MODEL_PREFIX)}


def with_model_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Transformer's state dict as a checkpoint's `state_dict`, which `init_from` reads."""
    return {MODEL_PREFIX + k: v for k, v in state.items()}


def checkpoint_tokenizer(checkpoint: dict, path: str | Path) -> Tokenizer | None:
    """The tokenizer saved in the checkpoint; None, with a warning, for one written before
    checkpoints held their tokenizer (the caller then builds one from the tokenizer settings)."""
    packed = checkpoint.get(TOKENIZER_KEY)
    if packed is None:
        log.warning("%s holds no tokenizer (written before lmlab saved it in checkpoints): the tokenizer comes from "
                    "the tokenizer settings, and its ids match the weights only if it is the one they were trained "
                    "with (the same tokenizer.path, or trained on the same data)", path)
        return None
    return unpack_tokenizer(packed, str(path))


def load(ckpt_path: str | Path, device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer, DictConfig]:
    """The Transformer (weights loaded, eval mode, on `device`), its tokenizer and the run's
    resolved config (an OmegaConf DictConfig) from a checkpoint lmlab-train wrote.

    The model is the plain PyTorch one: kernels the run selected (`kernels=triton`) are not installed.
    """
    checkpoint = read_checkpoint(ckpt_path, "ckpt")
    config = OmegaConf.create(checkpoint[CONFIG_KEY])
    load_catalog(config.get("plugins") or [])  # the run's plugin parts (a norm, a tokenizer class) register
    tokenizer = checkpoint_tokenizer(checkpoint, ckpt_path) or TOKENIZERS.build(
        config.tokenizer, SOURCES.build(config.data), config.cache_dir, False)
    weights = model_weights(checkpoint)
    model = Transformer(config.model, weights["embed_tokens.weight"].shape[0])  # the (padded) trained vocabulary
    model.load_state_dict(weights)
    return model.to(device).eval(), tokenizer, config


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, iteration: int, out: PathOrFile) -> None:
    """Save the model's and the optimizer's state and the iteration to `out`, a path (written
    atomically) or a binary file-like object; `load_checkpoint` restores them."""
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iteration": iteration}
    if isinstance(out, (str, os.PathLike)):
        atomic_write(out, lambda tmp: torch.save(payload, tmp))
    else:
        torch.save(payload, out)


def load_checkpoint(src: PathOrFile, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore the model and optimizer that `save_checkpoint` saved to `src` (a path or a binary
    file-like object); returns the saved iteration."""
    name = str(src) if isinstance(src, (str, os.PathLike)) else "the checkpoint file object"
    checkpoint = _torch_load(src, name, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint["iteration"]
