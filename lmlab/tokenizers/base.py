"""The tokenizer registry and the interface every tokenizer implements."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from lmlab.registry import Registry
from lmlab.tokenizers.pretokenize import special_splitter

TOKENIZERS = Registry("tokenizer", group="tokenizer",
                      doc="text <-> token ids; built as target(source, cache_dir, progress, cfg=Config)")

EOT = "<|endoftext|>"


def expected_vocab_size(tokenizer_cfg) -> int:
    """The vocabulary a tokenizer config asks for, known before it is built or trained: its
    `vocab_size` field where it has one (a trained tokenizer may stop short of it), else the 256
    byte ids plus its special tokens."""
    vocab_size = tokenizer_cfg.get("vocab_size")
    return vocab_size or 256 + len(tokenizer_cfg.get("special_tokens") or [])


class Tokenizer(ABC):
    """Maps text to token ids and back. Special tokens are matched before anything else."""

    def __init__(self, special_tokens: list[str]):
        self.special_tokens = list(dict.fromkeys(special_tokens))
        self._special_split = special_splitter(self.special_tokens)

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def special_id(self, token: str) -> int: ...

    @abstractmethod
    def _encode_ordinary(self, text: str) -> list[int]:
        """Ids of text that contains no special token."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abstractmethod
    def state(self) -> dict:
        """Everything that determines the ids; hashed into cache keys and saved with runs."""

    def encode(self, text: str) -> list[int]:
        if self._special_split is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        for i, piece in enumerate(self._special_split.split(text)):
            if i % 2:
                ids.append(self.special_id(piece))
            elif piece:
                ids.extend(self._encode_ordinary(piece))
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    @property
    def eot_id(self) -> int | None:
        """Id of the end-of-text token that separates documents, if this tokenizer has one."""
        return self.special_id(EOT) if EOT in self.special_tokens else None

    def fingerprint(self) -> str:
        blob = json.dumps({"class": type(self).__name__, **self.state()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"class": type(self).__name__, **self.state()}, indent=2))
        return path
