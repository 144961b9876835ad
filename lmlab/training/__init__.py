"""Training: losses (registry), the LightningModule and the `train` entry."""

from lmlab.training.losses import LOSSES
from lmlab.training.module import LanguageModelTask
from lmlab.training.run import train

__all__ = ["LOSSES", "LanguageModelTask", "train"]
