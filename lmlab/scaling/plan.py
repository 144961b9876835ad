"""The planner: for a compute budget, the loss-optimal model size and tokens from a fitted law, an lmlab
model config of that size with its training steps from the cost model, and, given the tokens the model
will serve, the smaller, longer-trained model that minimises training plus inference FLOPs for the same
loss (Sardana et al. 2024, "Beyond Chinchilla-Optimal")."""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from omegaconf import DictConfig

from lmlab.errors import ConfigError
from lmlab.scaling.laws import ComputeOptimal, JointLaw

# Hoffmann et al. (2022), approach 3 as published: the default law when no fit of lmlab's runs is given.
# Its losses are in nats per token of the MassiveText tokenizer, not of lmlab's.
CHINCHILLA = JointLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
INFERENCE_FLOPS_PER_PARAM = 2  # a forward pass: one multiply-add per weight per token


@dataclass(frozen=True)
class Shape:
    d_model: int
    n_layers: int
    n_heads: int
    params: int  # without the token embedding, as the fits count N
    params_total: int
    flops_per_token: float  # training, from the cost model (6 per weight plus attention)

    def overrides(self) -> list[str]:
        return [f"model.d_model={self.d_model}", f"model.n_layers={self.n_layers}",
                f"model.attention.n_heads={self.n_heads}"]


@dataclass(frozen=True)
class ShapeRule:
    """Which shapes the planner and the sweeps may give a parameter count: widths in multiples of `head_dim`,
    and d_model / n_layers within `aspect_tolerance`x of `aspect`. A wide tolerance matches counts more closely; a
    narrow one keeps a sweep's models one family (depth growing with width), so that a size's loss does not
    jump where its depth does."""

    aspect: float = 64.0
    aspect_tolerance: float = 2.0
    head_dim: int = 64

    def __post_init__(self):
        if not (self.aspect > 0 and self.aspect_tolerance >= 1 and self.head_dim >= 1):
            raise ConfigError(f"aspect={self.aspect}, aspect_tolerance={self.aspect_tolerance} and head_dim={self.head_dim}: "
                              "the aspect ratio must be > 0, its tolerance >= 1 (a factor) and head_dim >= 1")


def model_shape(cfg: DictConfig, vocab_size: int, n_target: float, rule: ShapeRule = ShapeRule()) -> Shape:
    """The lmlab model of `cfg`'s architecture whose non-embedding parameters come closest to `n_target`
    (in log ratio) among the shapes `rule` allows; ties go to the aspect ratio nearer `rule.aspect`. Counts
    grow linearly with depth, so each width's come from models of 1 and 2 layers; the chosen model is built
    whole for the exact figures."""
    from functools import cache

    aspect, head_dim = rule.aspect, rule.head_dim

    @cache
    def counts(d_model: int, n_layers: int) -> Shape:
        return _build(cfg, vocab_size, d_model, n_layers, head_dim)

    def estimate(d_model: int, n_layers: int) -> float:
        one, two = counts(d_model, 1), counts(d_model, 2)
        return one.params + (n_layers - 1) * (two.params - one.params)

    def widths_around(n_layers: int) -> list[int]:
        """The two widths whose models bracket the target at this depth, by bisection: the estimate grows with
        width, and the token head's vocab x d_model makes a width guess from 12 d^2 alone miss small models."""
        low, high = 1, max(2, math.ceil(math.sqrt(n_target / (12 * n_layers)) / head_dim) + 1)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if estimate(mid * head_dim, n_layers) < n_target else (low, mid)
        return [low * head_dim, high * head_dim]

    best, best_score = None, math.inf
    for n_layers in range(1, 129):
        for d_model in widths_around(n_layers):
            ratio = d_model / n_layers
            if aspect / rule.aspect_tolerance <= ratio <= aspect * rule.aspect_tolerance:
                score = abs(math.log(estimate(d_model, n_layers) / n_target)) + 0.01 * abs(math.log(ratio / aspect))
                if score < best_score:
                    best, best_score = (d_model, n_layers), score
    shape = None if best is None else _build(cfg, vocab_size, *best, head_dim)
    if shape is None or abs(math.log(shape.params / n_target)) > math.log(2):
        closest = "" if shape is None else f" (the closest has {shape.params:.3g})"
        raise ConfigError(f"no lmlab model of this architecture comes within 2x of {n_target:.3g} parameters with "
                          f"d_model / n_layers within {rule.aspect_tolerance:g}x of aspect={aspect:g}{closest}: the budget is too small for "
                          "the smallest model, or too large for 128 layers")
    return shape


def _build(cfg: DictConfig, vocab_size: int, d_model: int, n_layers: int, head_dim: int) -> Shape:
    from lmlab.nn.transformer import Transformer

    model_cfg = cfg.model.copy()
    model_cfg.d_model, model_cfg.n_layers, model_cfg.attention.n_heads = d_model, n_layers, d_model // head_dim
    with torch.device("meta"):
        model = Transformer(model_cfg, vocab_size)
    return Shape(d_model, n_layers, d_model // head_dim, model.num_parameters(exclude_embeddings=True),
                 model.num_parameters(), model.flops_per_token(cfg.data.context_length))


