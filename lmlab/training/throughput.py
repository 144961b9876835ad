"""Training throughput (tokens/s, and MFU on known GPUs) as a Lightning callback.

Validation time is excluded.
"""

from __future__ import annotations

import time

import lightning as L
import torch

from lmlab.parallel.strategies import data_parallel_rank
from lmlab.training.hardware import peak_flops
from lmlab.training.progress import is_log_step


class Throughput(L.Callback):
    """Logs `perf/tokens_per_s` over the wall time between consecutive training batches, and
    `perf/mfu` (achieved model FLOP/s over the device's bf16 peak) where the peak is known."""

    def __init__(self, log_every: int, flops_per_token: float):
        self.log_every = log_every
        self.flops_per_token = flops_per_token
        self._peak: float | None = None
        self._tokens = 0
        self._seconds = 0.0
        self._last: float | None = None
        self._logged_step = 0
        self.last_tokens_per_s: float | None = None

    def _now(self, module: L.LightningModule) -> float:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)
        return time.perf_counter()

    def on_fit_start(self, trainer, module) -> None:
        self._peak = peak_flops(module.device)
        self._logged_step = trainer.global_step

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self._last is None:
            self._last = self._now(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = self._now(module)
        self._seconds += now - self._last
        self._last = now
        self._tokens += batch[0].numel() * data_parallel_rank(trainer)[1]  # ranks of a tensor-parallel group share rows
        step = trainer.global_step
        # With gradient accumulation several batches end at one step: log once, after its optimizer step. The last
        # step logs the window since the previous figure.
        if is_log_step(step, self.log_every, trainer.max_steps) and step > self._logged_step and self._seconds > 0:
            self._logged_step = step
            self.last_tokens_per_s = self._tokens / self._seconds
            module.log("perf/tokens_per_s", self.last_tokens_per_s)
            if self._peak:
                per_device = self.last_tokens_per_s / trainer.world_size
                module.log("perf/mfu", per_device * self.flops_per_token / self._peak)
            self._tokens, self._seconds = 0, 0.0

    def on_train_end(self, trainer, module) -> None:
        # A run shorter than one logging window still gets a figure for its summary (not logged).
        if self.last_tokens_per_s is None and self._seconds > 0:
            self.last_tokens_per_s = self._tokens / self._seconds

    def on_validation_start(self, trainer, module) -> None:
        self._last = None  # restart the clock after validation so it is not counted
