"""The model task=contrastive trains: an image encoder and a text encoder projected into one embedding
space (CLIP/SigLIP's dual encoder), its contrastive loss, zero-shot classification, and loading it back.

Text tower: an lmlab Transformer (the `model` group) with no LM head, read at each caption's last token;
every caption ends with the end-of-text token, and under causal attention that is the one position that
has seen the whole caption (CLIP's choice: pooling at the EOT token). Padding goes after it, so it
changes nothing before it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lmlab.catalog import load_catalog
from lmlab.multimodal.contrastive import CONTRASTIVE_LOSSES
from lmlab.multimodal.data import ZeroShotSet
from lmlab.multimodal.vit import VISION_ENCODERS
from lmlab.nn.transformer import Transformer
from lmlab.tokenizers.base import Tokenizer
from lmlab.training.checkpoints import CONFIG_KEY, MODEL_PREFIX, checkpoint_tokenizer, read_checkpoint

log = logging.getLogger(__name__)


class CaptionTokens:
    """Captions -> (ids (B, L) right-padded, index of each caption's last token (B,)); the end-of-text token
    is appended, and a caption longer than `max_len` keeps its first tokens."""

    def __init__(self, tokenizer: Tokenizer, max_len: int):
        self.tokenizer, self.max_len = tokenizer, max_len
        self.end = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
        self.pad = tokenizer.eot_id or 0
        self.truncated = 0

    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for caption in captions:
            ids = self.tokenizer.encode(caption)
            if len(ids) + len(self.end) > self.max_len:
                self.truncated += 1
                if self.truncated == 1:
                    log.warning("a caption is longer than model.max_seq_len=%d tokens; such captions are cut",
                                self.max_len)
                ids = ids[: self.max_len - len(self.end)]
            rows.append((ids + self.end) or [self.pad])
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        return ids, torch.tensor([len(row) - 1 for row in rows])


class TextEncoder(nn.Module):
    """An lmlab Transformer without its LM head, pooled at each caption's last token."""

    def __init__(self, model_cfg, vocab_size: int):
        super().__init__()
        self.transformer = Transformer(model_cfg, vocab_size)
        del self.transformer.lm_head  # an encoder: the head would be a parameter no loss reaches
        self.width = model_cfg.d_model

    def forward(self, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer.hidden_states(ids)
        return hidden[torch.arange(len(ids), device=ids.device), last.to(ids.device)]


class DualEncoder(nn.Module):
    """Image and text towers, linear projections to `embed_dim`, and the contrastive loss (with its temperature)."""

    def __init__(self, vision_cfg, text_cfg, loss_cfg, vocab_size: int, embed_dim: int):
        super().__init__()
        self.image_encoder = VISION_ENCODERS.build(vision_cfg)
        self.text_encoder = TextEncoder(text_cfg, vocab_size)
        self.image_proj = nn.Linear(self.image_encoder.width, embed_dim, bias=False)
        self.text_proj = nn.Linear(self.text_encoder.width, embed_dim, bias=False)
        self.loss_fn = CONTRASTIVE_LOSSES.build(loss_cfg)

    @classmethod
    def from_config(cls, cfg: DictConfig, vocab_size: int) -> DualEncoder:
        return cls(cfg.vision_encoder, cfg.model, cfg.contrastive_loss, vocab_size, cfg.task.embed_dim)

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.image_proj(self.image_encoder.encode(images)[1])

    def embed_texts(self, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.text_proj(self.text_encoder(ids, last))

    def forward(self, images: torch.Tensor, ids: torch.Tensor, last: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.loss_fn(self.embed_images(images), self.embed_texts(ids, last))


@torch.no_grad()
def zero_shot_accuracy(model: DualEncoder, probe: ZeroShotSet, tokens: CaptionTokens, batch_size: int = 256) -> float:
    """The share of probe images whose nearest candidate caption (cosine similarity) is the true one."""
    device = next(model.parameters()).device
    texts = []
    for start in range(0, len(probe.texts), batch_size):
        ids, last = tokens(probe.texts[start:start + batch_size])
        texts.append(F.normalize(model.embed_texts(ids.to(device), last.to(device)).float(), dim=-1))
    texts = torch.cat(texts)
    correct = 0
    for start in range(0, len(probe.targets), batch_size):
        stop = min(start + batch_size, len(probe.targets))
        images = torch.stack([probe.images[i]["image"] for i in range(start, stop)]).to(device)
        image_emb = F.normalize(model.embed_images(images).float(), dim=-1)
        scores = torch.einsum("bd,bkd->bk", image_emb, texts[probe.candidates[start:stop].to(device)])
        correct += int((scores.argmax(-1).cpu() == probe.targets[start:stop]).sum())
    return correct / len(probe.targets)


def load_dual_encoder(ckpt_path: str | Path, device: str | torch.device = "cpu") -> tuple[DualEncoder, Tokenizer, DictConfig]:
    """The dual encoder a task=contrastive run saved (weights loaded, eval mode), its tokenizer and config;
    `model.image_encoder` is a contrastively trained vision encoder (e.g. for a VLM)."""
    checkpoint = read_checkpoint(ckpt_path, "ckpt")
    config = OmegaConf.create(checkpoint[CONFIG_KEY])
    load_catalog(config.get("plugins") or [])
    tokenizer = checkpoint_tokenizer(checkpoint, ckpt_path)
    weights = {k.removeprefix(MODEL_PREFIX): v for k, v in checkpoint["state_dict"].items() if k.startswith(MODEL_PREFIX)}
    vocab = weights["text_encoder.transformer.embed_tokens.weight"].shape[0]
    model = DualEncoder.from_config(config, vocab)
    model.load_state_dict(weights)
    return model.to(device).eval(), tokenizer, config
