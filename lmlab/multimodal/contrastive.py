"""Contrastive image-text losses (config group `contrastive_loss`): CLIP's softmax and SigLIP's sigmoid.

An entry is a module (it owns its learnable temperature, and SigLIP's bias) called as
`loss(image_emb, text_emb)` with the local batch's embeddings (B, D), row i of each a matching pair; it
L2-normalises them and returns {"loss", "logit_scale" (the temperature's inverse, exp t'), ...}.

Across data-parallel ranks the embeddings are all-gathered (`gather_rows`), so every image is contrasted
with the texts of the whole global batch. Each rank computes the loss of its own rows against all
columns; the gather's backward sums the column gradients of every rank into the shard that produced
them, so with DDP's gradient mean the gradient is exactly that of the loss over the global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError
from lmlab.registry import Registry

CONTRASTIVE_LOSSES = Registry("contrastive_loss", group="contrastive_loss",
                              doc="image-text contrastive losses with learnable temperature")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0; backward sums the gradient over ranks and returns this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.rows = dist.get_rank(), x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)  # every rank's loss reads every shard: the shard's gradient is the sum of them
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def gather_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rows of all ranks concatenated in rank order, offset of this rank's rows); x itself in one process.

    Every rank must pass the same number of rows (drop the last incomplete batch)."""
    if not distributed():
        return x, 0
    sizes = [torch.zeros((), dtype=torch.long, device=x.device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor(x.shape[0], device=x.device))
    if len({int(s) for s in sizes}) > 1:
        raise ValueError(f"contrastive all-gather needs equal batch sizes on every rank, got {[int(s) for s in sizes]}; "
                         "drop the last incomplete batch")
    return _GatherRows.apply(x), dist.get_rank() * x.shape[0]


@dataclass
class ScaleConfig:
    """The fields every entry has: the logit scale exp(t') = 1 / temperature."""

    init_scale: float = 1 / 0.07  # exp(t') at the start
    max_scale: float = 100.0  # the scale is capped here, so logits cannot blow up (CLIP: 100)
    learn_scale: bool = True  # false: a fixed temperature

    def __post_init__(self) -> None:
        if not 0 < self.init_scale <= self.max_scale:
            raise ConfigError(f"contrastive_loss: need 0 < init_scale <= max_scale, got init_scale={self.init_scale}, "
                              f"max_scale={self.max_scale}")


class ContrastiveLoss(nn.Module):
    """Base of the entries: a learnable log-scale t' (logits are exp(t') * cosine similarity), capped."""

    def __init__(self, cfg: ScaleConfig):
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(cfg.init_scale)), requires_grad=cfg.learn_scale)
        self.max_log_scale = math.log(cfg.max_scale)

    def scale(self) -> torch.Tensor:
        return self.log_scale.clamp(max=self.max_log_scale).exp()

    def forward(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> dict[str, torch.Tensor]:
        if image_emb.shape != text_emb.shape or image_emb.dim() != 2:
            raise ValueError(f"image and text embeddings must both be (batch, dim), got {tuple(image_emb.shape)} "
                             f"and {tuple(text_emb.shape)}")
        return self.pairs(F.normalize(image_emb, dim=-1), F.normalize(text_emb, dim=-1))

    def pairs(self, image: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError


@CONTRASTIVE_LOSSES.register("clip")
class CLIPLoss(ContrastiveLoss):
    """Symmetric InfoNCE: softmax over the global batch, image->text and text->image (CLIP)."""

    @dataclass
    class Config(ScaleConfig):
        init_scale: float = 1 / 0.07  # exp(t') at the start: 1 / temperature (CLIP: temperature 0.07)

    def pairs(self, image: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
        all_image, offset = gather_rows(image)
        all_text, _ = gather_rows(text)
        scale = self.scale()
        targets = torch.arange(len(image), device=image.device) + offset
        image_to_text = F.cross_entropy(scale * image @ all_text.T, targets)
        text_to_image = F.cross_entropy(scale * text @ all_image.T, targets)
        return {"loss": (image_to_text + text_to_image) / 2, "logit_scale": scale.detach(),
                "image_to_text": image_to_text.detach(), "text_to_image": text_to_image.detach()}


@CONTRASTIVE_LOSSES.register("siglip")
class SigLIPLoss(ContrastiveLoss):
    """Pairwise sigmoid loss: each (image, text) pair is a binary match / no-match (SigLIP)."""

    @dataclass
    class Config(ScaleConfig):
        init_scale: float = 10.0  # exp(t') at the start (SigLIP: t' = log 10)
        init_bias: float = -10.0  # b at the start: most pairs are negatives, so begin predicting "no match"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.bias = nn.Parameter(torch.tensor(float(cfg.init_bias)))

    def pairs(self, image: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
        # Local images against all texts: every (image, text) pair of the global batch is on exactly one rank.
        all_text, offset = gather_rows(text)
        logits = self.scale() * image @ all_text.T + self.bias
        signs = -torch.ones_like(logits)
        signs[torch.arange(len(image)), torch.arange(len(image)) + offset] = 1.0
        # -sum log sigmoid(z * logit) over pairs, divided by the batch size (the paper's normalisation)
        loss = -F.logsigmoid(signs * logits).sum() / len(image)
        return {"loss": loss, "logit_scale": self.scale().detach(), "logit_bias": self.bias.detach()}
