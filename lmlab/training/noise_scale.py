"""The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"):
B_simple = tr(Sigma) / |G|^2, the batch size (here in tokens) beyond which a larger batch mostly buys
less noise rather than more progress per step; the critical batch size tracks it.

Both quantities come from squared gradient norms at two batch sizes. A mean gradient over B examples has
E|g_B|^2 = |G|^2 + tr(Sigma) / B, so with a small batch (one micro-batch, before the others accumulate
and before ranks reduce) and the big one (the whole step's gradient):

    |G|^2     ~ (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|g_small|^2 - |g_big|^2) / (1 / B_small - 1 / B_big)

Each step's estimates are noisy (either can come out negative), so their exponential moving averages are
divided, as the paper does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class NoiseScale:
    small_batch: float  # tokens in the small batch (one micro-batch on one rank)
    big_batch: float  # tokens in the step's batch (all micro-batches and ranks)
    decay: float = 0.95  # of the moving averages
    _grad_sq: float = 0.0  # moving average of the |G|^2 estimates
    _trace: float = 0.0  # moving average of the tr(Sigma) estimates (the ratio needs no bias correction)

    def __post_init__(self) -> None:
        if not 0 < self.small_batch < self.big_batch:
            raise ValueError(f"the small batch ({self.small_batch}) must be smaller than the big one ({self.big_batch})")

    def update(self, small_sq_norm: float, big_sq_norm: float) -> float:
        """Add one step's squared gradient norms; returns the current B_simple (nan until |G|^2 > 0)."""
        b_small, b_big = self.small_batch, self.big_batch
        grad_sq = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
        trace = (small_sq_norm - big_sq_norm) / (1 / b_small - 1 / b_big)
        self._grad_sq = self.decay * self._grad_sq + (1 - self.decay) * grad_sq
        self._trace = self.decay * self._trace + (1 - self.decay) * trace
        return self._trace / self._grad_sq if self._grad_sq > 0 else math.nan
