"""Adam (Kingma & Ba) and AdamW (Loshchilov & Hutter), written out so every step of the update is visible.

bf16 weights and moments (`trainer.precision=bf16-true`) are updated in float32 and written back with stochastic
rounding by default (lmlab.optim.stochastic_rounding), which keeps the updates that round-to-nearest would lose.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from lmlab.optim.base import evaluate_closure, keep_state_dtypes
from lmlab.optim.checks import check_betas, check_lr, check_non_negative
from lmlab.optim.stochastic_rounding import FIRST_MOMENT, PARAM, SECOND_MOMENT, Float32Pack, round_key


class Adam(torch.optim.Optimizer):
    """Adam with an L2 penalty added to the gradient; same arguments and numerics as `torch.optim.Adam` for float32
    tensors. bf16 parameters and moments are written with stochastic rounding unless `stochastic_rounding=False`
    (then they round to nearest). `state_dtype` (e.g. float32 under bf16 weights) sets the moments' dtype; None: the
    parameter's, as torch.optim.Adam has it."""

    # AdamW's one change: decay shrinks the weight directly instead of passing through the
    # moments, where Adam's normalisation would shrink it for parameters with large gradients.
    decoupled_weight_decay = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        stochastic_rounding: bool = True,
        state_dtype: torch.dtype | None = None,
    ):
        name = type(self).__name__
        if state_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"{name}: state_dtype must be float32, bfloat16 or None (the parameter's), got "
                             f"{state_dtype}")
        check_lr(name, lr)
        check_betas(name, betas)
        check_non_negative(name, eps=eps, weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      stochastic_rounding=stochastic_rounding))
        # The rounding noise's seed: the run's (seed_everything's), read without drawing from the generator, so
        # float32 runs draw the same random numbers as before. Every data-parallel rank has the same one, so
        # replicas that reduce the same gradients also round them alike and stay equal.
        self.seed = torch.initial_seed()
        self.state_dtype = state_dtype
        keep_state_dtypes(self)  # a resume must not round float32 moments of bf16 weights
        # `kernels=` may swap in a fused update with the same signature. It takes a whole group at
        # once, so a multi-tensor kernel can update every parameter in one launch.
        self.kernel = adam_update

    def use_kernels(self, ops) -> None:
        if ops.adam is not None:
            self.kernel = ops.adam

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = evaluate_closure(closure)
        for g, group in enumerate(self.param_groups):
            present = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
            if not present:
                continue
            params = [p for _, p in present]
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
            moments = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            keys = None
            if group.get("stochastic_rounding", True) and any(
                    t.dtype == torch.bfloat16 for column in (params, *moments) for t in column):
                keys = [round_key(self.seed, (g << 24) + i, s["step"]) for (i, _), s in zip(present, states)]
            self.kernel(params, [p.grad for p in params], *moments, [s["step"] for s in states], group["lr"],
                        group["betas"], group["eps"], group["weight_decay"], self.decoupled_weight_decay,
                        round_keys=keys)
        return loss


def adam_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: list[int], lr: float, betas: tuple[float, float],
                eps: float, wd: float, decoupled: bool, round_keys: list[int] | None = None) -> None:
    """One Adam step of each parameter in place, and of its moments, at its step count (1-based). With
    `round_keys` (one per parameter), bf16 tensors are updated in float32 and rounded stochastically with that
    key's noise; moments of another dtype than their parameter's are updated in float32 and rounded to theirs.
    Each operation is one multi-tensor call over a run of parameters (`adam_update_foreach`), so the host's time
    does not grow with each tensor's operations (the GPU waited on it: experiments/kernels/README.md)."""
    keys = round_keys if round_keys is not None else [None] * len(params)
    direct, widened = [], []
    for column in zip(params, grads, exp_avgs, exp_avg_sqs, steps, keys):
        p, _, m, v, _, key = column
        stochastic = key is not None and torch.bfloat16 in (p.dtype, m.dtype, v.dtype)
        if stochastic or not p.dtype == m.dtype == v.dtype:
            widened.append((*column, stochastic))
        else:
            direct.append(column)
    for chunk in _chunks(direct):
        p, g, m, v, t, _ = map(list, zip(*chunk))
        adam_update_foreach(p, g, m, v, t, lr, betas, eps, wd, decoupled)
    for chunk in _chunks(widened):
        _update_in_float32(chunk, lr, betas, eps, wd, decoupled)


