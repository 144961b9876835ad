"""Training: losses (registry), the LightningModule, the `train` entry and checkpoint helpers."""

from lmlab.lazy import lazy_attributes
from lmlab.training.checkpoints import load_checkpoint, save_checkpoint
from lmlab.training.losses import LOSSES

# The LightningModule and the `train` entry import Lightning (seconds): a checkpoint loads without it.
__getattr__ = lazy_attributes(__name__, {"LanguageModelTask": "lmlab.training.module", "train": "lmlab.training.run"})

__all__ = ["LOSSES", "LanguageModelTask", "load_checkpoint", "save_checkpoint", "train"]
