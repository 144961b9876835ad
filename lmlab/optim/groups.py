"""Parameter groups from rules: a parameter's role decides its optimizer, learning rate and weight decay.

Roles, decided by module type, shape and name (Hugging Face Llama names in lmlab's models):
  embedding  weights of nn.Embedding modules (an output head tied to them counts here, once)
  head       the output projection: the weight of the module named `lm_head`
  bias       parameters named `bias`
  norm       every other 0-D or 1-D parameter: gains of norm layers and similar scales
  expert     MoE expert weights: under a module named `experts`, or stacks of matrices (3-D and up)
  conv       filters of convolution modules (the short causal convolutions of Mamba-2 and Gated DeltaNet):
             a few taps per channel, not a matrix for Muon to orthogonalise
  matrix     every other weight: attention and MLP projections, the MoE router

A rule (`GroupRule`) names roles and sets, for them, the optimizer that steps them, a learning-rate
multiplier and a weight decay. Every parameter must match exactly one rule. The model's own
per-parameter `lr_multipliers` (set by muP's init) multiply on top, so a rule can yield several
groups. This is how Muon + AdamW and muP's per-layer learning rates are both expressed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.optim.composite import CompositeOptimizer
from lmlab.registry import unknown_name_message

ROLES = ("embedding", "head", "norm", "bias", "matrix", "expert", "conv")


@dataclass
class GroupRule:
    roles: list[str] = field(default_factory=list)  # some of: embedding, head, norm, bias, matrix, expert, conv
    optimizer: str | None = None  # None: the entry's own optimizer (muon's rules may also say "adamw")
    lr_mult: float = 1.0  # times the optimizer's learning rate
    weight_decay: float | None = None  # None: the entry's weight_decay

    def __repr__(self) -> str:  # as `lmlab list` shows it: command-line override syntax, defaults left out
        changed = [f"{f.name}:{getattr(self, f.name)}" for f in fields(self)[1:] if getattr(self, f.name) != f.default]
        return "{" + ",".join([f"roles:[{','.join(self.roles)}]", *changed]) + "}"


def decay_matrices() -> list[GroupRule]:
    """Default rules: weight decay on every matrix (embeddings and head included), none on gains and biases."""
    return [GroupRule(roles=["embedding", "head", "matrix", "expert", "conv"]),
            GroupRule(roles=["norm", "bias"], weight_decay=0.0)]


def parameter_roles(model: nn.Module) -> dict[str, tuple[str, nn.Parameter]]:
    """name -> (role, parameter) for every trainable parameter; tied weights once, under their first name."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(m.weight) for name, m in model.named_modules()
             if name.rsplit(".", 1)[-1] == "lm_head" and isinstance(getattr(m, "weight", None), nn.Parameter)}
    convs = {id(m.weight) for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)}
    roles = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in embeddings:  # checked before the head, so a tied head counts as the embedding
            role = "embedding"
        elif id(p) in heads:
            role = "head"
        elif name.rsplit(".", 1)[-1] == "bias":
            role = "bias"
        elif p.dim() < 2:
            role = "norm"
        elif id(p) in convs:
            role = "conv"
        elif "experts" in name.split(".") or p.dim() > 2:
            role = "expert"
        else:
            role = "matrix"
        roles[name] = (role, p)
    return roles


def _check_rules(rules: Sequence[GroupRule], optimizers: Sequence[str]) -> None:
    owner: dict[str, int] = {}
    for i, rule in enumerate(rules):
        where = f"optim.groups[{i}]"
        if not rule.roles:
            raise ConfigError(f"{where} lists no roles; give some of: {', '.join(ROLES)}")
        for role in rule.roles:
            if role not in ROLES:
                raise ConfigError(f"{where}: {unknown_name_message('parameter role', role, ROLES)}")
            if role in owner:
                raise ConfigError(f"role '{role}' is in optim.groups[{owner[role]}] and {where}; "
                                  "each parameter must be matched by exactly one group")
            owner[role] = i
        if rule.optimizer is not None and rule.optimizer not in optimizers:
            message = unknown_name_message("optimizer for this entry", rule.optimizer, optimizers)
            raise ConfigError(f"{where}: {message}")
        if not rule.lr_mult > 0:
            raise ConfigError(f"{where}.lr_mult must be > 0, got {rule.lr_mult}")
        if rule.weight_decay is not None and not rule.weight_decay >= 0:
            raise ConfigError(f"{where}.weight_decay must be >= 0, got {rule.weight_decay}")


