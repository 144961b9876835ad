"""A vision-language model in the LLaVA style: a vision encoder's patch features, mapped by a projector into
the embedding space of an lmlab Transformer, stand in for an image marker token of the prompt.

    vlm = VLM.build("vit", "mlp", lm, tokenizer)
    prompt = [vlm.marker_id, *tokenizer.encode("what colour is the shape?\\n")]
    batch = vlm.inputs([prompt], [answer])                     # markers expanded; targets on the answer only
    logits = vlm(batch.input_ids, images)                      # training: (B, S, V)
    vlm.generate([prompt], images, tokenizer=tokenizer).texts  # prefill with the image, then KV-cached decoding

The marker is the first id past the tokenizer's: a model's vocabulary is padded (to a multiple of 64), so that
id exists, no text encodes to it, and its own embedding is never read. `freeze(stage)` sets what trains:
stage 1 the projector alone (encoder and LM frozen), stage 2 the projector and the LM (and the encoder with
`train_encoder`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.inference.generate import Generation, tokenizer_vocab_size
from lmlab.multimodal.placement import check_markers, expand_markers, layout, place_image_features
from lmlab.multimodal.projector import PROJECTORS
from lmlab.multimodal.vit import VISION_ENCODERS
from lmlab.nn.transformer import Transformer

STAGES = (1, 2)


def image_marker_id(tokenizer, lm: Transformer) -> int:
    """The first id past the tokenizer's vocabulary, which must lie inside the LM's (padded) one."""
    marker = tokenizer_vocab_size(tokenizer)
    if marker is None or marker >= lm.vocab_size:
        raise ConfigError(f"the LM's vocabulary of {lm.vocab_size} ids has no id past the tokenizer's {marker} for the "
                          "image marker; train the LM with a model.vocab_size larger than the tokenizer's")
    return marker


def check_stage(stage: int, train_encoder: bool) -> None:
    if stage not in STAGES:
        raise ConfigError(f"task.stage={stage}: 1 trains the projector alone, 2 the projector and the LM")
    if stage == 1 and train_encoder:
        raise ConfigError("task.stage=1 trains the projector alone: set task.train_encoder=false, or use task.stage=2")


class VLM(nn.Module):
    """Vision encoder + projector + Transformer LM; images enter at the LM's image marker positions."""

    def __init__(self, encoder: nn.Module, projector: nn.Module, lm: Transformer, marker_id: int):
        super().__init__()
        self.encoder, self.projector, self.lm = encoder, projector, lm
        self.marker_id = marker_id
        self.n_patches: int = encoder.n_patches
        if lm.max_seq_len <= self.n_patches:
            raise ConfigError(f"the LM's context (model.max_seq_len={lm.max_seq_len}) has no room for text beside an "
                              f"image's {self.n_patches} patch positions; raise it or the encoder's patch_size")

    @classmethod
    def build(cls, encoder_cfg, projector_cfg, lm: Transformer, tokenizer) -> VLM:
        """The `vision_encoder` and `projector` entries around `lm`, the marker past `tokenizer`'s ids."""
        encoder = VISION_ENCODERS.build(encoder_cfg)
        projector = PROJECTORS.build(projector_cfg, encoder.width, lm.embed_tokens.embedding_dim)
        return cls(encoder, projector, lm, image_marker_id(tokenizer, lm))

    def freeze(self, stage: int, train_encoder: bool = False) -> None:
        """Stage 1: only the projector trains. Stage 2: the projector and the LM, and the encoder if `train_encoder`."""
        check_stage(stage, train_encoder)
        self.encoder.requires_grad_(train_encoder)
        self.lm.requires_grad_(stage == 2)
        self.projector.requires_grad_(True)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """Images (M, 3, H, W) in [0, 1] -> projected patch embeddings (M, n_patches, d_model)."""
        frozen = not any(p.requires_grad for p in self.encoder.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):  # no graph kept through a frozen encoder
            patches = self.encoder(images)
        return self.projector(patches)

    def inputs(self, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]] | None = None,
               pad_id: int = 0, left_pad: bool = False):
        """The prompts (and answers) as padded rows with each marker expanded: `placement.layout`'s batch."""
        return layout(prompts, answers, self.marker_id, self.n_patches, pad_id=pad_id, left_pad=left_pad)

    def embed(self, input_ids: torch.Tensor, images: torch.Tensor | None = None,
              features: torch.Tensor | None = None) -> torch.Tensor:
        """The LM's input embeddings of expanded ids (B, S): tokens, with the images' (or the given projected
        `features`') patches at the marker positions."""
        features = self.image_features(images) if features is None else features
        return place_image_features(self.lm.embed_tokens(input_ids), input_ids, self.marker_id, features)

    def forward(self, input_ids: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """Next-token logits (B, S, V) of expanded ids (B, S) holding one marker run per image (M, 3, H, W)."""
        return self.lm(input_ids, embeds=self.embed(input_ids, images))

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], images: torch.Tensor, engine: Engine | None = None,
                 **kwargs) -> Generation:
        """Answers to the prompts (token ids, each marker unexpanded) about `images`, one per marker in order:
        the engine prefills from the embeddings with the images' features, then decodes with its KV cache.
        `kwargs` are `Engine.generate`'s (sampler, max_new_tokens, stop_token_ids, tokenizer, ...)."""
        check_markers(prompts, self.marker_id, len(images))
        expanded = [expand_markers(p, self.marker_id, self.n_patches) for p in prompts]
        engine = Engine(self.lm) if engine is None else engine
        # The engine's caches hold the weights' dtype: generate outside any autocast (bf16-mixed validation).
        with torch.autocast(engine.device.type, enabled=False):
            features = self.image_features(images.to(engine.device))
            return engine.generate(expanded, embed=lambda ids: self.embed(ids, features=features), **kwargs)
