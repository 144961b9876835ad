"""Captioned synthetic images whose captions are exact, so what a model learns can be checked.

A `Scene` says what is drawn: `count` (1-4) copies of a coloured `shape` in one of five `position`s,
or a single rendered digit/letter (`glyph`, with `shape` "digit" or "letter"). `Scene.caption()` is the
one exact English description of it:

    Scene("circle", "red", "top left", count=2).caption()      == "two red circles at the top left"
    Scene("digit", "blue", "center", glyph="7").caption()     == "the digit 7 in blue in the center"

`render` draws a scene with PIL (at 4x the size, then box-downsampled, so small shapes keep their form),
deterministically; an optional `random.Random` adds a small jitter of place and size.

Zero-shot evaluation holds out some (shape, colour) classes: `split_classes` picks them so that every
shape and every colour is still seen in training, only never in that combination.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

SHAPES = ("circle", "square", "triangle", "diamond", "cross", "star")
COLORS = ("red", "green", "blue", "yellow", "purple", "orange")
POSITIONS = ("top left", "top right", "bottom left", "bottom right", "center")
COUNTS = (1, 2, 3, 4)
DIGITS = tuple("0123456789")
LETTERS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
GLYPH_KINDS = {"digit": DIGITS, "letter": LETTERS}

RGB = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 40),
    "purple": (155, 60, 205),
    "orange": (245, 140, 30),
}
BACKGROUND = (0, 0, 0)
_NUMBER_WORDS = {2: "two", 3: "three", 4: "four"}  # one shape takes "a" or "an", by its colour's first letter
_PLURALS = {"cross": "crosses"}
# Each position's box as fractions (left, top, right, bottom) of the image.
_BOXES = {
    "top left": (0.0, 0.0, 0.5, 0.5),
    "top right": (0.5, 0.0, 1.0, 0.5),
    "bottom left": (0.0, 0.5, 0.5, 1.0),
    "bottom right": (0.5, 0.5, 1.0, 1.0),
    "center": (0.25, 0.25, 0.75, 0.75),
}
# With several copies the box splits into 2x2 cells, filled in this order (2 copies sit on a diagonal).
_CELL_ORDER = ((0, 0), (1, 1), (1, 0), (0, 1))
_SUPERSAMPLE = 4


@dataclass(frozen=True)
class Scene:
    """What one synthetic image shows; `caption()` describes it exactly."""

    shape: str
    color: str
    position: str
    count: int = 1
    glyph: str | None = None

    def __post_init__(self) -> None:
        if self.color not in RGB:
            raise ValueError(f"unknown colour '{self.color}'; use one of {', '.join(COLORS)}")
        if self.position not in _BOXES:
            raise ValueError(f"unknown position '{self.position}'; use one of {', '.join(POSITIONS)}")
        if self.glyph is None:
            if self.shape not in SHAPES:
                raise ValueError(f"unknown shape '{self.shape}'; use one of {', '.join(SHAPES)} (or 'digit'/'letter' with a glyph)")
            if self.count not in COUNTS:
                raise ValueError(f"count must be one of {COUNTS}, got {self.count}")
        else:
            if self.glyph not in GLYPH_KINDS.get(self.shape, ()):
                raise ValueError(f"glyph '{self.glyph}' needs shape 'digit' (0-9) or 'letter' (A-Z), got shape '{self.shape}'")
            if self.count != 1:
                raise ValueError(f"a glyph scene draws one glyph; count must be 1, got {self.count}")

    @property
    def label(self) -> tuple[str, str]:
        """The (shape, colour) class the scene belongs to."""
        return (self.shape, self.color)

    def caption(self) -> str:
        where = "in the center" if self.position == "center" else f"at the {self.position}"
        if self.glyph is not None:
            return f"the {self.shape} {self.glyph} in {self.color} {where}"
        noun = self.shape if self.count == 1 else _PLURALS.get(self.shape, self.shape + "s")
        number = _NUMBER_WORDS.get(self.count) or ("an" if self.color[0] in "aeiou" else "a")
        return f"{number} {self.color} {noun} {where}"


def render(scene: Scene, size: int = 32, rng: random.Random | None = None) -> Image.Image:
    """The scene drawn as an RGB image of `size` x `size`; `rng` jitters place and size a little."""
    if size < 8:
        raise ValueError(f"image size must be at least 8 pixels to draw a scene, got {size}")
    big = size * _SUPERSAMPLE
    image = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = (f * big for f in _BOXES[scene.position])
    cells = [(left, top, right, bottom)] if scene.count == 1 else _cells(left, top, right, bottom, scene.count)
    for cell in cells:
        cx, cy, radius = _place(cell, rng)
        if scene.glyph is not None:
            _draw_glyph(draw, scene.glyph, cx, cy, radius, RGB[scene.color])
        else:
            _DRAWERS[scene.shape](draw, cx, cy, radius, RGB[scene.color])
    return image.resize((size, size), Image.Resampling.BOX)


def to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB PIL image as a float tensor (3, H, W) in [0, 1]."""
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def random_scenes(
    n: int,
    seed: int,
    *,
    shapes: Sequence[str] = SHAPES,
    colors: Sequence[str] = COLORS,
    positions: Sequence[str] = POSITIONS,
    counts: Sequence[int] = COUNTS,
    classes: Sequence[tuple[str, str]] | None = None,
    glyph_fraction: float = 0.0,
) -> list[Scene]:
    """`n` scenes drawn uniformly, the same list for the same arguments.

    classes: the (shape, colour) pairs allowed (default: every pair of `shapes` x `colors`);
    glyph_fraction: the share of scenes that show a digit or letter instead (any colour of `colors`).
    """
    if n < 0:
        raise ValueError(f"number of scenes must be >= 0, got {n}")
    if not 0.0 <= glyph_fraction <= 1.0:
        raise ValueError(f"glyph_fraction must be in [0, 1], got {glyph_fraction}")
    pairs = list(classes) if classes is not None else [(s, c) for s in shapes for c in colors]
    if not pairs and glyph_fraction < 1.0:
        raise ValueError("no (shape, colour) classes to draw from; pass a non-empty `classes` or shapes and colors")
    rng = random.Random(seed)
    scenes = []
    for _ in range(n):
        if rng.random() < glyph_fraction:
            kind = rng.choice(sorted(GLYPH_KINDS))
            glyph = rng.choice(GLYPH_KINDS[kind])
            scenes.append(Scene(kind, rng.choice(list(colors)), rng.choice(list(positions)), glyph=glyph))
        else:
            shape, color = rng.choice(pairs)
            scenes.append(Scene(shape, color, rng.choice(list(positions)), rng.choice(list(counts))))
    return scenes


