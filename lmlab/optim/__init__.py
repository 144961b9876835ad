"""Optimizers and learning-rate schedules, with their registries."""

from lmlab.optim import schedules
from lmlab.optim.adamw import AdamW
from lmlab.optim.optimizers import OPTIMIZERS, decay_groups
from lmlab.optim.schedules import SCHEDULERS

__all__ = ["AdamW", "OPTIMIZERS", "SCHEDULERS", "decay_groups", "schedules"]
