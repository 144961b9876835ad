"""The optim and sched entries compose in lmlab's real config tree and take command-line overrides."""

import pytest
from torch import nn

from lmlab.optim import OPTIMIZERS, SCHEDULERS


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_every_optimizer_composes(make_cfg, name):
    cfg = make_cfg([f"optim={name}"])
    assert cfg.optim.lr > 0 and len(cfg.optim.groups) >= 2
    OPTIMIZERS.build(cfg.optim, nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4)))


def test_group_rules_from_the_command_line(make_cfg):
    cfg = make_cfg(["optim=muon", "optim.groups.0.lr_mult=0.5",
                    "optim.groups.2={roles:[norm,bias],optimizer:adamw,weight_decay:0.01}"])
    opt = OPTIMIZERS.build(cfg.optim, nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    by_role = {role: g for g in opt.param_groups for role in g["roles"]}
    assert by_role["matrix"]["lr"] == pytest.approx(0.01) and by_role["norm"]["weight_decay"] == 0.01


@pytest.mark.parametrize("override", ["optim.groups.0.lr_mul=0.5", "optim.groups.0.lr_mult=fast"])
def test_a_bad_rule_field_fails_at_composition(make_cfg, override):
    with pytest.raises(Exception, match="optim.groups.0.lr_mul"):
        make_cfg(["optim=muon", override])


def test_wsd_decay_start_from_the_command_line(make_cfg):
    cfg = make_cfg(["sched=wsd", "sched.decay_start=600", "sched.decay_shape=linear", "trainer.max_steps=1000"])
    lr_at = SCHEDULERS.build(cfg.sched, 1.0, cfg.trainer.max_steps)
    assert lr_at(599) == 1.0 and lr_at(800) == pytest.approx(0.5)