# Parameter elements updated at once: the multi-tensor operations' temporaries (and, for bf16 tensors, their float32
# copies, ~22 bytes an element) then stay under ~1.5 GB however large the group; a larger tensor goes alone.
CHUNK_ELEMENTS = 1 << 26


def _chunks(columns: list[tuple]) -> list[list[tuple]]:
    """Consecutive runs of `columns` (each a parameter first) of at most CHUNK_ELEMENTS parameter elements."""
    chunks, size = [], 0
    for column in columns:
        if not chunks or size + column[0].numel() > CHUNK_ELEMENTS:
            chunks.append([])
            size = 0
        chunks[-1].append(column)
        size += column[0].numel()
    return chunks


def _update_in_float32(columns: list[tuple], lr: float, betas: tuple[float, float], eps: float, wd: float,
                       decoupled: bool) -> None:
    """`adam_update` of (param, grad, m, v, step, key, stochastic) columns whose tensors are not all float32: the
    tensors that are not float32 are packed into one float32 buffer, updated there, and written back, rounded
    stochastically where `stochastic`, in one compiled call (a compiled call costs the host ~100 us, as much as 25
    eager operations), and to nearest elsewhere."""
    rounded, offsets, kept = [], [], []
    for p, _, m, v, _, key, stochastic in columns:
        for x, stream in ((p, PARAM), (m, FIRST_MOMENT), (v, SECOND_MOMENT)):
            if stochastic and x.dtype == torch.bfloat16:
                rounded.append(x)
                offsets.append(stream + key)
            elif x.dtype != torch.float32:
                kept.append(x)
    packed = rounded + kept + [g for _, g, *_ in columns if g.dtype != torch.float32]
    pack = Float32Pack(packed)
    wide = dict(zip(map(id, packed), pack.views))
    p, g, m, v = ([wide.get(id(x), x) for x in column] for column in list(zip(*columns))[:4])
    adam_update_foreach(p, g, m, v, [column[4] for column in columns], lr, betas, eps, wd, decoupled)
    if rounded:
        pack.stochastic_round_(rounded, offsets)
    if kept:
        torch._foreach_copy_(kept, pack.views[len(rounded):len(rounded) + len(kept)])


def adam_update_foreach(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                        exp_avg_sqs: list[torch.Tensor], steps: list[int], lr: float, betas: tuple[float, float],
                        eps: float, wd: float, decoupled: bool) -> None:
    """One Adam step of each parameter in place, and of its moments, at its step count (1-based): every operation
    one multi-tensor call over the lists, as torch.optim's foreach implementation makes it."""
    beta1, beta2 = betas
    if decoupled:
        torch._foreach_mul_(params, 1 - lr * wd)
    elif wd:
        grads = torch._foreach_add(grads, params, alpha=wd)  # gradient of the penalty wd/2 |p|^2
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)  # m = beta1 m + (1 - beta1) g
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    # Bias corrections for the zero-initialised moments, folded into step size and denominator.
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [math.sqrt(1 - beta2**t) for t in steps])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, [-lr / (1 - beta1**t) for t in steps])


class AdamW(Adam):
    """Adam with decoupled weight decay; same arguments and numerics as `torch.optim.AdamW`."""

    decoupled_weight_decay = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        stochastic_rounding: bool = True,
        state_dtype: torch.dtype | None = None,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, stochastic_rounding, state_dtype)
