"""Skipping optimizer steps that would damage the model: a non-finite loss or gradient norm, or a
spike of either far above its recent median. A skipped step leaves every parameter and every
optimizer state untouched; the run counts and logs how many it skipped."""

from __future__ import annotations

import math
import statistics
from collections import deque

from lmlab.errors import ConfigError

MIN_HISTORY = 10  # steps of history before a spike can be judged


class StepGuard:
    def __init__(self, skip_nonfinite: bool, spike_factor: float | None, window: int):
        if spike_factor is not None and not spike_factor > 1:
            raise ConfigError(f"trainer.spike_factor must be > 1 (or null to turn spike skipping off), got {spike_factor}")
        if window < MIN_HISTORY:
            raise ConfigError(f"trainer.spike_window must be >= {MIN_HISTORY}, got {window}")
        self.skip_nonfinite = skip_nonfinite
        self.spike_factor = spike_factor
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)
        self.skipped = 0

    @property
    def active(self) -> bool:
        return self.skip_nonfinite or self.spike_factor is not None

    def reason_to_skip(self, loss: float, grad_norm: float) -> str | None:
        """Why this step should be skipped, or None to take it (and remember its loss and norm)."""
        reason = None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            reason = "non-finite" if self.skip_nonfinite else None
        elif self.spike_factor is not None and len(self.losses) >= MIN_HISTORY:
            if loss > self.spike_factor * statistics.median(self.losses):
                reason = "loss spike"
            elif grad_norm > self.spike_factor * statistics.median(self.norms):
                reason = "gradient-norm spike"
        if reason is None:
            self.losses.append(loss)
            self.norms.append(grad_norm)
        else:
            self.skipped += 1
        return reason

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear(), self.norms.clear()
        self.losses.extend(state["losses"]), self.norms.extend(state["norms"])
        self.skipped = state["skipped"]
