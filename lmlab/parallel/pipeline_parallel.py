"""Pipeline parallelism for training, composed with data parallelism: each rank holds its stages of a Transformer
(lmlab.parallel.pipeline) and drops the other stages' weights, so its memory is its stages'. Written to be read:

    pipeline = PipelineParallel(model, pp=2, n_microbatches=4)  # 4 ranks: 2 replicas of a 2-stage pipeline
    terms = pipeline.train_step(inputs, targets, loss_terms)     # the schedule's forwards and backwards; its
    pipeline.accumulate_gradients()                              #   gradients join .grad here
    pipeline.finish_gradient_synchronization()                   # each stage's gradients averaged over its replicas
    pipeline.clip_grad_norm_(params, 1.0)                        # by the whole model's norm
    optimizer.step()                                             # over all parameters: the dropped ones get no grad
    whole = pipeline.gather_full_params()                        # whole tensors, for a checkpoint

Layout: pipeline ranks outermost, as in torchtitan: global rank = stage_rank x dp + dp_rank. Replica d is the
pipeline of ranks d, dp + d, 2 dp + d, ... (its stages in order) and trains on the d-th share of every batch;
the dp ranks s dp .. s dp + dp - 1 hold the same stages and average their gradients. On several nodes the
pipeline's point-to-point activations cross nodes, and the heavier gradient all-reduce stays within one.

A dropped weight keeps its Parameter, name and shape, with a one-element placeholder behind it (`_placeholder`),
so the optimizer groups parameters exactly as one process does (by role and shape: Muon takes the matrices) and
a checkpoint's optimizer state lines up with one process's. The placeholders never get a gradient, so every
optimizer skips them. `place(device)` moves the held tensors and remakes the placeholders on a device
(`module.to` would expand each placeholder to its whole size).

Checkpoints hold whole tensors: each is broadcast from the rank of its stage over the pipeline, on the CPU
(a model that needs a pipeline may not fit one device), and loading keeps each rank's stages only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmlab.parallel.comm import average_gradients, load_whole_tensors, own_group
from lmlab.parallel.pipeline import build_pipeline, stage_owners

IGNORE = -100  # the target of validation's padding rows


def rank_layout(world: int, pp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(pipelines, data-parallel groups) of the global ranks, pipeline ranks outermost: pipelines[d] are replica
    d's ranks in stage order, dp_groups[s] the ranks that hold stage rank s (see the module docstring)."""
    if pp < 1 or world % pp:
        raise ValueError(f"pp={pp} pipeline ranks must divide the world size {world}")
    dp = world // pp
    return ([[s * dp + d for s in range(pp)] for d in range(dp)],
            [[s * dp + d for d in range(dp)] for s in range(pp)])


