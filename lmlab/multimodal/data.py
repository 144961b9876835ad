"""Where image-text pairs come from (config group `image_data`): synthetic scenes, a folder, or tar shards.

An entry's `load(image_size, seed)` gives the training and validation pairs (items {"image", "caption"},
images RGB image_size x image_size: the vision encoder's) and, where the data has classes, a zero-shot
set: images of classes never trained on, each with one candidate caption per class.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from omegaconf import MISSING
from torch.utils.data import Dataset, Subset

from lmlab.checks import at_least, in_open_interval
from lmlab.errors import ConfigError
from lmlab.multimodal.image_text import FolderImageText, TarImageText, check_on_missing
from lmlab.multimodal.synthetic import COLORS, SHAPES, SyntheticImageText, split_classes, with_class
from lmlab.registry import Registry

IMAGE_DATA = Registry("image_data", group="image_data", doc="image-text pairs: synthetic scenes, a folder, tar shards")


@dataclass
class ZeroShotSet:
    """Images of held-out classes; row i of `candidates` indexes `texts` (one caption per class), and
    `targets[i]` is the column of the true one."""

    images: Dataset  # items {"image", ...}
    texts: list[str]
    candidates: torch.Tensor  # (N, n_classes) long
    targets: torch.Tensor  # (N,) long

    def __post_init__(self) -> None:
        if not len(self.images) == len(self.candidates) == len(self.targets):
            raise ValueError("a zero-shot set needs one row of candidates and one target per image")


@dataclass
class ImageTextSplits:
    train: Dataset
    val: Dataset
    train_captions: list[str]  # what a tokenizer is trained on
    zero_shot: ZeroShotSet | None = None  # None: the data has no classes to hold out


class ImageData:
    """Base of the entries."""

    def load(self, image_size: int, seed: int) -> ImageTextSplits:
        raise NotImplementedError


@IMAGE_DATA.register("synthetic")
class SyntheticData(ImageData):
    """Seeded synthetic scenes with exact captions; zero-shot on held-out (shape, colour) classes."""

    @dataclass
    class Config:
        n_train: int = 8192  # training pairs (a fixed set: epochs repeat it)
        n_val: int = 256  # validation pairs of the trained classes (val/loss)
        n_zero_shot: int = 256  # images of the held-out classes (val/zero_shot_acc)
        held_out_fraction: float = 1 / 6  # of the (shape, colour) classes: 1/6 holds out one colour per shape
        glyph_fraction: float = 0.0  # share of training scenes that show a digit or letter instead of shapes
        jitter: bool = True  # small seeded shifts of place and size

        def __post_init__(self) -> None:
            at_least("image_data", self, 1, "n_train", "n_val", "n_zero_shot")
            in_open_interval("image_data", self, "held_out_fraction", 0.0, 1.0)
            if not 0.0 <= self.glyph_fraction < 1.0:
                raise ConfigError(f"image_data.glyph_fraction must be in [0, 1), got {self.glyph_fraction}")

    def __init__(self, cfg: Config):
        self.cfg = cfg
        split_classes(cfg.held_out_fraction)  # a fraction that holds out no class (or every one) fails now

    def load(self, image_size: int, seed: int) -> ImageTextSplits:
        c = self.cfg
        seen, held_out = split_classes(c.held_out_fraction, seed)
        train = SyntheticImageText(c.n_train, image_size, seed, seen, c.glyph_fraction, c.jitter)
        val = SyntheticImageText(c.n_val, image_size, seed + 1, seen, c.glyph_fraction, c.jitter)
        probe = SyntheticImageText(c.n_zero_shot, image_size, seed + 2, held_out, 0.0, c.jitter)
        return ImageTextSplits(train, val, [s.caption() for s in train.scenes], zero_shot_set(probe))


def zero_shot_set(data: SyntheticImageText, classes: list[tuple[str, str]] | None = None) -> ZeroShotSet:
    """Each image's candidates: its own scene recaptioned with every (shape, colour) class (default: all of
    them, seen and held out, so a model must get both the shape and the colour right)."""
    classes = classes or [(s, c) for s in SHAPES for c in COLORS]
    index: dict[str, int] = {}
    rows, targets = [], []
    for scene in data.scenes:
        captions = [with_class(scene, label).caption() for label in classes]
        rows.append([index.setdefault(caption, len(index)) for caption in captions])
        targets.append(classes.index(scene.label))
    return ZeroShotSet(data, list(index), torch.tensor(rows, dtype=torch.long), torch.tensor(targets, dtype=torch.long))


@dataclass
class FileDataConfig:
    val_fraction: float = 0.05  # pairs held out for val/loss (seeded)
    on_missing: str = "skip"  # a caption whose image is missing: skip (count, log) or fail (stop, naming the file)

    def __post_init__(self) -> None:
        in_open_interval("image_data", self, "val_fraction", 0.0, 1.0)
        check_on_missing(self.on_missing, "image_data")


def split_pairs(data, fraction: float, seed: int) -> ImageTextSplits:
    """(train, val) subsets of a reader by a seeded shuffle, at least one pair in each."""
    if len(data) < 2:
        raise ConfigError(f"image_data holds {len(data)} usable pair(s); training needs at least 2 (one held out)")
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    n_val = min(max(1, round(len(data) * fraction)), len(data) - 1)
    train, val = order[n_val:], order[:n_val]
    return ImageTextSplits(Subset(data, train), Subset(data, val), [data.captions[i] for i in train])


@IMAGE_DATA.register("folder")
class FolderData(ImageData):
    """Images named by a captions JSONL file: {"image": path relative to the file (or root), "caption": str}."""

    @dataclass
    class Config(FileDataConfig):
        captions: str = MISSING  # the JSONL file
        root: str | None = None  # the folder image paths are relative to; None: the captions file's

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def load(self, image_size: int, seed: int) -> ImageTextSplits:
        data = FolderImageText(self.cfg.captions, image_size, self.cfg.root, self.cfg.on_missing)
        return split_pairs(data, self.cfg.val_fraction, seed)


@IMAGE_DATA.register("tar")
class TarData(ImageData):
    """Webdataset-style tar shards: KEY.jpg/.png/... with KEY.txt or KEY.json ({"caption": ...})."""

    @dataclass
    class Config(FileDataConfig):
        shards: list[str] = field(default_factory=list)  # tar files or glob patterns, e.g. [data/train-*.tar]

    def __init__(self, cfg: Config):
        if not cfg.shards:
            raise ConfigError("image_data=tar needs image_data.shards: tar files or glob patterns, e.g. "
                              "'image_data.shards=[data/train-*.tar]'")
        self.cfg = cfg

    def load(self, image_size: int, seed: int) -> ImageTextSplits:
        data = TarImageText(self.cfg.shards, image_size, self.cfg.on_missing)
        return split_pairs(data, self.cfg.val_fraction, seed)
