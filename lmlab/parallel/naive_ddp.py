"""Data parallelism in its plainest form: one all-reduce per gradient, after backward.

    model = NaiveDDP(model)            # every rank now holds rank 0's weights
    loss = loss_fn(model(x_shard), y_shard)      # a mean over the rank's shard
    loss.backward()
    model.finish_gradient_synchronization()      # every .grad is now the mean over ranks
    optimizer.step()

With equal shards and a mean loss, the mean of the ranks' gradients is the gradient of the mean
loss over the whole batch, so every rank takes the step a single process would take on the
concatenated batch, and the replicas stay equal without ever sending weights again.

Nothing overlaps here: communication starts only after backward has finished, one tensor at a
time. BucketedDDP is the version that hides it behind backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmlab.parallel.comm import broadcast_module


class NaiveDDP(nn.Module):
    """Wraps a module for data parallelism; call `finish_gradient_synchronization()` after backward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        broadcast_module(module)
        # parameters() lists a tied weight once, so it is reduced once, with its summed gradient.
        self._params = [p for p in module.parameters() if p.requires_grad]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into .grad (nothing communicates during backward here anyway):
        skip finish_gradient_synchronization after them, and call it once after the last micro-batch."""
        yield

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Replace each gradient by its mean over the ranks.

        A parameter that got no gradient on some ranks (a branch their data did not take) counts
        as a zero gradient there; one that got none on any rank keeps `.grad` untouched, as it
        would in a single process, so the optimizer skips it the same way.
        """
        if not self._params:
            return
        # Which ranks have a gradient is agreed first: every rank must make the same calls, in
        # the same order, or the collectives pair up wrongly and hang.
        present = torch.tensor([p.grad is not None for p in self._params], dtype=torch.float32,
                               device=self._params[0].device)
        dist.all_reduce(present)
        for p, ranks_with_grad in zip(self._params, present.tolist()):
            if ranks_with_grad == 0:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(self.world_size)