def _placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One element viewed as `p`'s shape: the dropped weight's stand-in (its shape and dtype, no memory)."""
    return torch.empty((), dtype=p.dtype, device=device).expand(p.shape)


@dataclass(frozen=True)
class _TensorSpec:
    """An optimizer-state tensor, described to the ranks that will receive it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class PipelineParallel:
    """This rank's stages of `model` (an lmlab Transformer) and the schedule that runs them; see the module
    docstring. Offers ExpertParallel's interface for checkpoints and clipping (gather_full_params,
    load_full_state_dict, full_optimizer_state_dict, load_full_optimizer_state_dict, clip_grad_norm_)."""

    def __init__(self, model: nn.Module, pp: int, n_microbatches: int, schedule: str = "1f1b",
                 stages_per_rank: int = 1, device: torch.device | None = None):
        world, rank = dist.get_world_size(), dist.get_rank()
        pipelines, dp_groups = rank_layout(world, pp)
        self.module, self.pp, self.dp, self.n_microbatches = model, pp, world // pp, n_microbatches
        self.stage_rank, self.dp_rank = divmod(rank, self.dp)
        self.pipeline_ranks = pipelines[self.dp_rank]
        self.pp_group, self.dp_group = own_group(pipelines, rank), own_group(dp_groups, rank)
        self.device = device or next(model.parameters()).device
        self.owner = stage_owners(model, pp, stages_per_rank)
        self.held = [p for p in model.parameters() if self.owner[id(p)] == self.stage_rank]
        self.dropped = [p for p in model.parameters() if self.owner[id(p)] != self.stage_rank]
        self.stages, self.schedule = build_pipeline(model, self.stage_rank, pp, self._loss, n_microbatches, schedule,
                                                    stages_per_rank, self.device, self.pp_group)
        self.holds_first = any(stage.is_first for stage in self.stages)
        self.holds_last = any(stage.is_last for stage in self.stages)
        with torch.no_grad():
            if self.dp > 1:  # every replica of a stage starts from the same weights
                for t in [*self.held, *model.buffers()]:
                    dist.broadcast(t.detach(), src=dp_groups[self.stage_rank][0], group=self.dp_group)
            for p in self.dropped:
                p.data = _placeholder(p, p.device)
        self._loss_now: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._pending: list[torch.Tensor | None] = []  # the last train_step's gradients, not yet in .grad
        self._term_names: list[str] | None = None  # the loss terms' names, as the last stage found them
        self._eval_rows: int | None = None  # rows of every validation step (padded to the first one's)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss_now(logits, targets)  # the schedule's loss_fn: training's, or validation's

    def _run(self, run: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """One schedule step (`step` or `eval`) on a batch: the first stage takes the inputs, the last the targets;
        returns the micro-batches' losses on the rank of the last stage (else nothing)."""
        losses: list[torch.Tensor] = []
        run(*([inputs] if self.holds_first else []), return_outputs=False,
            **({"target": targets, "losses": losses} if self.holds_last else {}))
        return losses

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                   loss_terms: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Forward and backward of every micro-batch by the schedule, minimising `loss_terms(...)["loss"]`; returns
        each term's mean over the micro-batches (the batch's) on every rank of the pipeline. The gradients, of the
        batch's mean loss, are held until `accumulate_gradients` (.grad stays as it was)."""
        earlier = [p.grad for p in self.held]
        for p in self.held:  # the schedule scales every .grad of its stages: earlier micro-batches' stay out of reach
            p.grad = None
        records: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            terms = loss_terms(logits, targets)
            records.append((terms["loss"], {name: value.detach().float() for name, value in terms.items()}))
            return terms["loss"]

        self._loss_now = loss
        losses = self._run(self.schedule.step, inputs, targets)
        self._pending = [p.grad for p in self.held]
        for p, grad in zip(self.held, earlier):
            p.grad = grad
        # The schedule also calls the loss once on placeholder activations when it sizes its buffers: keep the
        # terms of the micro-batches' losses only.
        real = {id(value) for value in losses}
        return self._share_terms([terms for value, terms in records if id(value) in real])

    def _share_terms(self, micro_terms: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Each term's mean over the micro-batches, from the last stage to every rank of the pipeline."""
        last = self.pipeline_ranks[-1]
        if self._term_names is None:  # once: the other stages never see the loss
            names = [list(micro_terms[0]) if self.holds_last else None]
            dist.broadcast_object_list(names, src=last, group=self.pp_group, device=self.device)
            self._term_names = names[0]
        means = (torch.stack([torch.stack([t[name] for t in micro_terms]).mean() for name in self._term_names])
                 if self.holds_last else torch.empty(len(self._term_names)))
        return dict(zip(self._term_names, self._broadcast(means, last, self.pp_group)))

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy over the batch's targets, forward only, on every rank of the pipeline.
        Rows are padded (with ignored targets) to the first call's count, rounded up to a multiple of the
        micro-batches: a last, shorter batch then runs through the same buffers."""
        rows = inputs.shape[0]
        if self._eval_rows is None:
            self._eval_rows = -(-rows // self.n_microbatches) * self.n_microbatches
        if rows > self._eval_rows:
            raise ValueError(f"a validation batch of {rows} rows after one of {self._eval_rows}: the first must be "
                             "the largest")
        pad = self._eval_rows - rows
        count = (targets != IGNORE).sum()
        inputs = torch.cat([inputs, inputs[:1].expand(pad, -1)])
        targets = torch.cat([targets, targets.new_full((pad, targets.shape[1]), IGNORE)])
        self._loss_now = lambda logits, targets: F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                                                                 ignore_index=IGNORE, reduction="sum")
        losses = self._run(self.schedule.eval, inputs, targets)
        total = torch.stack(losses).sum() if self.holds_last else torch.empty(())
        return self._broadcast(total, self.pipeline_ranks[-1], self.pp_group) / count

    @torch.no_grad()
    def accumulate_gradients(self, scale: float = 1.0) -> None:
        """Add the last train_step's gradients, times `scale`, into .grad."""
        for p, grad in zip(self.held, self._pending):
            if grad is not None:
                grad = grad.mul_(scale) if scale != 1 else grad
                p.grad = grad if p.grad is None else p.grad.add_(grad)
        self._pending = []

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches inside only accumulate into .grad: call finish_gradient_synchronization once after the last."""
        yield

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Average each held parameter's gradient over the replicas of its stage."""
        if self.dp > 1:
            average_gradients(self.held, self.dp_group)

    @torch.no_grad()
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ by the norm of the whole model's gradient: each rank's stages' squared
        norm, summed over the pipeline (every parameter is on one stage; replicas hold equal gradients)."""
        grads = [p.grad for p in params if p.grad is not None]
        square = torch.nn.utils.get_total_norm(grads).to(self.device).square()
        dist.all_reduce(square, group=self.pp_group)
        norm = square.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def place(self, device: torch.device) -> None:
        """Move the held tensors to `device` and make the placeholders there."""
        with torch.no_grad():
            for t in [*self.held, *self.module.buffers()]:
                t.data = t.data.to(device)
            for p in self.dropped:
                p.data = _placeholder(p, device)

    def _broadcast(self, t: torch.Tensor | None, src: int, group, spec: _TensorSpec | None = None) -> torch.Tensor:
        """Rank `src`'s `t` on every rank of `group`, on this rank's device; the others pass a tensor or spec of its
        shape. A collective: every rank of the group calls it, in the same order."""
        if dist.get_rank() == src:
            buffer = t.detach().to(self.device, copy=True)
        else:
            spec = spec or _TensorSpec(tuple(t.shape), t.dtype)
            buffer = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        dist.broadcast(buffer, src=src, group=group)
        return buffer

    # -- whole tensors for checkpoints, on the CPU (collectives: every rank calls them, in the same order) ------
    def _from_stage(self, t: torch.Tensor) -> torch.Tensor:
        owner = self.owner.get(id(t))
        if owner is None:  # not on a stage: every rank holds it
            return t.detach()
        return self._broadcast(t, self.pipeline_ranks[owner], self.pp_group).cpu()

    @torch.no_grad()
    def gather_full_params(self, of: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The state dict of `of` (default: the model; or a module holding it, for its names) with every tensor
        whole, on every rank of the pipeline: what one process holds."""
        of = self.module if of is None else of
        return {name: self._from_stage(t) for name, t in of.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor], of: nn.Module | None = None,
                             strict: bool = True) -> None:
        """Load whole tensors (a gathered or one process's state dict): each rank keeps its stages'."""
        dropped = {id(p) for p in self.dropped}
        load_whole_tensors(self.module if of is None else of, state, strict, lambda t, whole: None,
                           holds=lambda t: id(t) not in dropped)

    @torch.no_grad()
    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict with every parameter's state, from the rank of its stage: what the same
        optimizer holds in one process (loadable by `load_full_optimizer_state_dict` under another layout)."""
        state_dict = optimizer.state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        mine = {index: {k: _TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
                        for k, v in entry.items()}
                for index, entry in state_dict["state"].items() if self.owner[id(params[index])] == self.stage_rank}
        layouts: list[dict] = [{} for _ in range(self.pp)]
        dist.all_gather_object(layouts, mine, group=self.pp_group)  # which state each stage's rank holds
        state = {}
        for owner, layout in enumerate(layouts):
            src = self.pipeline_ranks[owner]
            for index, entry in layout.items():
                local = state_dict["state"].get(index, {})
                state[index] = {k: self._broadcast(local.get(k), src, self.pp_group, spec).cpu()
                                if isinstance(spec, _TensorSpec) else spec for k, spec in entry.items()}
        return {**state_dict, "state": dict(sorted(state.items()))}

    @torch.no_grad()
    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Load a whole optimizer state dict: each rank keeps its stages' parameters' state."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        held = {id(p) for p in self.held}
        kept = {index: entry for index, entry in state_dict["state"].items() if id(params[int(index)]) in held}
        optimizer.load_state_dict({**state_dict, "state": kept})
