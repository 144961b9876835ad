"""Image-text pairs from a folder and from tar shards: conversion to the encoder's size and mode, missing
images skipped and counted or failing with the file named; the image_data entries and their splits."""

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image
from lmlab.errors import ConfigError
from lmlab.multimodal.data import IMAGE_DATA
from lmlab.multimodal.image_text import FolderImageText, TarImageText
from lmlab.multimodal.synthetic import COLORS, SHAPES


def _png(mode: str, size: tuple[int, int], colour) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "grey.png").write_bytes(_png("L", (10, 12), 255))
    (tmp_path / "img" / "red.png").write_bytes(_png("RGBA", (16, 16), (255, 0, 0, 255)))
    (tmp_path / "img" / "blue.png").write_bytes(_png("RGB", (8, 8), (0, 0, 255)))
    rows = [{"image": "img/grey.png", "caption": "a grey square"}, {"image": "img/gone.png", "caption": "lost"},
            {"image": "img/red.png", "caption": "a red square"}, {"image": "img/blue.png", "caption": "a blue one"}]
    (tmp_path / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return tmp_path


def test_folder_pairs_are_converted_to_rgb_of_the_expected_size(folder):
    data = FolderImageText(folder / "captions.jsonl", size=16)
    assert len(data) == 3 and data.skipped == 1 and data.captions == ["a grey square", "a red square", "a blue one"]
    grey, red = data[0], data[1]
    assert grey["image"].shape == (3, 16, 16) and torch.allclose(grey["image"], torch.ones(3, 16, 16))
    assert torch.allclose(red["image"].mean((1, 2)), torch.tensor([1.0, 0.0, 0.0]))
    assert data.converted == 2  # the grey one (mode and size) and the RGBA one (mode)


def test_a_missing_image_fails_naming_the_file_when_asked(folder):
    with pytest.raises(ConfigError, match=r"line 2 names the image .*gone.png, which does not exist"):
        FolderImageText(folder / "captions.jsonl", size=16, on_missing="fail")
    with pytest.raises(ConfigError, match="on_missing='ignore'"):
        FolderImageText(folder / "captions.jsonl", size=16, on_missing="ignore")


def test_bad_caption_files_say_what_a_line_should_hold(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        FolderImageText(tmp_path / "none.jsonl", size=16)
    (tmp_path / "bad.jsonl").write_text('{"image": "a.png"}\n')
    with pytest.raises(ConfigError, match='line 1: each line should be {"image"'):
        FolderImageText(tmp_path / "bad.jsonl", size=16)
    (tmp_path / "broken.png").write_bytes(b"not an image")
    (tmp_path / "broken.jsonl").write_text('{"image": "broken.png", "caption": "x"}\n')
    with pytest.raises(ValueError, match="broken.png is not a readable image"):
        FolderImageText(tmp_path / "broken.jsonl", size=16)[0]


def _shard(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_tar_shards_pair_images_with_txt_or_json_captions(tmp_path):
    _shard(tmp_path / "a-000.tar", {"k1.png": _png("RGB", (16, 16), (0, 255, 0)), "k1.txt": b"a green one\n",
                                    "k2.jpg": _png("L", (20, 20), 0), "k2.json": json.dumps({"caption": "dark"}).encode()})
    _shard(tmp_path / "a-001.tar", {"k3.txt": b"no image", "k4.png": _png("RGB", (16, 16), (9, 9, 9)),
                                    "k4.txt": b"grey"})
    data = TarImageText([str(tmp_path / "a-*.tar")], size=16)
    assert data.captions == ["a green one", "dark", "grey"] and data.skipped == 1
    assert torch.allclose(data[0]["image"].mean((1, 2)), torch.tensor([0.0, 1.0, 0.0]))
    assert data[1]["image"].shape == (3, 16, 16)
    with pytest.raises(ConfigError, match=r"a-001.tar: the caption of 'k3' has no image"):
        TarImageText([str(tmp_path / "a-*.tar")], size=16, on_missing="fail")
    with pytest.raises(ConfigError, match="matches no file"):
        TarImageText([str(tmp_path / "b-*.tar")], size=16)


def test_image_data_entries_split_and_check(folder, tmp_path):
    splits = IMAGE_DATA.build({"name": "folder", "captions": str(folder / "captions.jsonl"), "val_fraction": 0.3}).load(8, 0)
    assert len(splits.train) == 2 and len(splits.val) == 1 and splits.zero_shot is None
    assert splits.train[0]["image"].shape == (3, 8, 8) and len(splits.train_captions) == 2
    with pytest.raises(ConfigError, match="needs image_data.shards"):
        IMAGE_DATA.build("tar")
    with pytest.raises(ConfigError, match="on_missing"):
        IMAGE_DATA.build({"name": "folder", "captions": "x.jsonl", "on_missing": "maybe"})


def test_synthetic_zero_shot_set_offers_every_class_and_marks_the_true_one():
    splits = IMAGE_DATA.build({"name": "synthetic", "n_train": 16, "n_val": 4, "n_zero_shot": 8}).load(16, 0)
    probe = splits.zero_shot
    seen = {item["scene"].label for item in (splits.train[i] for i in range(16))}
    assert probe.candidates.shape == (8, len(SHAPES) * len(COLORS))
    for i in range(8):
        scene = probe.images[i]["scene"]
        assert scene.label not in seen  # a held-out class
        assert probe.texts[probe.candidates[i, probe.targets[i]]] == scene.caption()
        assert len({probe.texts[j] for j in probe.candidates[i]}) == len(SHAPES) * len(COLORS)
