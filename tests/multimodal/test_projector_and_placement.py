"""Projectors' shapes and gradients; image markers expanded and filled with the projected features; the
Transformer and the engine running on given embeddings instead of token ids."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.multimodal.placement import IGNORE_INDEX, MarkerError, expand_markers, layout, place_image_features
from lmlab.multimodal.projector import PROJECTORS
from lmlab.nn import ModelConfig, Transformer

MARKER = 60


def _lm(position: str = "rope") -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_layers=2, max_seq_len=64, norm="rmsnorm", ffn="swiglu", position=position,
                      attention={"name": "mha", "n_heads": 2}, block="prenorm")
    return Transformer(cfg, vocab_size=64).eval()


@pytest.mark.parametrize("name", ["linear", "mlp"])
def test_projector_maps_patch_features_to_the_lm_width(name):
    torch.manual_seed(0)
    projector = PROJECTORS.build(name, 12, 16)
    features = torch.randn(3, 5, 12, requires_grad=True)
    out = projector(features)
    assert out.shape == (3, 5, 16)
    out.square().sum().backward()
    assert features.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in projector.parameters())


def test_mlp_projector_is_linear_gelu_linear():
    torch.manual_seed(0)
    projector = PROJECTORS.build({"name": "mlp", "hidden": 7}, 4, 3)
    x = torch.randn(2, 4)
    hand = torch.nn.functional.gelu(x @ projector.up.weight.T + projector.up.bias) @ projector.down.weight.T
    torch.testing.assert_close(projector(x), hand + projector.down.bias)
    with pytest.raises(ConfigError, match="projector.hidden"):
        PROJECTORS.build({"name": "mlp", "hidden": 0}, 4, 3)


def test_expand_markers_repeats_each_marker_once_per_patch():
    assert expand_markers([MARKER, 5, 6, MARKER, 7], MARKER, 3) == [MARKER] * 3 + [5, 6] + [MARKER] * 3 + [7]


def test_layout_right_pads_and_keeps_only_answer_targets():
    batch = layout([[MARKER, 5], [9, MARKER, 5, 6]], [[1, 2], [3]], MARKER, n_patches=2, pad_id=0)
    # row 0: M M 5 | 1 2 -> inputs M M 5 1, targets . . 1 2 ; row 1: 9 M M 5 6 | 3 -> inputs 9 M M 5 6, targets . . . . 3
    assert batch.input_ids.tolist() == [[MARKER, MARKER, 5, 1, 0], [9, MARKER, MARKER, 5, 6]]
    I = IGNORE_INDEX
    assert batch.targets.tolist() == [[I, I, 1, 2, I], [I, I, I, I, 3]]
    assert batch.start.tolist() == [0, 0] and batch.lengths.tolist() == [4, 5]


def test_layout_left_pads_like_the_engine():
    batch = layout([[MARKER, 5], [9, MARKER, 5, 6]], None, MARKER, n_patches=2, left_pad=True)
    assert batch.input_ids.tolist() == [[0, 0, MARKER, MARKER, 5], [9, MARKER, MARKER, 5, 6]]
    assert (batch.targets == IGNORE_INDEX).all()
    assert batch.start.tolist() == [2, 0] and batch.lengths.tolist() == [3, 5]
    with_answers = layout([[MARKER, 5], [9, MARKER]], [[1, 2], [3]], MARKER, n_patches=1, left_pad=True)
    assert with_answers.input_ids.tolist() == [[MARKER, 5, 1], [0, 9, MARKER]]
    assert with_answers.targets.tolist() == [[IGNORE_INDEX, 1, 2], [IGNORE_INDEX, IGNORE_INDEX, 3]]


def test_missing_or_extra_marker_is_one_clear_error():
    with pytest.raises(MarkerError, match=r"prompt\(s\) \[1\] hold no image marker"):
        layout([[MARKER, 5], [5, 6]], None, MARKER, n_patches=2)
    with pytest.raises(MarkerError, match=r"3 image marker\(s\) \(per prompt: \[2, 1\]\) but 2 image"):
        layout([[MARKER, MARKER, 5], [MARKER]], None, MARKER, n_patches=2)
    with pytest.raises(ValueError, match="non-empty answers"):
        layout([[MARKER, 5]], [[]], MARKER, n_patches=2)


def test_features_land_at_the_marker_positions_and_text_is_unchanged():
    lm = _lm()
    batch = layout([[MARKER, 5, 6], [7, 8, MARKER, 9, 10, 11]], None, MARKER, n_patches=3)
    features = torch.randn(2, 3, 16, requires_grad=True)
    tokens = lm.embed_tokens(batch.input_ids)
    embeds = place_image_features(tokens, batch.input_ids, MARKER, features)
    torch.testing.assert_close(embeds[0, 0:3], features[0])
    torch.testing.assert_close(embeds[1, 2:5], features[1])
    text = batch.input_ids != MARKER
    torch.testing.assert_close(embeds[text], tokens[text])
    embeds.sum().backward()
    assert torch.equal(features.grad, torch.ones_like(features))
    with pytest.raises(MarkerError, match="6 image position"):
        place_image_features(tokens, batch.input_ids, MARKER, features[:, :2])


def test_transformer_takes_embeddings_in_place_of_ids():
    lm = _lm(position="learned")  # an absolute scheme: positions are still added to the given embeddings
    ids = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(lm(ids, embeds=lm.embed_tokens(ids)), lm(ids))
    with pytest.raises(ValueError, match="one per input id"):
        lm(ids, embeds=torch.zeros(2, 6, 16))


def test_engine_prefills_from_embeddings_and_decoding_matches_a_full_forward():
    lm = _lm()
    prompts = [expand_markers([MARKER, 5, 6], MARKER, 4), expand_markers([7, MARKER, 9, 10, 11, 12], MARKER, 4)]
    features = torch.randn(2, 4, 16)
    embed = lambda ids: place_image_features(lm.embed_tokens(ids), ids, MARKER, features)  # noqa: E731
    out = Engine(lm).generate(prompts, max_new_tokens=6, embed=embed)
    for b, (prompt, new) in enumerate(zip(prompts, out.tokens)):
        full = torch.tensor([prompt + new])
        with torch.no_grad():
            logits = lm(full, embeds=place_image_features(lm.embed_tokens(full), full, MARKER, features[b:b + 1]))
        # greedy: each new token is the argmax of the full forward at the position before it
        assert logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == new
    # the prefill read the features: its logits differ from those of the marker's own embedding
    engine, ids = Engine(lm), torch.tensor([prompts[0]])
    engine.begin(1, 16)
    with_image = engine.extend(ids, embeds=place_image_features(lm.embed_tokens(ids), ids, MARKER, features[:1])).clone()
    engine.begin(1, 16)
    assert not torch.allclose(engine.extend(ids), with_image)
