"""The training objective: the loss on the main head, plus multi-token prediction and MoE terms."""

from __future__ import annotations

import torch
from torch import nn

from lmlab.nn.transformer import ModelOutput


def training_terms(loss_fn: nn.Module, output: ModelOutput, targets: torch.Tensor,
                   mtp_loss_weight: float) -> dict[str, torch.Tensor]:
    """`loss` (what is minimised) and each of its terms, unweighted, for logging as train/<name>.

    With MTP, depth d's logits (B, S-d, V) predict targets[:, d:], and the mean over depths is
    added with `mtp_loss_weight`; each MoE auxiliary loss is added with its own weight. When
    anything is added, `lm_loss` keeps the main head's loss alone, comparable with dense runs.
    """
    terms = dict(loss_fn(output.logits, targets))
    lm_loss = terms["loss"]
    total = lm_loss
    if output.mtp_logits:
        depth_losses = [loss_fn(logits, targets[:, d:])["loss"] for d, logits in enumerate(output.mtp_logits, start=1)]
        terms.update({f"mtp_{d}_loss": loss for d, loss in enumerate(depth_losses, start=1)})
        total = total + mtp_loss_weight * torch.stack(depth_losses).mean()
    for name, (weight, value) in output.aux_losses.items():
        terms[name] = value
        total = total + weight * value
    if total is not lm_loss:
        terms["lm_loss"] = lm_loss
    terms["loss"] = total
    return terms
