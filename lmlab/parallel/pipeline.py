"""Pipeline parallelism: a Transformer's layers cut into consecutive stages, run over micro-batches by
torch.distributed.pipelining's schedules.

Stage s of S holds a contiguous run of layers (the first also embeds the token ids; the last also holds the
final norm and the output head). A rank runs one stage, or with an interleaved schedule several
(stages r, r + pp, r + 2 pp, ...: Narayanan et al. 2021, which shrinks the bubble by that factor). The
global batch is cut into micro-batches that flow through the stages:
- `gpipe` runs every forward, then every backward: simple, and it holds all micro-batches' activations.
- `1f1b` alternates one forward with one backward once the pipe is full, so a stage holds at most pp
  micro-batches' activations (PipeDream-Flush).
- `interleaved_1f1b` is 1F1B over several stages per rank.

Gradients are those of the mean loss over the micro-batches (the schedule scales them), so a step equals one
process's on the whole batch. A tied embedding and head would live on different stages: the plan refuses it.

Every weight sits on exactly one stage (`stage_owners`), so a rank can drop the others' weights. `lmlab-train
parallel=nd parallel.pp=N` trains this way, composed with data parallelism (lmlab.parallel.pipeline_parallel);
`lmlab bench parallel` times one step of it (lmlab.parallel.bench).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmlab.errors import ConfigError


def schedules() -> dict[str, type]:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


INTERLEAVED = {"interleaved_1f1b"}


class Stage(nn.Module):
    """Layers [first, last) of an lmlab Transformer, with the embedding on the first stage and the final norm
    and head on the last. It shares the Transformer's modules (no copies)."""

    def __init__(self, model: nn.Module, first: int, last: int, n_layers: int):
        super().__init__()
        if first == 0:
            self.position = model.position
        else:  # a plain reference, not a submodule: only the first stage embeds, so learned positions' weights sit
            object.__setattr__(self, "position", model.position)  # there alone; later stages read its tables (rope)
        self.embed_tokens = model.embed_tokens if first == 0 else None
        self.layers = nn.ModuleList(model.layers[first:last])
        is_last = last == n_layers
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self._logits = model._head if is_last else None  # the head with muP's multiplier and soft-capping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        if self.embed_tokens is not None:
            x = self.position.embed(self.embed_tokens(x), positions)
        for layer in self.layers:
            x = layer(x, self.position, positions)
        return x if self._logits is None else self._logits(self.norm(x))


def problems(model: nn.Module, n_stages: int) -> list[str]:
    """Why `model` cannot be cut into `n_stages` stages; empty if it can."""
    found = []
    if n_stages > len(model.layers):
        found.append(f"{n_stages} pipeline stages for {len(model.layers)} layers (each stage needs one)")
    if model.lm_head.weight is model.embed_tokens.weight:
        found.append("model.tie_embeddings=true: the embedding and the head sit on the first and last stages")
    if len(model.mtp_layers):
        found.append("model.mtp.depth > 0: multi-token prediction modules are not staged")
    if getattr(model, "_moe_names", None):
        found.append("MoE layers: their auxiliary losses do not travel between stages")
    elif getattr(model, "_loss_modules", None):
        found.append("auxiliary losses (sparse attention's indexer): they do not travel between stages")
    if getattr(model, "loops", 1) > 1:
        found.append("model.loops > 1: a looped stack would run through every stage again")
    if any(getattr(layer.self_attn, "kv_source", None) is not None for layer in model.layers):
        found.append("model.kv_share > 1: a layer reads an earlier layer's keys and values, which may sit on another stage")
    return found


def plan_problems(schedule: str, pp: int, stages_per_rank: int, n_microbatches: int) -> list[str]:
    """Why `schedule` cannot run `n_microbatches` micro-batches over `pp` ranks of `stages_per_rank` stages each;
    empty if it can. Named by lmlab-train's fields (parallel.pp_*)."""
    kinds = schedules()
    found = []
    if schedule not in kinds:
        found.append(f"parallel.pp_schedule={schedule} is not one of {', '.join(kinds)}")
    elif (stages_per_rank > 1) != (schedule in INTERLEAVED):
        found.append(f"parallel.pp_schedule={schedule} with parallel.pp_stages_per_rank={stages_per_rank}: interleaved "
                     "schedules take 2 or more stages per rank, the others 1")
    if n_microbatches < pp:
        found.append(f"parallel.pp_microbatches={n_microbatches} for parallel.pp={pp} leaves stages idle; use >= {pp}")
    elif schedule in INTERLEAVED and n_microbatches % (rounds := max(1, n_microbatches // pp)):
        found.append(f"parallel.pp_microbatches={n_microbatches}: {schedule} runs them in {rounds} rounds, so it needs "
                     f"a multiple of {rounds} (a multiple of parallel.pp={pp} always works)")
    return found


def stage_bounds(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as equal as the count allows (earlier stages take the extra layers)."""
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        end = start + base + (s < extra)
        bounds.append((start, end))
        start = end
    return bounds


def build_pipeline(model: nn.Module, rank: int, pp: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   n_microbatches: int, schedule: str = "1f1b", stages_per_rank: int = 1,
                   device: torch.device | None = None, group=None):
    """This rank's stages of `model` and the schedule that runs them. `schedule.step(ids)` on the first rank,
    `schedule.step(target=targets, losses=[])` on the last (both on a one-rank pipe), `schedule.step()` between;
    then the stages' parameters hold the step's gradients."""
    from torch.distributed.pipelining import PipelineStage

    n_stages = pp * stages_per_rank
    found = plan_problems(schedule, pp, stages_per_rank, n_microbatches) or problems(model, n_stages)
    if found:
        raise ConfigError("pipeline parallelism: " + "; ".join(found))
    device = device or next(model.parameters()).device
    every = all_stages(model, n_stages)
    stages = [PipelineStage(every[index], index, n_stages, device, group=group) for index in range(rank, n_stages, pp)]
    kind = schedules()[schedule]
    if schedule in INTERLEAVED:
        return stages, kind(stages, n_microbatches, loss_fn=loss_fn)
    return stages, kind(stages[0], n_microbatches, loss_fn=loss_fn)


def all_stages(model: nn.Module, n_stages: int) -> list[Stage]:
    """Every stage of `model`, in order (modules that share the model's weights: cheap to make)."""
    n_layers = len(model.layers)
    return [Stage(model, first, last, n_layers) for first, last in stage_bounds(n_layers, n_stages)]


def stage_owners(model: nn.Module, pp: int, stages_per_rank: int = 1) -> dict[int, int]:
    """id(tensor) -> the pipeline rank whose stages hold it (stage s runs on rank s % pp), for every parameter and
    every buffer of a stage. Every parameter sits on exactly one rank's stages."""
    owners: dict[int, int] = {}
    for index, stage in enumerate(all_stages(model, pp * stages_per_rank)):
        for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
            if owners.setdefault(id(t), index % pp) != index % pp:
                raise ValueError(f"{name} sits on the stages of two pipeline ranks")
    if missing := [name for name, p in model.named_parameters() if id(p) not in owners]:
        raise ValueError(f"parameters on no pipeline stage: {', '.join(missing[:3])}")
    return owners
