"""Sampling language-modelling batches from a 1-D token array."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset


def get_batch(
    tokens: np.ndarray | torch.Tensor,
    batch_size: int,
    context_length: int,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    rows: slice = slice(None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs (batch, context) and the targets shifted one token to the left.

    `rows` keeps part of the batch (a data-parallel rank's share); the draw is the whole batch's,
    so the shares of all ranks together are exactly the batch one process would get."""
    n = len(tokens)
    if n <= context_length:
        raise ValueError(f"{n} tokens cannot hold a window of context_length={context_length} plus one target")
    starts = torch.randint(0, n - context_length, (batch_size,), generator=generator)
    return _windows(tokens, starts[rows], context_length, device)


def _windows(tokens, starts: torch.Tensor, context_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = np.arange(context_length + 1)
    if isinstance(tokens, torch.Tensor):
        windows = tokens[starts[:, None] + torch.from_numpy(offsets)].long()
    else:
        windows = torch.from_numpy(np.asarray(tokens[starts.numpy()[:, None] + offsets]).astype(np.int64))
    device = torch.device(device)
    if device.type == "cuda":
        windows = windows.pin_memory().to(device, non_blocking=True)
    else:
        windows = windows.to(device)
    return windows[:, :-1], windows[:, 1:]


class RandomWindows(IterableDataset):
    """An endless stream of `get_batch` batches; batch i depends only on (seed, i).

    Starting from `start_step` makes a resumed run draw exactly the batches the uninterrupted
    run would have drawn. With `world_size` > 1, rank r gets the r-th of `world_size` equal
    slices of each batch, so `batch_size` is the global batch whatever the number of ranks. With
    `micro_batches` > 1 (gradient accumulation) each rank's slice comes as that many equal parts
    in a row: the optimizer step still sees exactly the same global batch.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, context_length: int, seed: int, start_step: int = 0,
                 rank: int = 0, world_size: int = 1, micro_batches: int = 1):
        if batch_size % (world_size * micro_batches):
            raise ValueError(f"data.batch_size={batch_size} is not divisible by {world_size} data-parallel ranks x "
                             f"{micro_batches} micro-batches")
        self.tokens, self.batch_size, self.context_length = tokens, batch_size, context_length
        self.seed, self.start_step = seed, start_step
        share = batch_size // world_size
        part = share // micro_batches
        self.parts = [slice(rank * share + i * part, rank * share + (i + 1) * part) for i in range(micro_batches)]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator()
        step = self.start_step
        while True:
            for rows in self.parts:  # each part redraws the step's batch (cheap) and keeps its rows
                generator.manual_seed(self.seed * 1_000_003 + step)
                yield get_batch(self.tokens, self.batch_size, self.context_length, generator=generator, rows=rows)
            step += 1


def evenly_spaced_windows(tokens: np.ndarray, count: int, context_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed set of up to `count` windows spread over `tokens` (for validation)."""
    last_start = len(tokens) - context_length - 1
    if last_start < 0:
        raise ValueError(f"{len(tokens)} tokens cannot hold a window of context_length={context_length} plus one target")
    count = min(count, last_start // context_length + 1)
    # integer steps: float32 linspace rounds starts past 2^24 tokens, up to beyond the last one
    starts = torch.arange(count) * last_start // max(count - 1, 1)
    return _windows(tokens, starts, context_length, "cpu")
