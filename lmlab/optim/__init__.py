"""Optimizers and learning-rate schedules, with their registries."""

from lmlab.optim import schedules
from lmlab.optim.adafactor import Adafactor
from lmlab.optim.adam import Adam, AdamW
from lmlab.optim.composite import CompositeOptimizer
from lmlab.optim.groups import ROLES, GroupRule, describe_groups, param_groups, parameter_roles
from lmlab.optim.lion import Lion
from lmlab.optim.muon import Muon, orthogonalise
from lmlab.optim.optimizers import OPTIMIZERS
from lmlab.optim.schedules import SCHEDULERS
from lmlab.optim.sgd import SGD

__all__ = ["Adafactor", "Adam", "AdamW", "CompositeOptimizer", "GroupRule", "Lion", "Muon", "OPTIMIZERS", "ROLES",
           "SCHEDULERS", "SGD", "describe_groups", "orthogonalise", "param_groups", "parameter_roles", "schedules"]
