"""Collective-communication helpers: the four collectives data parallelism is built from, their
bandwidth formulas, a timer, broadcasting a module's weights and averaging gradients over the ranks.

Bandwidth follows nccl-tests' conventions. `size` is the bytes of the whole buffer (for
all-gather the gathered output, for reduce-scatter the input), and

    algbw = size / time
    busbw = algbw * factor(n)       n = world size

The factor turns algbw into the rate each rank's link must carry under an optimal ring
algorithm, so busbw is comparable across collectives and world sizes and can be held against the
link's peak:
    all_reduce      2 (n-1)/n   a reduce-scatter then an all-gather, each moving (n-1)/n of the buffer
    reduce_scatter    (n-1)/n   each rank receives n-1 of the n chunks
    all_gather        (n-1)/n
    broadcast         1         every byte crosses each link of the ring (pipelined) once
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lmlab.timing import median_time

BYTES_PER_ELEMENT = 4  # the benchmark moves float32

# torch 2.13 renamed the two single-tensor collectives; older supported releases only have the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Collective:
    """One collective: its bus-bandwidth factor, how to allocate its tensors, and the call itself."""

    bus_factor: Callable[[int], float]  # world size -> busbw / algbw
    buffers: Callable[[int, int, torch.device], tuple[torch.Tensor, ...]]  # (numel, world size, device)
    run: Callable[..., object]  # called with the buffers


def _zeros(numel: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, device=device)  # zeros: repeated sums never overflow


COLLECTIVES: dict[str, Collective] = {
    "all_reduce": Collective(lambda n: 2 * (n - 1) / n,
                             lambda numel, n, device: (_zeros(numel, device),),
                             lambda t: dist.all_reduce(t)),
    "reduce_scatter": Collective(lambda n: (n - 1) / n,
                                 lambda numel, n, device: (_zeros(numel // n, device), _zeros(numel, device)),
                                 lambda out, inp: reduce_scatter_single(out, inp)),
    "all_gather": Collective(lambda n: (n - 1) / n,
                             lambda numel, n, device: (_zeros(numel, device), _zeros(numel // n, device)),
                             lambda out, inp: all_gather_single(out, inp)),
    "broadcast": Collective(lambda n: 1.0,
                            lambda numel, n, device: (_zeros(numel, device),),
                            lambda t: dist.broadcast(t, src=0)),
}


def _collective(op: str) -> Collective:
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective '{op}'; use one of: {', '.join(COLLECTIVES)}")
    return COLLECTIVES[op]


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw of collective `op` among `world_size` ranks (see the module docstring)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return _collective(op).bus_factor(world_size)


def algorithm_bandwidth(nbytes: int, seconds: float) -> float:
    """Bytes per second of the whole buffer."""
    return nbytes / seconds


def bus_bandwidth(op: str, nbytes: int, seconds: float, world_size: int) -> float:
    """Bytes per second each rank's link carries, under an optimal ring algorithm."""
    return algorithm_bandwidth(nbytes, seconds) * bus_factor(op, world_size)


@dataclass
class CommResult:
    op: str
    nbytes: int  # the whole buffer, rounded so that it splits evenly among the ranks
    seconds: float  # median of the repeats; the slowest rank's
    algbw: float  # bytes / s
    busbw: float  # bytes / s


def time_collective(op: str, nbytes: int, device: torch.device, repeats: int = 10, warmup: int = 3) -> CommResult:
    """Time collective `op` on a float32 buffer of about `nbytes`; every rank of the group must call it.

    Each rank takes the median of `repeats` calls after `warmup`; the reported time is the largest
    of the ranks' medians, since a collective is done only when its slowest rank is.
    """
    collective, world_size = _collective(op), dist.get_world_size()
    chunk = max(1, -(-nbytes // (BYTES_PER_ELEMENT * world_size)))  # elements per rank, rounded up
    numel = chunk * world_size
    buffers = collective.buffers(numel, world_size, device)
    seconds, _ = median_time(lambda: collective.run(*buffers), repeats, warmup)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds, nbytes = slowest.item(), numel * BYTES_PER_ELEMENT
    return CommResult(op, nbytes, seconds, algorithm_bandwidth(nbytes, seconds),
                      bus_bandwidth(op, nbytes, seconds, world_size))


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with rank `src`'s, so all replicas start equal.

    Parameters that are frozen are included: they take part in the forward pass all the same.
    """
    for tensor in [*module.parameters(), *module.buffers()]:  # parameters() lists a shared one once
        dist.broadcast(tensor.detach(), src=src)


@torch.no_grad()
def average_gradients(params: list[torch.Tensor], group=None) -> None:
    """Replace each parameter's gradient by its mean over the ranks of `group` (default: all), in one flat all-reduce.

    A parameter that got no gradient on some ranks (a branch their data did not take) counts as a zero gradient
    there; one that got none on any rank keeps `.grad` None, as in one process, so the optimizer skips it the same
    way. Which ranks have a gradient travels in the same buffer, so every rank makes the same single call.
    """
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=grads[0].dtype, device=grads[0].device)
    flat = torch.cat([*(g.flatten() for g in grads), has_grad])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    anywhere = (flat[-len(params):] > 0).tolist()
    offset = 0
    for p, grad, used in zip(params, grads, anywhere):
        if used:
            p.grad = grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def own_group(groups: list[list[int]], rank: int):
    """Make a process group of each list of ranks (every rank must make all of them, in the same order) and return
    the one that holds `rank`."""
    made = [dist.new_group(ranks) for ranks in groups]
    return next(group for group, ranks in zip(made, groups) if rank in ranks)


@torch.no_grad()
def load_whole_tensors(module: nn.Module, state: dict[str, torch.Tensor], strict: bool,
                       local_part: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None],
                       holds: Callable[[torch.Tensor], bool] = lambda t: True) -> None:
    """Copy whole tensors (a gathered or unsharded state dict) into a sharding wrapper's module: each of its
    tensors t takes `local_part(t, whole)`, the rows this rank holds, or the whole tensor where that is None;
    tensors the rank does not hold at all (`holds(t)` false: another pipeline stage's) are left alone."""
    current = module.state_dict(keep_vars=True)
    if strict and (missing := current.keys() ^ state.keys()):
        raise KeyError(f"the state dict and the model disagree on keys: {sorted(missing)[:5]}")
    for name, t in current.items():
        if name in state and holds(t):
            whole = state[name].to(t.device)
            part = local_part(t, whole)
            t.data.copy_(whole if part is None else part)


def map_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict,
                        convert: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]) -> dict:
    """`state_dict` (of `optimizer`, or one to load into it) with each state tensor v of parameter p replaced by
    `convert(p, v)`, or kept where that is None: how sharding wrappers make state whole and slice it again."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in state_dict["state"].items():
        p = params[int(index)]
        state[index] = {k: v if not isinstance(v, torch.Tensor) or (new := convert(p, v)) is None else new
                        for k, v in entry.items()}
    return {**state_dict, "state": state}
