"""Atomic writes give files the usual mode (0666 minus the umask), not mkstemp's private 0600."""

import os
import stat

import pytest

from lmlab.atomic import atomic_write, atomic_write_text
from lmlab.data import SOURCES, load_or_build
from lmlab.tokenizers import BPEConfig, TOKENIZERS


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_get_the_umasks_mode(tmp_path, umask_022):
    atomic_write_text(tmp_path / "a.txt", "text")
    atomic_write(tmp_path / "b.bin", lambda tmp: tmp.write_bytes(b"\0"))
    assert mode(tmp_path / "a.txt") == mode(tmp_path / "b.bin") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin"]


def test_a_writer_that_replaces_the_file_does_not_make_it_private(tmp_path, umask_022):
    def replace_privately(tmp):  # as safetensors' save_file does
        tmp.unlink()
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600))

    atomic_write(tmp_path / "model.safetensors", replace_privately)
    assert mode(tmp_path / "model.safetensors") == 0o644


def test_a_failed_write_leaves_nothing(tmp_path):
    def fail(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "a.txt", fail)
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_files_and_token_cache_are_readable_by_others(tmp_path, umask_022):
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat. " * 50)
    source = SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "corpus.txt")]})
    tokenizer = TOKENIZERS.build(BPEConfig(vocab_size=270), source, tmp_path / "cache", False)
    load_or_build(source, tokenizer, tmp_path / "cache", progress=False)
    (folder,) = (tmp_path / "cache" / "tokenizers").iterdir()
    assert mode(folder) == 0o755
    files = [*folder.iterdir(), *(tmp_path / "cache").glob("*.*")]
    assert len(files) == 4 and {mode(p) for p in files} == {0o644}
