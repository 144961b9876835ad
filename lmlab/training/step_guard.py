"""Skipping optimizer steps that would damage the model: a non-finite loss or gradient norm, or a
spike of either far above its recent median. A skipped step leaves every parameter and every
optimizer state untouched; the run counts and logs how many it skipped.

Skipping must never lock a run, so three rules keep training going:
- no spike test before `warmup` steps have been seen (early training moves the loss and gradient
  norm by large factors, and the learning-rate warmup is still raising them);
- every finite value enters the running window, skipped or not, so a lasting change of level
  becomes the new median instead of being rejected for ever;
- after `max_consecutive` skipped spikes in a row the next spike is taken (a change of level, not a
  spike), with a warning, and the window restarts from those recent values; `max_consecutive` non-finite steps in a row stop the run with an error,
  since nothing can be learnt from them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from lmlab.errors import ConfigError

MIN_HISTORY = 10  # steps of history before a spike can be judged


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row: the run cannot go on."""


class StepGuard:
    def __init__(self, skip_nonfinite: bool, spike_factor: float | None, window: int, warmup: int = 0,
                 max_consecutive: int = 10):
        if spike_factor is not None and not spike_factor > 1:
            raise ConfigError(f"trainer.spike_factor must be > 1 (or null to turn spike skipping off), got {spike_factor}")
        if window < MIN_HISTORY:
            raise ConfigError(f"trainer.spike_window must be >= {MIN_HISTORY}, got {window}")
        if max_consecutive < 1:
            raise ConfigError(f"trainer.max_consecutive_skips must be >= 1, got {max_consecutive}")
        self.skip_nonfinite = skip_nonfinite
        self.spike_factor = spike_factor
        self.warmup = max(warmup, MIN_HISTORY)
        self.max_consecutive = max_consecutive
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)
        self.seen = 0  # steps judged so far
        self.skipped = 0
        self.consecutive = 0  # skipped steps in a row, up to the last one judged

    @property
    def active(self) -> bool:
        return self.skip_nonfinite or self.spike_factor is not None

    def judge(self, loss: float, grad_norm: float) -> tuple[bool, str | None]:
        """(skip this step?, why): the reason for a skip, or the note on a spike taken anyway.
        Raises TrainingDiverged after `max_consecutive` non-finite steps in a row."""
        self.seen += 1
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            if not self.skip_nonfinite:
                return False, None
            if self.consecutive + 1 >= self.max_consecutive:
                raise TrainingDiverged(
                    f"{self.consecutive + 1} steps in a row had a non-finite loss or gradient norm (last: loss {loss}, "
                    f"gradient norm {grad_norm}); the run is stopped. Resume from an earlier checkpoint with a "
                    "lower optim.lr, more sched.warmup_steps or gradient clipping (trainer.grad_clip)")
            return self._skip("non-finite")
        spike = self._spike(loss, grad_norm)
        self.losses.append(loss)
        self.norms.append(grad_norm)
        if spike is None:
            self.consecutive = 0
            return False, None
        if self.consecutive >= self.max_consecutive:
            self._rebase(self.consecutive + 1)
            return False, (f"{spike} taken: {self.max_consecutive} steps in a row were skipped, so the level has "
                           "changed for good (or trainer.spike_factor is too low)")
        return self._skip(spike)

    def _spike(self, loss: float, grad_norm: float) -> str | None:
        if self.spike_factor is None or self.seen <= self.warmup or len(self.losses) < MIN_HISTORY:
            return None
        if loss > self.spike_factor * statistics.median(self.losses):
            return "loss spike"
        if grad_norm > self.spike_factor * statistics.median(self.norms):
            return "gradient-norm spike"
        return None

    def _rebase(self, recent: int) -> None:
        """Keep only the `recent` values of the new level, so it is the median from now on."""
        for values in (self.losses, self.norms):
            kept = list(values)[-recent:]
            values.clear()
            values.extend(kept)
        self.consecutive = 0

    def _skip(self, reason: str) -> tuple[bool, str]:
        self.skipped += 1
        self.consecutive += 1
        return True, reason

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms), "skipped": self.skipped, "seen": self.seen,
                "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear(), self.norms.clear()
        self.losses.extend(state["losses"]), self.norms.extend(state["norms"])
        self.skipped = state["skipped"]
        self.seen = state.get("seen", len(self.losses))
        self.consecutive = state.get("consecutive", 0)
