"""Early fusion: the joint vocabulary's layout, the two row orders, next-token rows, and generation that
keeps image positions to image codes and captions to text."""

from __future__ import annotations

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.inference.samplers import SAMPLERS
from lmlab.multimodal.early_fusion import (IGNORE, FusionVocab, RangeSampler, caption_prompt, caption_then_image,
                                           draw_images, fusion_rows, image_prompt, image_then_caption, write_captions)
from lmlab.nn.transformer import ModelConfig, Transformer
from lmlab.tokenizers import ByteTokenizer

VOCAB = FusionVocab(text_size=257, n_codes=64)  # the byte tokenizer (256 bytes + <|endoftext|>) and 64 codes
EOT = 256


def test_vocabulary_layout():
    assert (VOCAB.image_offset, VOCAB.boi, VOCAB.eoi, VOCAB.size) == (257, 321, 322, 323)
    codes = torch.tensor([[0, 5, 63]])
    tokens = VOCAB.image_tokens(codes)
    assert tokens.tolist() == [[257, 262, 320]]
    assert torch.equal(VOCAB.codes(tokens), codes)
    assert VOCAB.is_image(torch.tensor([256, 257, 320, 321, 322])).tolist() == [False, True, True, False, False]
    with pytest.raises(ValueError, match=r"image tokens must lie in \[257, 321\)"):
        VOCAB.codes(torch.tensor([256]))
    with pytest.raises(ValueError, match=r"image tokens must lie in \[257, 321\)"):
        VOCAB.codes(torch.tensor([VOCAB.boi]))


def test_both_orders_and_the_prompts():
    caption, codes = [104, 105], [0, 5, 63]
    assert caption_then_image(caption, codes, VOCAB, EOT) == [EOT, 104, 105, 321, 257, 262, 320, 322, EOT]
    assert image_then_caption(caption, codes, VOCAB, EOT) == [EOT, 321, 257, 262, 320, 322, 104, 105, EOT]
    assert caption_prompt(caption, VOCAB, EOT) == [EOT, 104, 105, 321]
    assert image_prompt(codes, VOCAB, EOT) == [EOT, 321, 257, 262, 320, 322]


def test_rows_are_next_token_pairs_with_padding_ignored():
    captions = [[104, 105], [120]]
    codes = torch.tensor([[0, 5], [7, 8]])
    rows = fusion_rows(captions, codes, VOCAB, EOT, length=10)
    assert rows.inputs.shape == rows.targets.shape == (4, 10) and len(rows) == 4
    assert rows.caption_first.tolist() == [True, True, False, False]
    first = caption_then_image([104, 105], [0, 5], VOCAB, EOT)  # 8 tokens: 7 next-token pairs
    assert rows.inputs[0, :7].tolist() == first[:-1] and rows.targets[0, :7].tolist() == first[1:]
    assert rows.targets[0, 7:].tolist() == [IGNORE] * 3 and rows.inputs[0, 7:].tolist() == [EOT] * 3
    last = image_then_caption([120], [7, 8], VOCAB, EOT)
    assert rows.inputs[3, :6].tolist() == last[:-1] and rows.targets[3, :6].tolist() == last[1:]
    inputs, targets, caption_first = rows[2]
    assert inputs[1] == VOCAB.boi and not caption_first


def test_a_row_longer_than_the_context_says_how_long():
    with pytest.raises(ConfigError, match="has 7 tokens .* model.max_seq_len=6; raise model.max_seq_len to at least 7"):
        fusion_rows([[104, 105]], torch.tensor([[0, 5]]), VOCAB, EOT, length=6)


def test_range_sampler_keeps_to_its_range():
    logits = torch.tensor([[9.0, 1.0, 2.0, 8.0], [0.0, 3.0, 1.0, 5.0]])
    greedy = RangeSampler(SAMPLERS.build("greedy"), 1, 3)
    assert greedy.sample(logits).tolist() == [2, 1]
    sampled = RangeSampler(SAMPLERS.build({"name": "temperature", "seed": 0}), 1, 3)
    draws = torch.stack([sampled.sample(logits, generator=sampled.generator("cpu")) for _ in range(20)])
    assert ((draws >= 1) & (draws < 3)).all()


def _model(favour: str) -> Transformer:
    """A tiny untrained model whose every logit outside the `favour`ed part of the vocabulary is 0, so that
    unconstrained greedy decoding would leave that part."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=1, max_seq_len=96, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "mha", "n_heads": 2}, block="prenorm")
    model = Transformer(cfg, VOCAB.size)
    with torch.no_grad():
        keep = torch.zeros(model.vocab_size, dtype=torch.bool)
        keep[:VOCAB.text_size] = favour == "text"
        keep[VOCAB.image_offset:VOCAB.boi] = favour == "image"
        model.lm_head.weight[~keep] = 0
        model.lm_head.weight[keep] *= 50
    return model.eval()


def test_drawn_images_are_image_codes_only():
    model = _model("text")
    prompts = [caption_prompt([104, 105], VOCAB, EOT), caption_prompt([120], VOCAB, EOT)]
    unconstrained = model(torch.tensor([prompts[0]]))[0, -1].argmax()
    assert unconstrained < VOCAB.text_size
    codes = draw_images(Engine(model), prompts, VOCAB, n_codes=16, sampler=SAMPLERS.build("greedy"))
    assert codes.shape == (2, 16)
    assert torch.equal(codes, torch.zeros(2, 16, dtype=torch.long))  # all image logits tie at 0: the lowest code


def test_captions_are_text_only():
    model = _model("image")
    prompt = image_prompt(list(range(16)), VOCAB, EOT)
    assert VOCAB.is_image(model(torch.tensor([prompt]))[0, -1].argmax())
    captions = write_captions(Engine(model), [prompt], ByteTokenizer(), max_tokens=5)
    assert captions == ["\x00" * 5]  # every text logit ties at 0: byte 0, never an image code or marker
