"""trainer.precision: Lightning's names, resolved for this machine, and what lmlab adds for 16-bit weights.

`bf16-mixed` (the default on a GPU) keeps float32 weights and runs the matmuls under autocast; `bf16-true` stores
the weights, gradients and Adam's moments in bf16 (Lightning's HalfPrecision casts the module), halving their
memory and traffic. Adam then rounds its bf16 writes stochastically (lmlab.optim.stochastic_rounding) so small
updates are not lost.
"""

from __future__ import annotations

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

# Lightning's precisions that store the weights themselves in 16 bits
HALF_WEIGHTS = ("bf16-true", "16-true")


def resolve_precision(precision: str) -> str:
    """trainer.precision's `auto`: bf16-mixed on a GPU, 32-true on a CPU."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if torch.cuda.is_available() else "32-true"


def precision_plugin(precision: str, device: torch.device) -> Precision:
    """Lightning's plugin for a resolved precision among bf16-true, 16-true, bf16-mixed and 32-true, for code that
    trains without a Trainer (the bench) as lmlab-train's Trainer would."""
    if precision in HALF_WEIGHTS:
        return HalfPrecision(precision)
    if precision.endswith("-mixed"):
        return MixedPrecision(precision, device.type)
    return Precision()


class Float32Metrics(L.Callback):
    """Keep every torchmetrics state in float32 under a 16-bit-weights precision: the module's cast takes the
    metrics' states along, and a validation loss summed in bf16 reads in steps of 1/32 near 6."""

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for metric in pl_module.modules():
            if isinstance(metric, torchmetrics.Metric) and any(
                    isinstance(state, torch.Tensor) and state.dtype in (torch.bfloat16, torch.float16)
                    for state in metric.metric_state.values()):
                metric.set_dtype(torch.float32)
