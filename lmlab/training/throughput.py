"""Training throughput (tokens/s) as a Lightning callback; validation time is excluded."""

from __future__ import annotations

import time

import lightning as L
import torch


class Throughput(L.Callback):
    """Logs `perf/tokens_per_s` over the wall time between consecutive training batches."""

    def __init__(self, log_every: int):
        self.log_every = log_every
        self._tokens = 0
        self._seconds = 0.0
        self._last: float | None = None
        self.last_tokens_per_s: float | None = None

    def _now(self, module: L.LightningModule) -> float:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self._last is None:
            self._last = self._now(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = self._now(module)
        self._seconds += now - self._last
        self._last = now
        self._tokens += batch[0].numel() * trainer.world_size
        if trainer.global_step % self.log_every == 0 and self._seconds > 0:
            self.last_tokens_per_s = self._tokens / self._seconds
            module.log("perf/tokens_per_s", self.last_tokens_per_s)
            self._tokens, self._seconds = 0, 0.0

    def on_validation_start(self, trainer, module) -> None:
        self._last = None  # restart the clock after validation so it is not counted
