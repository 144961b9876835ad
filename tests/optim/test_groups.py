"""Parameter roles, group rules (and their errors), muP multipliers, and the start-up table."""

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lmlab.errors import ConfigError
from lmlab.nn import ModelConfig, Transformer
from lmlab.optim import OPTIMIZERS, GroupRule, describe_groups, parameter_roles


def transformer(tie=False, init="gpt2"):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=16, norm="layernorm", ffn={"name": "swiglu", "d_ff": 64},
                      position="rope", attention={"name": "mha", "n_heads": 2}, block="prenorm", init=init,
                      vocab_size=64, tie_embeddings=tie)
    return Transformer(cfg, 64)


class MoELayer(nn.Module):
    """Experts stored as one (n_experts, out, in) tensor, experts as Linears, and a router Linear."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.Module()
        self.experts.gate_proj = nn.Parameter(torch.zeros(4, 16, 8))
        self.shared = nn.ModuleDict({"experts": nn.ModuleList([nn.Linear(8, 8)])})


def test_roles_of_a_transformer():
    roles = {name: role for name, (role, _) in parameter_roles(transformer()).items()}
    assert roles["embed_tokens.weight"] == "embedding" and roles["lm_head.weight"] == "head"
    assert roles["layers.0.self_attn.q_proj.weight"] == "matrix" and roles["layers.1.mlp.down_proj.weight"] == "matrix"
    assert roles["layers.0.input_layernorm.weight"] == "norm" and roles["norm.weight"] == "norm"
    assert roles["norm.bias"] == "bias"


def test_a_tied_head_counts_once_as_the_embedding():
    roles = {name: role for name, (role, _) in parameter_roles(transformer(tie=True)).items()}
    assert roles["embed_tokens.weight"] == "embedding" and "lm_head.weight" not in roles
    assert "head" not in roles.values()


def test_roles_of_moe_weights():
    roles = {name: role for name, (role, _) in parameter_roles(MoELayer()).items()}
    assert roles == {"gate.weight": "matrix", "experts.gate_proj": "expert",
                     "shared.experts.0.weight": "expert", "shared.experts.0.bias": "bias"}


def test_registered_adamw_decays_matrices_only():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = OPTIMIZERS.build({"name": "adamw", "lr": 1e-3, "weight_decay": 0.2}, model)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.2 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


def test_rules_set_optimizer_lr_and_decay_and_mup_multiplies_on_top():
    model = transformer(init={"name": "mup", "base_d_model": 16})  # hidden matrices: lr multiplier 1/2
    rules = [{"roles": ["matrix"], "optimizer": "muon", "lr_mult": 0.5},
             {"roles": ["embedding", "head"], "optimizer": "adamw", "weight_decay": 0.05},
             {"roles": ["norm", "bias"], "optimizer": "adamw", "lr_mult": 2.0, "weight_decay": 0.0}]
    opt = OPTIMIZERS.build({"name": "muon", "lr": 0.02, "adamw_lr": 1e-3, "weight_decay": 0.1, "groups": rules}, model)
    by_role = {role: g for g in opt.param_groups for role in g["roles"]}
    assert by_role["matrix"]["lr"] == pytest.approx(0.02 * 0.5 * 0.5) and by_role["matrix"]["weight_decay"] == 0.1
    assert by_role["embedding"]["lr"] == pytest.approx(1e-3) and by_role["head"]["weight_decay"] == 0.05
    assert by_role["norm"]["lr"] == pytest.approx(2e-3) and by_role["bias"]["optimizer"] == "adamw"
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_rules_for_absent_roles_are_fine():
    opt = OPTIMIZERS.build("muon", nn.Linear(1, 1))  # no embedding, head, norm or expert
    assert [g["roles"] for g in opt.param_groups] == [["matrix"], ["bias"]]


@pytest.mark.parametrize("groups,match", [
    ([{"roles": ["matrix", "embeding"]}], "Did you mean 'embedding'"),
    ([{"roles": []}], "lists no roles"),
    ([{"roles": ["matrix", "bias"]}, {"roles": ["bias"]}], r"'bias' is in optim.groups\[0\] and optim.groups\[1\]"),
    ([{"roles": ["matrix"]}], r"no group in optim.groups matches 0.bias \(bias\)"),
    ([{"roles": ["matrix", "bias"], "optimizer": "muon"}], "Available: adamw"),
    ([{"roles": ["matrix", "bias"], "lr_mult": 0.0}], "lr_mult must be > 0"),
    ([{"roles": ["matrix", "bias"], "weight_decay": -0.1}], "weight_decay must be >= 0"),
])
def test_bad_rules_are_config_errors(groups, match):
    with pytest.raises(ConfigError, match=match):
        OPTIMIZERS.build({"name": "adamw", "groups": groups}, nn.Sequential(nn.Linear(4, 4)))


def test_describe_groups_counts_tensors_and_parameters():
    model = transformer()
    opt = OPTIMIZERS.build("muon", model)
    LambdaLR(opt, lambda step: 0.0)  # warmup sets every lr to 0; the table still shows the peak
    lines = describe_groups(opt).splitlines()
    assert lines[0].split() == ["group", "optimizer", "roles", "lr", "weight_decay", "tensors", "parameters"]
    assert lines[1].split()[:4] == ["0", "muon", "matrix", "0.02"]
    assert lines[2].split()[:4] == ["1", "adamw", "embedding,head", "0.003"]
    n_matrices = sum(1 for m in model.modules() if isinstance(m, nn.Linear)) - 1  # all but lm_head
    assert lines[1].split()[5] == str(n_matrices)
    assert lines[-1].split() == ["total", str(len(list(model.parameters()))), f"{model.num_parameters():,}"]


def test_a_rule_prints_as_its_override():
    assert repr(GroupRule(roles=["norm", "bias"], optimizer="adamw", weight_decay=0.0)) == \
        "{roles:[norm,bias],optimizer:adamw,weight_decay:0.0}"
