"""Sweeps that measure scaling laws, as lmlab-train jobs whose steps come from lmlab's cost model.

- `isoflop_jobs`: per FLOP budget, `n_sizes` models log-spaced around the law's N* (within `spread`x either
  way), each trained for the steps that spend the budget (Hoffmann et al.'s approach 2).
- `wsd_jobs`: one warmup-stable-decay run per size, long enough for the largest budget, and for each smaller
  budget a short decay resumed from its stable-phase checkpoint (a run of T steps decays over its last
  20%: the decay starts at 0.8 T). One stable phase per size yields a loss at every budget for little
  more than the cost of the longest run.

Each job validates about `validations` times (trainer.val_every from its steps): enough points for the envelope
method's curves without a long run spending a tenth of its time validating every 50 steps.

Every job's planned FLOPs (the cost model's per token, times its steps and tokens per step) lie within 5%
of its budget, and `lmlab scaling collect --budgets ...` finds the budget again from them.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from omegaconf import DictConfig

from lmlab.errors import ConfigError
from lmlab.scaling.laws import ComputeOptimal
from lmlab.scaling.plan import Shape, ShapeRule, model_shape

DECAY_FRACTION = 0.2  # of a WSD run's steps, the decay at its end (sched.decay_fraction's default)
BUDGET_TOLERANCE = 0.05
MIN_STEPS = 20  # a shorter run is mostly warmup: its loss says little
VALIDATIONS = 20  # per job, by default


@dataclass(frozen=True)
class Job:
    name: str  # its folder under the sweep's
    overrides: tuple[str, ...]
    budget: float
    flops: float  # planned, by the cost model
    steps: int
    after: str | None = None  # the job whose checkpoint this one resumes (a WSD decay)


def _steps(shape: Shape, budget: float, tokens_per_step: int) -> int:
    return round(budget / (shape.flops_per_token * tokens_per_step))


def _sizes(law: ComputeOptimal, budget: float, n_sizes: int, spread: float) -> np.ndarray:
    return float(law.n_opt(budget)) * np.logspace(-math.log10(spread), math.log10(spread), n_sizes)


def _shapes(cfg: DictConfig, vocab_size: int, targets: Sequence[float], rule: ShapeRule) -> list[Shape]:
    """Distinct model shapes nearest each target (small targets can round to one shape), by size."""
    shapes = {}
    for n in targets:
        try:
            shape = model_shape(cfg, vocab_size, n, rule)
        except ConfigError:
            continue  # below the smallest model: the budget check below counts what is left
        shapes[(shape.d_model, shape.n_layers)] = shape
    return sorted(shapes.values(), key=lambda s: s.params)


def isoflop_jobs(law: ComputeOptimal, budgets: Sequence[float], n_sizes: int, cfg: DictConfig, vocab_size: int,
                 spread: float = 4.0, rule: ShapeRule = ShapeRule(),
                 validations: int = VALIDATIONS) -> list[Job]:
    tokens_per_step = cfg.data.batch_size * cfg.data.context_length
    jobs = []
    for budget in budgets:
        shapes = _shapes(cfg, vocab_size, _sizes(law, budget, n_sizes, spread), rule)
        fitting = [(s, _steps(s, budget, tokens_per_step)) for s in shapes]
        fitting = [(s, steps) for s, steps in fitting if steps >= MIN_STEPS]
        _check_budget(budget, len(fitting), len(shapes), float(law.n_opt(budget)), spread)
        for shape, steps in fitting:
            jobs.append(_job(f"isoflop/C{budget:.0e}/N{shape.params:.2e}", shape, steps, budget, tokens_per_step,
                             validations))
    return jobs


def wsd_jobs(law: ComputeOptimal, budgets: Sequence[float], n_sizes: int, cfg: DictConfig, vocab_size: int,
             spread: float = 4.0, rule: ShapeRule = ShapeRule(),
             validations: int = VALIDATIONS) -> list[Job]:
    tokens_per_step = cfg.data.batch_size * cfg.data.context_length
    low, high = min(budgets), max(budgets)
    targets = np.logspace(math.log10(law.n_opt(low) / spread), math.log10(law.n_opt(high) * spread), n_sizes)
    jobs, counts = [], dict.fromkeys(budgets, 0)
    shapes = _shapes(cfg, vocab_size, targets, rule)
    for shape in shapes:
        plan = sorted((steps, budget) for budget in budgets
                      if (steps := _steps(shape, budget, tokens_per_step)) >= MIN_STEPS)
        if not plan:
            continue
        every = _checkpoint_grid([steps for steps, _ in plan])
        starts = {budget: every * max(1, round((1 - DECAY_FRACTION) * steps / every)) for steps, budget in plan}
        # one warmup for the stable run and its decays, over before the earliest decay starts
        wsd = ("sched=wsd", f"sched.warmup_steps={max(1, min(50, min(starts.values()) // 2))}")
        longest_steps, longest = plan[-1]
        name = f"wsd/N{shape.params:.2e}"
        stable = (*shape.overrides(), *wsd, f"sched.decay_start={starts[longest]}", f"trainer.checkpoint_every={every}",
                  "ckpt_path=auto")
        jobs.append(_job(f"{name}/C{longest:.0e}", shape, longest_steps, longest, tokens_per_step, validations, stable))
        counts[longest] += 1
        for steps, budget in plan[:-1]:
            resume = (*shape.overrides(), *wsd, f"sched.decay_start={starts[budget]}",
                      f"ckpt_path=@RUN@/{name}/C{longest:.0e}/checkpoints/step{starts[budget]:06d}.ckpt")
            jobs.append(_job(f"{name}/C{budget:.0e}", shape, steps, budget, tokens_per_step, validations, resume,
                             after=f"{name}/C{longest:.0e}"))
            counts[budget] += 1
    for budget, count in counts.items():
        _check_budget(budget, count, len(shapes), float(law.n_opt(budget)), spread)
    return jobs


def _checkpoint_grid(run_steps: Sequence[int], slack: float = 0.02) -> int:
    """The coarsest checkpoint interval on which each run's decay start (at 1 - DECAY_FRACTION of its steps)
    lands within `slack` of its steps: the stable run keeps every checkpoint, so fewer is less disk."""
    ideal = [(1 - DECAY_FRACTION) * steps for steps in run_steps]
    for every in range(max(1, int(min(ideal))), 0, -1):
        if all(abs(every * max(1, round(s / every)) - s) <= slack * steps for s, steps in zip(ideal, run_steps)):
            return every
    return 1


def _job(name: str, shape: Shape, steps: int, budget: float, tokens_per_step: int, validations: int,
         overrides: Sequence[str] | None = None, after: str | None = None) -> Job:
    flops = shape.flops_per_token * steps * tokens_per_step
    if abs(flops / budget - 1) > BUDGET_TOLERANCE:
        raise ConfigError(f"job {name}: {steps} steps plan {flops:.3g} FLOPs, more than 5% from its budget "
                          f"{budget:.3g}; raise the budget or lower data.batch_size")
    if validations < 1:
        raise ConfigError(f"validations must be >= 1, got {validations}")
    # ckpt_path=auto: a second launch continues an interrupted job from its newest checkpoint and skips a finished one
    overrides = overrides or (*shape.overrides(), "ckpt_path=auto")
    return Job(name, (*overrides, f"trainer.max_steps={steps}",
                      f"trainer.val_every={max(1, steps // validations)}"), budget, flops, steps, after)


def _check_budget(budget: float, sizes: int, shapes: int, n_opt: float, spread: float) -> None:
    """A budget needs 3 sizes of at least MIN_STEPS steps; the advice depends on which of the two ran short."""
    if sizes >= 3:
        return
    if shapes < 3:  # the law's sizes near this budget's N* fall below the smallest model, or round to one shape
        why = (f"the sizes within {spread:g}x of its N* = {n_opt:.3g} give {shapes} distinct lmlab model(s): the budget "
               "is too small for the smallest model; raise it, widen spread=, or allow narrower models (head_dim=, "
               "aspect=, aspect_tolerance=)")
    else:
        why = (f"{shapes - sizes} of the {shapes} models would train fewer steps: raise the budget or lower "
               "data.batch_size / data.context_length")
    raise ConfigError(f"budget {budget:.3g} FLOPs leaves {sizes} model sizes of at least {MIN_STEPS} steps (3 are "
                      f"needed for a parabola): {why}")


def script(jobs: Sequence[Job], out: Path, base: Sequence[str], parallel: int = 1) -> str:
    """A bash script that runs the jobs, each in its own folder under `out`, `parallel` chains at a time, the
    costliest first: a chain is a job and the WSD decays that resume it, run in order. With parallel > 1 each
    chain's output goes to out/logs/CHAIN.log (small models leave a GPU idle: several runs share it). A second
    launch skips finished jobs and continues interrupted ones (ckpt_path=auto); the script fails if any job did."""
    if parallel < 1:
        raise ConfigError(f"parallel must be >= 1, got {parallel}")
    chains: dict[str, list[Job]] = {}
    for job in jobs:
        chains.setdefault(job.after or job.name, []).append(job)
    # the largest budgets first and, within one, the most steps (small models run slowest per FLOP): with
    # parallel > 1, no long run is left to start after the rest are done
    chains = dict(sorted(chains.items(), key=lambda item: (-sum(j.budget for j in item[1]),
                                                           -sum(j.steps for j in item[1]))))
    lines = ["#!/usr/bin/env bash", f"# {len(jobs)} lmlab-train jobs of `lmlab scaling sweep` in {len(chains)} chains; "
             "then:", f"#   lmlab scaling collect {shlex.quote(str(out))} --budgets "
             + ",".join(f"{b:.6g}" for b in sorted({j.budget for j in jobs})), "set -uo pipefail",
             f"mkdir -p {shlex.quote(str(out / 'logs'))}"]
    for i, chain in enumerate(chains.values(), start=1):
        lines.append(f"chain{i}() {{")
        for job in chain:
            overrides = [o.replace("@RUN@", str(out)) for o in (*base, *job.overrides)]
            lines.append(f"    echo '[{i}/{len(chains)}] {job.name}: {job.flops:.3g} FLOPs' >&2")
            lines.append("    " + shlex.join(["lmlab-train", *overrides, f"hydra.run.dir={out / job.name}"]) + " || return")
        lines.append("}")
    log = shlex.quote(str(out / "logs"))
    run = (f'echo "$chain: started, log in {log}/$chain.log" >&2; "$chain" > {log}/"$chain".log 2>&1'
           if parallel > 1 else '"$chain"')
    lines += ["failed=0", f"for chain in {' '.join(f'chain{i}' for i in range(1, len(chains) + 1))}; do",
              f'    while [ "$(jobs -rp | wc -l)" -ge {parallel} ]; do wait -n || failed=1; done',
              f"    {{ {run}; }} &", "done",
              'while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n || failed=1; done',
              '[ $failed = 0 ] || echo "a job failed: see its log" >&2', "exit $failed"]
    return "\n".join(lines) + "\n"