@dataclass(frozen=True)
class Overtrained:
    n: float
    d: float
    training_flops: float
    inference_flops: float

    @property
    def total(self) -> float:
        return self.training_flops + self.inference_flops


def overtrain(law: JointLaw, flops: float, inference_tokens: float, points: int = 4001) -> Overtrained:
    """The model that reaches the compute-optimal model's loss at `flops` with the least training plus
    inference FLOPs over `inference_tokens` served: smaller N, more D, found on a log grid below N*."""
    target = float(law.predicted_loss(flops))
    n = np.logspace(math.log10(law.n_opt(flops)) - 3, math.log10(law.n_opt(flops)), points)
    room = target - law.E - law.A * n ** -law.alpha  # what the data term may still contribute
    n, room = n[room > 0], room[room > 0]
    d = (law.B / room) ** (1 / law.beta)
    total = 6 * n * d + INFERENCE_FLOPS_PER_PARAM * n * inference_tokens
    i = int(np.argmin(total))
    return Overtrained(float(n[i]), float(d[i]), float(6 * n[i] * d[i]),
                       float(INFERENCE_FLOPS_PER_PARAM * n[i] * inference_tokens))


def plan(law: ComputeOptimal, flops: float, cfg: DictConfig, vocab_size: int, inference_tokens: float = 0.0,
         rule: ShapeRule = ShapeRule(), overrides: Sequence[str] = ()) -> str:
    """The planner's report (see the module doc). `overrides` made `cfg`: its lmlab-train lines repeat them."""
    if not flops > 0:
        raise ConfigError(f"flops must be a positive FLOP count, got {flops}")
    if inference_tokens < 0:
        raise ConfigError(f"inference_tokens must be >= 0, got {inference_tokens}")
    if inference_tokens and not isinstance(law, JointLaw):
        raise ConfigError("inference_tokens needs the joint law L(N, D) (method=joint, or no fit= for Chinchilla's)")
    tokens_per_step = cfg.data.batch_size * cfg.data.context_length
    n, d = float(law.n_opt(flops)), float(law.d_opt(flops))
    lines = [f"budget {flops:.3g} FLOPs: N* = {n:.3g} parameters (without the token embedding), D* = {d:.3g} tokens "
             f"({d / n:.1f} per parameter), predicted loss {float(law.predicted_loss(flops)):.4f}"]
    lines += _config_lines(cfg, vocab_size, n, d, tokens_per_step, rule, overrides)
    if inference_tokens:
        best = overtrain(law, flops, inference_tokens)
        optimal_total = flops + INFERENCE_FLOPS_PER_PARAM * n * inference_tokens
        lines.append(f"serving {inference_tokens:.3g} tokens: train N = {best.n:.3g} on D = {best.d:.3g} tokens "
                     f"({best.d / best.n:.1f} per parameter) for the same loss; training {best.training_flops:.3g} + "
                     f"inference {best.inference_flops:.3g} = {best.total:.3g} FLOPs against {optimal_total:.3g} for "
                     f"N* ({100 * (best.total / optimal_total - 1):+.1f}%)")
        lines += _config_lines(cfg, vocab_size, best.n, best.d, tokens_per_step, rule, overrides)
    return "\n".join(lines)


def _config_lines(cfg: DictConfig, vocab_size: int, n: float, d: float, tokens_per_step: int,
                  rule: ShapeRule, overrides: Sequence[str]) -> list[str]:
    """The lmlab model nearest N parameters and the steps that spend 6ND FLOPs by lmlab's cost model (which
    also counts attention's products, so the run sees somewhat fewer tokens than D)."""
    shape = model_shape(cfg, vocab_size, n, rule)
    steps = max(1, round(6 * n * d / (shape.flops_per_token * tokens_per_step)))
    tokens = steps * tokens_per_step
    return [f"  lmlab model: d_model {shape.d_model}, {shape.n_layers} layers, {shape.n_heads} heads: "
            f"{shape.params:.3g} parameters without the token embedding ({shape.params_total:.3g} in all), "
            f"{shape.flops_per_token:.3g} training FLOPs per token; {steps:,} steps of {tokens_per_step:,} tokens = "
            f"{tokens:.3g} tokens ({tokens / d:.0%} of D)",
            "  " + shlex.join(["lmlab-train", *_not_set_by(shape.overrides(), overrides), *shape.overrides(),
                               f"trainer.max_steps={steps}"])]


def _not_set_by(planned: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """The user's overrides but those of keys the plan sets (model.n_layers=2 when it sizes the model to 4 layers):
    a command holding both would train the last one silently."""
    keys = {o.partition("=")[0] for o in planned}
    return [o for o in overrides if o.partition("=")[0].lstrip("+~") not in keys]
