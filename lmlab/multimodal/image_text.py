"""Image-text pairs read from a folder (images + a captions JSONL) or from webdataset-style tar shards.

Folder: a JSONL file whose lines are {"image": path relative to the file's folder (or `root`), "caption": str}.
Tar shards: members grouped by key, the name up to its first dot (webdataset's convention): `KEY.jpg`
(or .jpeg/.png/.webp/.bmp) with `KEY.txt` (the caption) or `KEY.json` ({"caption": str}).

Every image comes out as RGB of the size the vision encoder expects (`size` x `size`): other modes are
converted and other sizes resized (bicubic, the aspect ratio not kept); the first such image is logged.
A caption whose image is missing is skipped and counted (`on_missing="skip"`) or stops the run naming
the file (`on_missing="fail"`).
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import tarfile
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

from lmlab.errors import ConfigError
from lmlab.jsonl import json_lines
from lmlab.multimodal.synthetic import to_tensor

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
ON_MISSING = ("skip", "fail")


def check_on_missing(value: str, section: str) -> None:
    if value not in ON_MISSING:
        raise ConfigError(f"{section}.on_missing={value!r}; choose skip (count and leave out) or fail (stop, naming the file)")


def as_rgb_of_size(image: Image.Image, size: int) -> tuple[Image.Image, bool]:
    """The image as RGB, size x size, and whether anything had to change."""
    changed = image.mode != "RGB" or image.size != (size, size)
    if image.mode != "RGB":
        image = image.convert("RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BICUBIC)
    return image, changed


def open_image(data: str | Path | bytes, where: str) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as image:
            image.load()
            return image
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{where} is not a readable image ({err})") from None


class ImageTextDataset(torch.utils.data.Dataset):
    """Base of the readers: items {"image": FloatTensor[3, size, size] in [0, 1], "caption": str}."""

    def __init__(self, size: int):
        if size < 1:
            raise ConfigError(f"image size must be >= 1, got {size}")
        self.size = size
        self.captions: list[str] = []
        self.skipped = 0  # captions left out because their image is missing
        self.converted = 0  # images converted to RGB or resized (counted as they are read)

    def __len__(self) -> int:
        return len(self.captions)

    def image_bytes(self, index: int) -> tuple[str | Path | bytes, str]:
        """(the image's path or bytes, where it is, for messages)."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict:
        data, where = self.image_bytes(index)
        image, changed = as_rgb_of_size(open_image(data, where), self.size)
        if changed:
            self.converted += 1
            if self.converted == 1:
                log.info("%s is not RGB %dx%d (the vision encoder's image_size); images like it are converted",
                         where, self.size, self.size)
        return {"image": to_tensor(image), "caption": self.captions[index]}


def _report_missing(skipped: int, total: int, what: str) -> None:
    if skipped:
        log.warning("%s: %d of %d captions have no image and were skipped (on_missing=skip)", what, skipped, total)


class FolderImageText(ImageTextDataset):
    """Pairs named by a captions JSONL file: {"image": relative path, "caption": text} per line."""

    def __init__(self, captions_file: str | Path, size: int, root: str | Path | None = None, on_missing: str = "skip"):
        super().__init__(size)
        check_on_missing(on_missing, "image_data")
        captions_file = Path(captions_file).expanduser()
        if not captions_file.is_file():
            raise ConfigError(f"captions file {captions_file} does not exist; it should hold lines of "
                              '{"image": "relative/path.jpg", "caption": "..."}')
        root = Path(root).expanduser() if root else captions_file.parent
        expect = 'each line should be {"image": "relative/path.jpg", "caption": "..."}'
        self.paths: list[Path] = []
        total = 0
        for line_no, row in json_lines(captions_file.read_text(encoding="utf-8"), str(captions_file), expect):
            if not isinstance(row, dict) or not isinstance(row.get("image"), str) or not isinstance(row.get("caption"), str):
                raise ConfigError(f"{captions_file} line {line_no}: {expect}")
            total += 1
            path = root / row["image"]
            if not path.is_file():
                if on_missing == "fail":
                    raise ConfigError(f"{captions_file} line {line_no} names the image {path}, which does not exist "
                                      "(set on_missing=skip to leave such captions out)")
                self.skipped += 1
                continue
            self.paths.append(path)
            self.captions.append(row["caption"])
        _report_missing(self.skipped, total, str(captions_file))

    def image_bytes(self, index: int) -> tuple[Path, str]:
        return self.paths[index], str(self.paths[index])


def expand_shards(shards: list[str]) -> list[Path]:
    """Paths and glob patterns -> the tar files, in order; a pattern that matches nothing is an error."""
    files = []
    for pattern in shards:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise ConfigError(f"tar shard {pattern!r} matches no file")
        files += [Path(m) for m in matches]
    if not files:
        raise ConfigError("no tar shards given: set image_data.shards to tar files or glob patterns")
    return files


class TarImageText(ImageTextDataset):
    """Pairs from webdataset-style tar shards: KEY.jpg/.png/... with KEY.txt or KEY.json ({"caption": ...})."""

    def __init__(self, shards: list[str], size: int, on_missing: str = "skip"):
        super().__init__(size)
        check_on_missing(on_missing, "image_data")
        self.shards = expand_shards(shards)
        self.members: list[tuple[int, tarfile.TarInfo]] = []  # (shard index, image member)
        total = 0
        for shard_idx, shard in enumerate(self.shards):
            images, captions = self._index(shard)
            for key, caption in captions.items():
                total += 1
                if key not in images:
                    if on_missing == "fail":
                        raise ConfigError(f"tar shard {shard}: the caption of {key!r} has no image "
                                          f"({'/'.join(s.lstrip('.') for s in IMAGE_SUFFIXES)}) with it "
                                          "(set on_missing=skip to leave such captions out)")
                    self.skipped += 1
                    continue
                self.members.append((shard_idx, images[key]))
                self.captions.append(caption)
        _report_missing(self.skipped, total, f"{len(self.shards)} tar shard(s)")
        self._open: tuple[int, dict[int, tarfile.TarFile]] | None = None  # (pid, open shards) of this process

    def _index(self, shard: Path) -> tuple[dict[str, tarfile.TarInfo], dict[str, str]]:
        images, captions = {}, {}
        try:
            with tarfile.open(shard) as tar:
                for member in tar.getmembers():
                    if not member.isfile():
                        continue
                    key, _, suffix = member.name.partition(".")
                    suffix = "." + suffix.lower()
                    if suffix in IMAGE_SUFFIXES:
                        images[key] = member
                    elif suffix in (".txt", ".json"):
                        captions[key] = self._caption(tar.extractfile(member).read(), suffix, f"{shard}:{member.name}")
        except tarfile.TarError as err:
            raise ConfigError(f"tar shard {shard} cannot be read ({err})") from None
        return images, captions

    @staticmethod
    def _caption(data: bytes, suffix: str, where: str) -> str:
        text = data.decode("utf-8")
        if suffix == ".txt":
            return text.strip()
        try:
            caption = json.loads(text).get("caption")
        except (json.JSONDecodeError, AttributeError):
            caption = None
        if not isinstance(caption, str):
            raise ConfigError(f'{where} should be a JSON object with a "caption" string')
        return caption

    def image_bytes(self, index: int) -> tuple[bytes, str]:
        # Each process (a DataLoader worker) opens the shards itself: a forked file position is shared.
        if self._open is None or self._open[0] != os.getpid():
            self._open = (os.getpid(), {})
        shard_idx, member = self.members[index]
        opened = self._open[1]
        if shard_idx not in opened:
            opened[shard_idx] = tarfile.open(self.shards[shard_idx])
        tar = opened[shard_idx]
        return tar.extractfile(member).read(), f"{self.shards[shard_idx]}:{member.name}"

    def __getstate__(self) -> dict:  # open files do not travel to spawned workers
        return {**self.__dict__, "_open": None}

