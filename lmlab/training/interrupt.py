"""Stopping a run on Ctrl-C (SIGINT) or SIGTERM (what SLURM and most schedulers send before they kill
or preempt a job) without losing its work.

The signal only raises a flag. At the end of the optimizer step in progress the ranks agree (one
all-reduce) that some rank saw it, every rank takes part in saving `checkpoints/last.ckpt` (sharded
strategies gather collectively), and the run ends with `RunInterrupted`, whose message says where
the checkpoint is. Stopping at a step boundary keeps weights, optimizer state and step counter
consistent, so the resumed run continues exactly. A second Ctrl-C stops at once, without saving.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import lightning as L

from lmlab.errors import STOP_SIGNALS, RunInterrupted

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop(L.Callback):
    def __init__(self, checkpoint_path: Path, max_steps: int):
        self.checkpoint_path = checkpoint_path
        self.max_steps = max_steps
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._checked_step = -1

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._checked_step = trainer.global_step
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        if getattr(trainer, "received_sigterm", False):  # Lightning's own handler took it while the run set up
            self._take(signal.SIGTERM)

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            self._restore()
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self._take(signal.Signals(signum))

    def _take(self, signum: signal.Signals) -> None:
        self.received = signum
        STOP_SIGNALS.append(signum)
        log.warning("%s received: stopping after this step and saving a checkpoint (Ctrl-C again to stop at once)",
                    self.received.name)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._checked_step:  # mid-accumulation: the step is not finished
            return
        self._checked_step = trainer.global_step
        stop = trainer.strategy.reduce_boolean_decision(self.received is not None, all=False)
        if not stop or trainer.global_step >= self.max_steps:  # the last step ends the run normally anyway
            return
        trainer.save_checkpoint(self.checkpoint_path, weights_only=False)  # the full state, to resume from
        name = (self.received or signal.SIGTERM).name  # a rank that saw no signal stops because a peer did
        raise RunInterrupted(f"stopped by {name} after step {trainer.global_step} of {self.max_steps}; "
                             f"checkpoint saved to {self.checkpoint_path}",
                             128 + (self.received or signal.SIGTERM).value)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