def split_classes(
    held_out_fraction: float = 1 / 6,
    seed: int = 0,
    shapes: Sequence[str] = SHAPES,
    colors: Sequence[str] = COLORS,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(seen, held_out) (shape, colour) classes for zero-shot evaluation.

    Held-out classes lie on "diagonals" of the shape x colour grid under a seeded colour permutation, so
    each shape and each colour is held out equally often and every one still appears among the seen classes.
    """
    n_diagonals = round(held_out_fraction * len(colors))
    if not 0 < n_diagonals < len(colors):
        raise ValueError(
            f"held_out_fraction={held_out_fraction} with {len(colors)} colours holds out {n_diagonals} per shape; "
            f"pick a fraction that holds out at least one and leaves at least one colour per shape"
        )
    order = list(colors)
    random.Random(seed).shuffle(order)
    held = {(shape, order[(i + d) % len(order)]) for i, shape in enumerate(shapes) for d in range(n_diagonals)}
    all_pairs = [(s, c) for s in shapes for c in colors]
    return [p for p in all_pairs if p not in held], [p for p in all_pairs if p in held]


def with_class(scene: Scene, label: tuple[str, str]) -> Scene:
    """The same scene (position, count) with another (shape, colour) class: a zero-shot candidate caption."""
    return dataclasses.replace(scene, shape=label[0], color=label[1])


class SyntheticImageText(torch.utils.data.Dataset):
    """`n` seeded random scenes; items are {"image": FloatTensor[3, size, size] in [0, 1], "caption", "scene"}.

    classes: restrict to these (shape, colour) pairs (e.g. the seen or held-out half of `split_classes`);
    jitter: each item is drawn with a small random shift seeded by (seed, index), the same every epoch.
    """

    def __init__(
        self,
        n: int,
        size: int = 32,
        seed: int = 0,
        classes: Sequence[tuple[str, str]] | None = None,
        glyph_fraction: float = 0.0,
        jitter: bool = True,
    ):
        self.scenes = random_scenes(n, seed, classes=classes, glyph_fraction=glyph_fraction)
        self.size = size
        self.seed = seed
        self.jitter = jitter

    def __len__(self) -> int:
        return len(self.scenes)

    def __getitem__(self, index: int) -> dict:
        scene = self.scenes[index]
        rng = random.Random(self.seed * 1_000_003 + index) if self.jitter else None
        return {"image": to_tensor(render(scene, self.size, rng)), "caption": scene.caption(), "scene": scene}


def _cells(left: float, top: float, right: float, bottom: float, count: int) -> list[tuple[float, float, float, float]]:
    w, h = (right - left) / 2, (bottom - top) / 2
    return [(left + col * w, top + row * h, left + (col + 1) * w, top + (row + 1) * h) for row, col in _CELL_ORDER[:count]]


def _place(cell: tuple[float, float, float, float], rng: random.Random | None) -> tuple[float, float, float]:
    """Centre and radius of a shape in a cell, with a 15% margin, jittered by up to 6% of the cell."""
    left, top, right, bottom = cell
    side = right - left
    cx, cy, radius = (left + right) / 2, (top + bottom) / 2, side * 0.35
    if rng is not None:
        cx += rng.uniform(-0.06, 0.06) * side
        cy += rng.uniform(-0.06, 0.06) * side
        radius *= rng.uniform(0.85, 1.0)
    return cx, cy, radius


def _circle(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, fill: tuple) -> None:
    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)


def _square(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, fill: tuple) -> None:
    s = r * 0.85
    draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)


def _triangle(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, fill: tuple) -> None:
    draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)


def _diamond(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, fill: tuple) -> None:
    draw.polygon([(cx, cy - r), (cx + r * 0.7, cy), (cx, cy + r), (cx - r * 0.7, cy)], fill=fill)


def _cross(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, fill: tuple) -> None:
    t = r * 0.35
    draw.rectangle((cx - r, cy - t, cx + r, cy + t), fill=fill)
    draw.rectangle((cx - t, cy - r, cx + t, cy + r), fill=fill)


def _star(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, fill: tuple) -> None:
    points = []
    for k in range(10):
        radius = r if k % 2 == 0 else r * 0.45
        angle = np.pi / 2 + k * np.pi / 5
        points.append((cx + radius * np.cos(angle), cy - radius * np.sin(angle)))
    draw.polygon(points, fill=fill)


_DRAWERS = {"circle": _circle, "square": _square, "triangle": _triangle, "diamond": _diamond, "cross": _cross, "star": _star}


@lru_cache(maxsize=32)
def _font(pixels: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=pixels)


def _draw_glyph(draw: ImageDraw.ImageDraw, glyph: str, cx: float, cy: float, r: float, fill: tuple) -> None:
    """The glyph in PIL's default font, its ink box centred on (cx, cy) and about 2r tall."""
    font = _font(max(8, round(2.4 * r)))
    x0, y0, x1, y1 = draw.textbbox((0, 0), glyph, font=font)
    draw.text((cx - (x0 + x1) / 2, cy - (y0 + y1) / 2), glyph, font=font, fill=fill)
