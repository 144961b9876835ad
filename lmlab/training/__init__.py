"""Training: losses (registry), the LightningModule, the `train` entry and checkpoint helpers."""

from lmlab.training.checkpoints import load_checkpoint, save_checkpoint
from lmlab.training.losses import LOSSES
from lmlab.training.module import LanguageModelTask
from lmlab.training.run import train

__all__ = ["LOSSES", "LanguageModelTask", "load_checkpoint", "save_checkpoint", "train"]
