"""Synthetic captioned scenes: exact captions, deterministic rendering, held-out class splits."""

import random

import pytest
import torch
from lmlab.multimodal.synthetic import (
    COLORS,
    RGB,
    SHAPES,
    Scene,
    SyntheticImageText,
    random_scenes,
    render,
    split_classes,
    to_tensor,
    with_class,
)


def test_captions_are_exact():
    assert Scene("circle", "red", "top left", 2).caption() == "two red circles at the top left"
    assert Scene("cross", "green", "bottom right", 3).caption() == "three green crosses at the bottom right"
    assert Scene("square", "blue", "center").caption() == "a blue square in the center"
    assert Scene("circle", "orange", "top left").caption() == "an orange circle at the top left"
    assert Scene("digit", "blue", "center", glyph="7").caption() == "the digit 7 in blue in the center"
    assert Scene("letter", "orange", "top right", glyph="Q").caption() == "the letter Q in orange at the top right"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"shape": "hexagon", "color": "red", "position": "center"}, "unknown shape"),
        ({"shape": "circle", "color": "pink", "position": "center"}, "unknown colour"),
        ({"shape": "circle", "color": "red", "position": "middle"}, "unknown position"),
        ({"shape": "circle", "color": "red", "position": "center", "count": 5}, "count"),
        ({"shape": "letter", "color": "red", "position": "center", "glyph": "7"}, "glyph '7'"),
        ({"shape": "digit", "color": "red", "position": "center", "count": 2, "glyph": "7"}, "count must be 1"),
    ],
)
def test_bad_scenes_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scene(**kwargs)


def test_render_is_deterministic_and_draws_the_colour_in_the_right_place():
    scene = Scene("square", "red", "top left")
    a, b = to_tensor(render(scene, 32)), to_tensor(render(scene, 32))
    assert a.shape == (3, 32, 32) and torch.equal(a, b)
    ink = a.sum(0) > 0.3
    assert ink[:16, :16].sum() > 40 and ink[16:, :].sum() == 0 and ink[:, 16:].sum() == 0
    mean_colour = a[:, ink].mean(1) * 255
    assert torch.allclose(mean_colour, torch.tensor(RGB["red"], dtype=torch.float32), atol=25)


def test_count_and_glyph_change_the_image_and_jitter_is_seeded():
    one, four = (to_tensor(render(Scene("circle", "blue", "center", n), 32)) for n in (1, 4))
    assert not torch.equal(one, four)
    digit = to_tensor(render(Scene("digit", "green", "center", glyph="3"), 32))
    assert digit[1].max() > 0.5 and digit[0].max() < 0.3  # green ink only
    s = Scene("star", "yellow", "bottom right", 2)
    assert torch.equal(to_tensor(render(s, 32, random.Random(1))), to_tensor(render(s, 32, random.Random(1))))
    assert not torch.equal(to_tensor(render(s, 32, random.Random(1))), to_tensor(render(s, 32, random.Random(2))))


def test_random_scenes_are_seeded_and_respect_classes():
    assert random_scenes(20, seed=3) == random_scenes(20, seed=3)
    assert random_scenes(20, seed=3) != random_scenes(20, seed=4)
    only = [("circle", "red"), ("star", "blue")]
    assert {s.label for s in random_scenes(50, seed=0, classes=only)} == set(only)
    glyphs = random_scenes(200, seed=0, glyph_fraction=0.5)
    assert 60 < sum(s.glyph is not None for s in glyphs) < 140


def test_split_classes_holds_out_combinations_of_seen_parts():
    seen, held = split_classes(held_out_fraction=1 / 6, seed=0)
    assert len(held) == len(SHAPES) and not set(seen) & set(held)
    assert len(seen) + len(held) == len(SHAPES) * len(COLORS)
    assert {s for s, _ in held} == set(SHAPES) and {c for _, c in held} == set(COLORS)
    assert {s for s, _ in seen} == set(SHAPES) and {c for _, c in seen} == set(COLORS)
    assert split_classes(1 / 6, seed=0) == (seen, held) and split_classes(1 / 6, seed=1)[1] != held
    with pytest.raises(ValueError, match="held_out_fraction"):
        split_classes(held_out_fraction=0.0)


def test_dataset_items():
    seen, held = split_classes(1 / 3, seed=0)
    data = SyntheticImageText(16, size=24, seed=5, classes=held)
    item = data[3]
    assert item["image"].shape == (3, 24, 24) and item["image"].dtype == torch.float32
    assert 0.0 <= item["image"].min() and item["image"].max() <= 1.0
    assert item["caption"] == item["scene"].caption() and item["scene"].label in held
    assert torch.equal(data[3]["image"], SyntheticImageText(16, size=24, seed=5, classes=held)[3]["image"])
    assert with_class(item["scene"], ("circle", "red")).caption().count("red circle") == 1
