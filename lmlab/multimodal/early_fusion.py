"""Early fusion (Chameleon-style): images as VQ-VAE codes in the same token sequence as text, modelled by
one lmlab Transformer over a joint vocabulary.

Vocabulary layout (`FusionVocab`): the text tokenizer's ids [0, T), then the K image codes [T, T + K),
then <image> = T + K and </image> = T + K + 1. Each captioned image makes two training rows, so the model
learns both directions:

    caption then image   <eot> caption <image> c_1 ... c_n </image> <eot>     (text -> image)
    image then caption   <eot> <image> c_1 ... c_n </image> caption <eot>     (image -> text)

The leading end-of-text token is the document start, so the first caption token and the choice of order
are trained too. Generation runs on lmlab's inference engine: `draw_images` samples n image tokens after
"<eot> caption <image>" with every id outside the code range masked (`RangeSampler`); `write_captions`
greedy-decodes text after "<eot> <image> codes </image>" until <eot>, with ids past the text vocabulary
masked (the engine masks ids its tokenizer cannot decode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine

IGNORE = -100  # targets of padding


@dataclass(frozen=True)
class FusionVocab:
    text_size: int  # the text tokenizer's vocabulary
    n_codes: int  # the VQ-VAE's codebook size

    @property
    def image_offset(self) -> int:
        return self.text_size

    @property
    def boi(self) -> int:
        """<image>: an image's codes follow."""
        return self.text_size + self.n_codes

    @property
    def eoi(self) -> int:
        """</image>: the image's codes have ended."""
        return self.boi + 1

    @property
    def size(self) -> int:
        return self.eoi + 1

    def image_tokens(self, codes: torch.Tensor) -> torch.Tensor:
        """Code ids (any shape) -> their token ids."""
        return codes + self.image_offset

    def codes(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image token ids -> code ids; one clear error for an id outside the image range."""
        codes = tokens - self.image_offset
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.n_codes):
            raise ValueError(f"image tokens must lie in [{self.image_offset}, {self.boi}), got "
                             f"{int(tokens.min())}..{int(tokens.max())}")
        return codes

    def is_image(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens >= self.image_offset) & (tokens < self.boi)


def caption_then_image(caption: Sequence[int], codes: Sequence[int], vocab: FusionVocab, eot: int) -> list[int]:
    return [eot, *caption, vocab.boi, *(c + vocab.image_offset for c in codes), vocab.eoi, eot]


def image_then_caption(caption: Sequence[int], codes: Sequence[int], vocab: FusionVocab, eot: int) -> list[int]:
    return [eot, vocab.boi, *(c + vocab.image_offset for c in codes), vocab.eoi, *caption, eot]


def image_prompt(codes: Sequence[int], vocab: FusionVocab, eot: int) -> list[int]:
    """What a caption is generated after."""
    return [eot, vocab.boi, *(c + vocab.image_offset for c in codes), vocab.eoi]


def caption_prompt(caption: Sequence[int], vocab: FusionVocab, eot: int) -> list[int]:
    """What an image is generated after."""
    return [eot, *caption, vocab.boi]


@dataclass
class FusionRows:
    inputs: torch.Tensor  # (N, L) token ids, padded with <eot>
    targets: torch.Tensor  # (N, L) the next token, IGNORE on padding
    caption_first: torch.Tensor  # (N,) bool: a text -> image row (else image -> text)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i], self.caption_first[i]


def fusion_rows(captions: Sequence[Sequence[int]], codes: torch.Tensor, vocab: FusionVocab, eot: int,
                length: int) -> FusionRows:
    """Both rows of each (caption ids, image codes (n_codes,)) pair, caption-first rows first, as next-token
    (inputs, targets) of `length` tokens (one clear error if a row is longer)."""
    sequences = [caption_then_image(c, k.tolist(), vocab, eot) for c, k in zip(captions, codes)]
    sequences += [image_then_caption(c, k.tolist(), vocab, eot) for c, k in zip(captions, codes)]
    longest = max(len(s) for s in sequences) - 1
    if longest > length:
        raise ConfigError(f"an early-fusion row has {longest} tokens (caption + {codes.shape[1]} image codes + 4 "
                          f"markers) but model.max_seq_len={length}; raise model.max_seq_len to at least {longest}")
    inputs = torch.full((len(sequences), length), eot, dtype=torch.long)
    targets = torch.full((len(sequences), length), IGNORE, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids = torch.tensor(sequence)
        inputs[row, :len(ids) - 1] = ids[:-1]
        targets[row, :len(ids) - 1] = ids[1:]
    caption_first = torch.arange(len(sequences)) < len(captions)
    return FusionRows(inputs, targets, caption_first)


class RangeSampler:
    """A sampler restricted to the ids [low, high): every other logit is -inf before `inner` samples,
    so an image position can only get an image code."""

    def __init__(self, inner, low: int, high: int):
        self.inner, self.low, self.high = inner, low, high
        self.needs_counts = inner.needs_counts
        self.greedy = inner.greedy

    def generator(self, device):
        return self.inner.generator(device)

    def sample(self, logits: torch.Tensor, counts: torch.Tensor | None = None, generator=None) -> torch.Tensor:
        ids = torch.arange(logits.shape[-1], device=logits.device)
        outside = (ids < self.low) | (ids >= self.high)
        return self.inner.sample(logits.masked_fill(outside, -torch.inf), counts, generator)


def draw_images(engine: Engine, prompts: Sequence[Sequence[int]], vocab: FusionVocab, n_codes: int,
                sampler) -> torch.Tensor:
    """Code ids (B, n_codes) sampled after each caption prompt ("<eot> caption <image>"), image codes only."""
    with torch.autocast(engine.device.type, enabled=False):
        out = engine.generate(prompts, RangeSampler(sampler, vocab.image_offset, vocab.boi), max_new_tokens=n_codes)
    return vocab.codes(torch.tensor(out.tokens))


def write_captions(engine: Engine, prompts: Sequence[Sequence[int]], tokenizer, max_tokens: int) -> list[str]:
    """Greedy text after each image prompt ("<eot> <image> codes </image>") until <eot>; ids past the text
    vocabulary (image codes, markers, padding) are never picked."""
    from lmlab.inference.samplers import SAMPLERS

    with torch.autocast(engine.device.type, enabled=False):
        out = engine.generate(prompts, SAMPLERS.build("greedy"), max_new_tokens=max_tokens,
                              stop_token_ids=[tokenizer.eot_id], tokenizer=tokenizer)
    return [text.strip() for text in out.texts]