def param_groups(model: nn.Module, rules: Sequence[GroupRule], lrs: dict[str, float],
                 weight_decay: float) -> list[dict]:
    """torch.optim param groups in rule order (within a rule, largest muP multiplier first).

    `lrs` maps each optimizer a rule may name to its learning rate; the first is the default.
    Each group also records its "optimizer" and "roles", which `describe_groups` prints.
    """
    _check_rules(rules, list(lrs))
    if not weight_decay >= 0:
        raise ConfigError(f"optim.weight_decay must be >= 0, got {weight_decay}")
    rule_of = {role: i for i, rule in enumerate(rules) for role in rule.roles}
    multipliers = getattr(model, "lr_multipliers", {})
    buckets: dict[tuple[int, float], list[tuple[str, nn.Parameter]]] = {}
    unmatched = []
    for name, (role, p) in parameter_roles(model).items():
        if role not in rule_of:
            unmatched.append(f"{name} ({role})")
            continue
        buckets.setdefault((rule_of[role], multipliers.get(name, 1.0)), []).append((role, p))
    if unmatched:
        raise ConfigError(f"no group in optim.groups matches {', '.join(unmatched[:5])}"
                          f"{f' and {len(unmatched) - 5} more' if len(unmatched) > 5 else ''}; "
                          "add their roles to a rule")
    groups = []
    for (i, mult), members in sorted(buckets.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        rule, present = rules[i], {role for role, _ in members}
        optimizer = rule.optimizer or next(iter(lrs))
        groups.append({
            "params": [p for _, p in members],
            "lr": lrs[optimizer] * rule.lr_mult * mult,
            "weight_decay": weight_decay if rule.weight_decay is None else rule.weight_decay,
            "optimizer": optimizer,
            "roles": [role for role in rule.roles if role in present],
        })
    if not groups:
        raise ConfigError(f"{type(model).__name__} has no trainable parameters to optimise")
    return groups


@dataclass(frozen=True)
class Part:
    """One optimizer of an entry: its learning rate, and `make(groups, lr=lr)` builds it."""

    lr: float
    make: Callable[..., torch.optim.Optimizer]


def build_optimizer(model: nn.Module, rules: Sequence[GroupRule], weight_decay: float,
                    parts: dict[str, Part]) -> torch.optim.Optimizer:
    """The optimizer the rules describe: a single part if only one is used, else a composite of them.

    The first of `parts` steps the rules that name no optimizer.
    """
    groups = param_groups(model, rules, {name: part.lr for name, part in parts.items()}, weight_decay)
    built = {}
    for name, part in parts.items():
        own = [g for g in groups if g["optimizer"] == name]
        if own:
            built[name] = part.make(own, lr=part.lr)  # the constructor checks lr; the groups carry their own
    return next(iter(built.values())) if len(built) == 1 else CompositeOptimizer(built)


def describe_groups(optimizer: torch.optim.Optimizer) -> str:
    """A table of the param groups (optimizer, roles, lr, weight decay, tensors, parameters), for the start-up log.

    The lr shown is the peak (`initial_lr`, once a scheduler has set it), not the warmup's current value.
    """
    header = ("group", "optimizer", "roles", "lr", "weight_decay", "tensors", "parameters")
    rows = []
    for i, g in enumerate(optimizer.param_groups):
        rows.append((str(i), g.get("optimizer", type(optimizer).__name__.lower()), ",".join(g.get("roles", ["-"])),
                     f"{g.get('initial_lr', g['lr']):.3g}", f"{g.get('weight_decay', 0.0):g}",
                     str(len(g["params"])), f"{sum(p.numel() for p in g['params']):,}"))
    tensors = sum(len(g["params"]) for g in optimizer.param_groups)
    params = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    rows.append(("total", "", "", "", "", str(tensors), f"{params:,}"))
    widths = [max(len(row[c]) for row in (header, *rows)) for c in range(len(header))]
    right = {3, 4, 5, 6}  # numbers line up on the right
    return "\n".join("  ".join(cell.rjust(w) if c in right else cell.ljust(w)
                               for c, (cell, w) in enumerate(zip(row, widths))).rstrip()
                     for row in (header, *rows))
