"""Training losses (config group `loss`).

A loss maps logits (batch, seq, vocab) and targets to a dict of scalars: `loss` is what is
minimised, every other key is one of its terms, logged as `train/<key>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError
from lmlab.registry import Registry

LOSSES = Registry("loss", group="loss", doc="training objectives on the output logits")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float,
                  z_loss: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference: mean cross-entropy over the non-ignored rows of (N, V) logits (in float32), and
    with `z_loss` the mean squared log-normaliser logsumexp(logits)^2 over the same rows."""
    logits = logits.float()
    ce = F.cross_entropy(logits, targets, ignore_index=ignore_index, label_smoothing=label_smoothing)
    if not z_loss:
        return ce, None
    keep = targets != ignore_index
    return ce, logits[keep].logsumexp(dim=-1).pow(2).mean()


@LOSSES.register("cross_entropy")
class CrossEntropy(nn.Module):
    """Mean next-token cross-entropy in nats (float32), plus an optional z-loss on the logits."""

    @dataclass
    class Config:
        ignore_index: int = -100
        label_smoothing: float = 0.0
        z_loss: float = 0.0  # weight of mean(logsumexp(logits)^2), which keeps the softmax normaliser near 1 (PaLM)
        # Take the loss from the final hidden states with the head's matmul fused in, a (tokens x vocabulary) tile
        # at a time (lmlab.kernels.chunked_cross_entropy): the logits, and their gradient, never exist whole.
        fused_head: bool = False

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.kernel = cross_entropy  # `kernels=` may swap in a memory-light fused one

    def use_kernels(self, ops) -> None:
        if ops.cross_entropy is not None:
            self.kernel = ops.cross_entropy

    def use_vocab_parallel(self, group) -> None:
        """Logits split by vocabulary over `group` (tensor parallelism): the loss all-reduces per row instead."""
        from lmlab.parallel.vocab_parallel import vocab_parallel_cross_entropy

        if self.cfg.fused_head:
            raise ConfigError("loss.fused_head needs the whole head on each rank; parallel.tp > 1 splits it by "
                              "vocabulary. Set loss.fused_head=false")
        self.kernel = partial(vocab_parallel_cross_entropy, group=group)

    @property
    def takes_hidden(self) -> bool:
        """Whether the loss wants the final hidden states and the head (`from_hidden`) instead of logits."""
        return self.cfg.fused_head

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        return self._terms(*self.kernel(logits.flatten(0, -2), targets.flatten(), cfg.ignore_index,
                                         cfg.label_smoothing, bool(cfg.z_loss)))

    def from_hidden(self, hidden: torch.Tensor, head, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The loss of `head`'s logits of `hidden` (an lmlab.nn.transformer.OutputHead), which are never made whole."""
        from lmlab.kernels.chunked_cross_entropy import linear_cross_entropy

        cfg = self.cfg
        return self._terms(*linear_cross_entropy(hidden.flatten(0, -2), head.weight, targets.flatten(), cfg.ignore_index,
                                                 cfg.label_smoothing, bool(cfg.z_loss), head.multiplier, head.softcap))

    def _terms(self, ce: torch.Tensor, z: torch.Tensor | None) -> dict[str, torch.Tensor]:
        if z is None:
            return {"loss": ce}
        return {"loss": ce + self.cfg.z_loss * z, "ce": ce, "z_loss": z}
