"""`lmlab-train profile=true`: a torch.profiler record of a few training steps, in the run folder.

Steps after the first few are profiled (the first ones compile, tune kernels and warm the
caching allocator), then two files are written: `profile.txt`, the operators and kernels that
took the most device time (CPU time on a machine without a GPU), and `trace.json`, a Chrome
trace to open in chrome://tracing or https://ui.perfetto.dev.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)


def profiler_for(device: torch.device) -> profile:
    """A torch.profiler that records the CPU's operators and, on a GPU, its kernels."""
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))


class StepProfiler(L.Callback):
    def __init__(self, output_dir: Path, max_steps: int, skip: int = 5, steps: int = 3, rows: int = 30):
        self.output_dir = Path(output_dir)
        self.steps = min(steps, max_steps)
        self.skip = max(0, min(skip, max_steps - self.steps))  # a short run still gets its last steps profiled
        self.rows = rows
        self._profiler: profile | None = None
        self._first = 0  # the global step the profile started at
        self._done = False

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self._profiler is None and not self._done and trainer.is_global_zero and trainer.global_step >= self.skip:
            self._profiler = profiler_for(module.device)
            self._profiler.start()
            self._first = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self._profiler is not None and trainer.global_step - self._first >= self.steps:
            self._finish(module)

    def on_train_end(self, trainer, module) -> None:
        if self._profiler is not None:
            self._finish(module)

    def _finish(self, module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)
        prof, self._profiler, self._done = self._profiler, None, True
        prof.stop()
        sort_by = "device_time_total" if module.device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=self.rows)
        (self.output_dir / "profile.txt").write_text(table + "\n")
        prof.export_chrome_trace(str(self.output_dir / "trace.json"))
        log.info("profile of %d training steps: %s and %s", self.steps, self.output_dir / "profile.txt",
                 self.output_dir / "trace.json")
