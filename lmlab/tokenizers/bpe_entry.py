"""The `bpe` tokenizer entry: loaded from a saved folder, or trained on the run's data source.

A tokenizer trained on a source is cached under `<cache_dir>/tokenizers/<key>/` (key: the
source's fingerprint, vocab size and special tokens), so runs on the same data share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from lmlab.errors import ConfigError
from lmlab.tokenizers.base import EOT, TOKENIZERS
from lmlab.tokenizers.bpe import BPETokenizer
from lmlab.tokenizers.bpe_train import train_bpe


@dataclass
class BPEConfig:
    vocab_size: int = 1024
    special_tokens: list[str] = field(default_factory=lambda: [EOT])
    path: str | None = None  # folder with vocab.json + merges.txt; None: train on the run's data
    num_workers: int | None = None  # pre-tokenization processes (None: one per CPU)
    speed_only: ClassVar[tuple[str, ...]] = ("num_workers",)  # settings that never change the token ids


def train_on_source(source, cfg: BPEConfig, progress: bool = True) -> BPETokenizer:
    """Train on the source's documents, joined by the end-of-text token when there is one."""
    separator = EOT if EOT in cfg.special_tokens else ""
    with tempfile.TemporaryDirectory(prefix="lmlab-bpe-") as tmp:
        corpus = Path(tmp) / "corpus.txt"
        text = 0
        with corpus.open("w", encoding="utf-8") as f:
            for doc in source.documents():
                text += len(doc)
                f.write(doc)
                f.write(separator)
        if not text:  # said before training, which would cache a tokenizer of bytes alone
            raise ConfigError("the corpus is empty: the data source yielded no text")
        vocab, merges = train_bpe(corpus, cfg.vocab_size, cfg.special_tokens, cfg.num_workers, progress=progress)
    return BPETokenizer(vocab, merges, cfg.special_tokens)


def _cached(source, cfg: BPEConfig, cache_dir: str | Path, progress: bool) -> BPETokenizer:
    key_src = json.dumps([source.fingerprint(), cfg.vocab_size, cfg.special_tokens])
    folder = Path(cache_dir).expanduser() / "tokenizers" / hashlib.sha256(key_src.encode()).hexdigest()[:20]
    if not folder.is_dir():
        tokenizer = train_on_source(source, cfg, progress)
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        tokenizer.save(tmp)
        try:
            os.replace(tmp, folder)  # atomic: a folder appears whole or not at all
        except OSError:  # another run saved the same tokenizer first
            shutil.rmtree(tmp, ignore_errors=True)
    return BPETokenizer.from_dir(folder, cfg.special_tokens)


@TOKENIZERS.register("bpe", config=BPEConfig)
def bpe(source=None, cache_dir=None, progress: bool = True, *, cfg: BPEConfig) -> BPETokenizer:
    """Byte-level BPE (GPT-2 regex): loaded from tokenizer.path, or trained on the run's data and cached."""
    if cfg.path:
        return BPETokenizer.from_dir(cfg.path, cfg.special_tokens)
    if source is None or cache_dir is None:
        raise ConfigError("tokenizer=bpe without tokenizer.path needs a data source to train on")
    return _cached(source, cfg, cache_dir, progress)
