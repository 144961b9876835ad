"""The training objective: the loss on the main head, plus multi-token prediction and MoE terms."""

from __future__ import annotations

import torch
from torch import nn

from lmlab.nn.transformer import ModelOutput, Transformer


def takes_hidden(loss_fn: nn.Module) -> bool:
    """Whether `loss_fn` projects the hidden states itself (`loss.fused_head`): then ask the model for no logits."""
    return getattr(loss_fn, "takes_hidden", False)


def model_terms(model: Transformer, loss_fn: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """`training_terms` of `model`'s forward on `inputs`, which makes logits only for a loss that wants them."""
    output = model.forward_train(inputs, positions, logits=not takes_hidden(loss_fn))
    return training_terms(loss_fn, output, targets, model.mtp_loss_weight)


def training_terms(loss_fn: nn.Module, output: ModelOutput, targets: torch.Tensor,
                   mtp_loss_weight: float) -> dict[str, torch.Tensor]:
    """`loss` (what is minimised) and each of its terms, unweighted, for logging as train/<name>.

    With MTP, depth d's logits (B, S-d, V) predict targets[:, d:], and the mean over depths is
    added with `mtp_loss_weight`; each MoE auxiliary loss is added with its own weight. When
    anything is added, `lm_loss` keeps the main head's loss alone, comparable with dense runs.
    A loss that `takes_hidden` gets each head's hidden states and the head instead of logits.
    """
    def loss_of(logits: torch.Tensor | None, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return loss_fn.from_hidden(hidden, output.head, targets) if logits is None else loss_fn(logits, targets)

    terms = dict(loss_of(output.logits, output.hidden, targets))
    lm_loss = terms["loss"]
    total = lm_loss
    if output.mtp_hidden:
        mtp_logits = output.mtp_logits or [None] * len(output.mtp_hidden)
        depth_losses = [loss_of(logits, hidden, targets[:, d:])["loss"]
                        for d, (logits, hidden) in enumerate(zip(mtp_logits, output.mtp_hidden), start=1)]
        terms.update({f"mtp_{d}_loss": loss for d, loss in enumerate(depth_losses, start=1)})
        total = total + mtp_loss_weight * torch.stack(depth_losses).mean()
    for name, (weight, value) in output.aux_losses.items():
        terms[name] = value
        total = total + weight * value
    if total is not lm_loss:
        terms["lm_loss"] = lm_loss
    terms["loss"] = total
    return terms
