"""Bad optimizer arguments fail at construction with a ValueError that says what was wrong."""

import pytest
import torch
from torch import nn

from lmlab.optim import OPTIMIZERS, SGD, Adafactor, Adam, AdamW, Lion, Muon

BAD = [
    (AdamW, {"lr": 0.0}, "learning rate must be > 0"),
    (AdamW, {"lr": -1.0}, "learning rate must be > 0"),
    (AdamW, {"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\)"),
    (AdamW, {"betas": (-0.1, 0.9)}, "betas"),
    (AdamW, {"weight_decay": -0.1}, "weight_decay must be >= 0"),
    (Adam, {"lr": -1.0}, "Adam: learning rate"),
    (Adam, {"betas": (1.5, 0.9)}, "betas"),
    (Adam, {"eps": -1.0}, "eps must be >= 0"),
    (SGD, {"lr": 0.0}, "learning rate"),
    (SGD, {"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
    (SGD, {"nesterov": True}, "nesterov needs momentum"),
    (Lion, {"lr": -1e-4}, "learning rate"),
    (Lion, {"betas": (0.9, 1.0)}, "betas"),
    (Muon, {"lr": 0.0}, "learning rate"),
    (Muon, {"momentum": -0.5}, "momentum"),
    (Muon, {"ns_steps": 0}, "ns_steps must be >= 1"),
    (Adafactor, {"lr": 0.0}, "learning rate"),
    (Adafactor, {"beta2_decay": 0.5}, "beta2_decay must be <= 0"),
    (Adafactor, {"d": 0.5}, "clipping threshold d must be >= 1"),
    (Adafactor, {"eps": (None, -1.0)}, "eps2 must be >= 0"),
]


@pytest.mark.parametrize("cls,kwargs,match", BAD, ids=lambda v: getattr(v, "__name__", None))
def test_constructor_rejects(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.zeros(2, 2, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_every_entry_rejects_a_non_positive_learning_rate(name):
    for lr in (0.0, -1.0):
        with pytest.raises(ValueError, match="learning rate must be > 0"):
            OPTIMIZERS.build({"name": name, "lr": lr}, nn.Linear(2, 2))


def test_entry_weight_decay_and_muons_adamw_part_are_checked():
    with pytest.raises(ValueError, match="optim.weight_decay must be >= 0"):
        OPTIMIZERS.build({"name": "lion", "weight_decay": -1.0}, nn.Linear(2, 2))
    with pytest.raises(ValueError, match="AdamW: learning rate"):
        OPTIMIZERS.build({"name": "muon", "adamw_lr": 0.0}, nn.Linear(2, 2))
    with pytest.raises(ValueError, match="betas"):
        OPTIMIZERS.build({"name": "muon", "adamw_betas": [0.9, 1.0]}, nn.Linear(2, 2))
