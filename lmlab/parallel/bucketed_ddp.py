"""Data parallelism whose gradient all-reduces run while backward is still computing.

    model = BucketedDDP(model, bucket_size_mb=25)
    loss.backward()                              # buckets are all-reduced as they fill
    model.finish_gradient_synchronization()      # waits, then writes the means into .grad
    optimizer.step()

Backward produces gradients roughly in reverse order of registration (the last layer first), so
the parameters are packed in that order into buckets of about `bucket_size_mb`. A hook on each
parameter copies its gradient into its bucket's flat buffer the moment it is accumulated; when a
bucket's last gradient arrives, one asynchronous all-reduce of the whole buffer starts and
backward carries on with the layers below. Buckets trade the two costs of a collective: one per
tensor pays the per-call latency many times, one for the whole model cannot start until backward
has ended.

Every rank must issue the same all-reduces in the same order, or they pair up wrongly. So buckets
start strictly in bucket order: a bucket that is full waits for the ones before it.

A parameter may get no gradient on some ranks in a step (a branch their data did not take). Its
slot then holds zeros, and each bucket carries, after the gradients, one counter per parameter:
how many ranks produced its gradient. The counters are summed by the same all-reduce, so every
rank learns which parameters no rank touched and leaves their `.grad` as it was, as a single
process would. Such buckets start in `finish_gradient_synchronization()` instead of during backward.

Gradient accumulation: run the backward passes of all but the last micro-batch inside
`no_sync()`; the hooks then only note which parameters got a gradient, and the last backward
sends the accumulated sums (a parameter that only the earlier micro-batches reached is sent
from `finish_gradient_synchronization()`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmlab.parallel.comm import broadcast_module

MB = 2**20


@dataclass
class Bucket:
    """Parameters whose gradients travel in one all-reduce, and the flat buffer they travel in."""

    params: list[nn.Parameter]
    buffer: torch.Tensor  # the gradients, flattened one after another, then one counter per parameter
    offsets: list[int]  # where each parameter's gradient starts in `buffer`
    arrived: list[bool] = field(init=False)  # this step: which gradients this rank has copied in
    accumulated: list[bool] = field(init=False)  # this step: which got a gradient inside no_sync()
    work: dist.Work | None = None  # the running all-reduce, once started

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.arrived = [False] * len(self.params)
        self.accumulated = [False] * len(self.params)
        self.work = None

    @property
    def numel(self) -> int:
        return self.offsets[-1] + self.params[-1].numel()

    def grad_slot(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    @property
    def counters(self) -> torch.Tensor:
        return self.buffer[self.numel:]

    @property
    def full(self) -> bool:
        return all(self.arrived)


def make_buckets(params: Iterable[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Consecutive parameters packed into buckets of at most `bucket_bytes` (a larger parameter
    gets a bucket of its own); a bucket holds one dtype on one device, as its buffer must."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = groups[-1][-1] if groups else None
        if last is None or size + nbytes > bucket_bytes or (last.dtype, last.device) != (p.dtype, p.device):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    buckets = []
    for group in groups:
        offsets = [0]
        for p in group[:-1]:
            offsets.append(offsets[-1] + p.numel())
        numel = offsets[-1] + group[-1].numel()
        buffer = torch.zeros(numel + len(group), dtype=group[0].dtype, device=group[0].device)
        buckets.append(Bucket(group, buffer, offsets))
    return buckets


class BucketedDDP(nn.Module):
    """Wraps a module for data parallelism with bucketed all-reduces that overlap backward;
    call `finish_gradient_synchronization()` after backward."""

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0):
        super().__init__()
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        self.module = module
        self.world_size = dist.get_world_size()
        broadcast_module(module)
        # parameters() lists a tied weight once: one hook, fired once with the summed gradient.
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = make_buckets(reversed(params), int(bucket_size_mb * MB))
        self._slot = {p: (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self._names = {p: name for name, p in module.named_parameters()}
        self._next = 0  # the next bucket to start: buckets start in order on every rank
        self._sync = True
        self._started_in_backward = 0
        self.overlapped_buckets = 0  # of the last step: buckets whose all-reduce started during backward
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into .grad; the first one after sends the sums."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @torch.no_grad()
    def _on_gradient(self, p: nn.Parameter) -> None:
        b, i = self._slot[p]
        bucket = self.buckets[b]
        if not self._sync:
            bucket.accumulated[i] = True
            return
        if bucket.arrived[i]:
            raise RuntimeError(f"parameter '{self._names[p]}' got a second gradient before "
                               "finish_gradient_synchronization(); call it after every backward, or run the "
                               "backward passes of accumulated micro-batches but the last inside no_sync()")
        bucket.grad_slot(i).copy_(p.grad)
        bucket.arrived[i] = True
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._start(self.buckets[self._next])
            self._started_in_backward += 1

    def _start(self, bucket: Bucket) -> None:
        for i, p in enumerate(bucket.params):
            if bucket.arrived[i]:
                continue
            if bucket.accumulated[i]:  # its gradient came from micro-batches inside no_sync() only
                bucket.grad_slot(i).copy_(p.grad)
                bucket.arrived[i] = True
            else:
                bucket.grad_slot(i).zero_()  # this rank adds nothing to the sum
        # From pinned memory, without blocking: a copy from pageable memory would wait for the GPU
        # to drain, once per bucket, in the middle of backward.
        arrived = torch.tensor(bucket.arrived, dtype=bucket.buffer.dtype, pin_memory=bucket.buffer.is_cuda)
        bucket.counters.copy_(arrived, non_blocking=True)
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        self._next += 1

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Start the buckets backward left waiting, wait for all, and set each .grad to the mean over ranks."""
        if not self._sync:
            raise RuntimeError("finish_gradient_synchronization() inside no_sync(): gradients are only being "
                               "accumulated there; call it after the last micro-batch's backward, outside no_sync()")
        for bucket in self.buckets[self._next:]:
            self._start(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.buffer[:bucket.numel].div_(self.world_size)
        # One read of every bucket's counters: a read per bucket would stall the host once per bucket.
        counts = iter(torch.cat([bucket.counters for bucket in self.buckets]).tolist())
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if next(counts) == 0:  # no rank's data reached it: leave .grad as a single process would
                    continue
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(bucket.grad_slot(i))
            bucket.reset()
        self._next = 0
        self.overlapped_buckets, self._started_in_backward = self._started_in_backward, 0
