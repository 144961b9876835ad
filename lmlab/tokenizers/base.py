"""The tokenizer registry and the interface every tokenizer implements."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lmlab.errors import ConfigError
from lmlab.registry import Registry
from lmlab.tokenizers.pretokenize import special_splitter

if TYPE_CHECKING:
    from lmlab.tokenizers.bpe import BPETokenizer

TOKENIZERS = Registry("tokenizer", group="tokenizer",
                      doc="text <-> token ids; built as target(source, cache_dir, progress, cfg=Config)")

EOT = "<|endoftext|>"

# Every Tokenizer subclass by class name, so a tokenizer saved in a checkpoint is rebuilt by
# the class that saved it (a plugin's class registers when its module is imported).
TOKENIZER_CLASSES: dict[str, type[Tokenizer]] = {}


def expected_vocab_size(tokenizer_cfg) -> int:
    """The vocabulary a tokenizer config asks for, known before it is built or trained: a trained one's
    (`path` with a GPT-2 vocab.json: its tokens and any special token missing from them), else its
    `vocab_size` field where it has one (a trained tokenizer may stop short of it), else the 256 byte
    ids plus its special tokens."""
    specials = set(tokenizer_cfg.get("special_tokens") or [])
    vocab_file = Path(tokenizer_cfg.get("path") or "").expanduser() / "vocab.json"
    if tokenizer_cfg.get("path") and vocab_file.is_file():
        return len(json.loads(vocab_file.read_text(encoding="utf-8")).keys() | specials)
    vocab_size = tokenizer_cfg.get("vocab_size")
    return vocab_size or 256 + len(specials)


class Tokenizer(ABC):
    """Maps text to token ids and back. Special tokens are matched before anything else."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        TOKENIZER_CLASSES[cls.__name__] = cls

    def __init__(self, special_tokens: list[str]):
        self.special_tokens = list(dict.fromkeys(special_tokens))
        self._special_split = special_splitter(self.special_tokens)
        self._byte_lengths: np.ndarray | None = None  # byte_lengths(), built on first use

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

    @abstractmethod
    def to_dict(self) -> dict:
        """Everything needed to rebuild this tokenizer, as plain str/int/list/dict data (no pickled
        objects, so a checkpoint holding it loads with `weights_only=True`); `from_dict` reads it."""

    @classmethod
    @abstractmethod
    def from_dict(cls, data: dict, where: str) -> Tokenizer:
        """The tokenizer `to_dict` describes; `where` names the origin in errors."""

    def to_bpe(self) -> BPETokenizer:
        """The same ids as a byte-level BPE (`BPETokenizer`), the form GPT-2 files and Hugging Face take."""
        raise ConfigError(f"{type(self).__name__} has no byte-level BPE form, so no GPT-2/Hugging Face files")

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

    def byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for (int64, one per id), special tokens 0: they mark boundaries, not
        text, as the corpus's byte count (lmlab.data.cache) leaves them out too."""
        if self._byte_lengths is None:
            specials = {self.special_id(t) for t in self.special_tokens}
            lengths = np.zeros(self.vocab_size, dtype=np.int64)
            try:
                pieces = self.to_bpe().vocab
            except ConfigError:  # no byte-level form (a plugin's tokenizer): each id's text on its own
                pieces = {i: self.decode([i]).encode("utf-8") for i in range(self.vocab_size)}
            for i, piece in pieces.items():
                if i not in specials and i < len(lengths):
                    lengths[i] = len(piece)
            self._byte_lengths = lengths
        return self._byte_lengths

    def text_bytes(self, ids) -> int:
        """UTF-8 bytes of the text `ids` encode (special tokens count 0): the denominator of bits per byte."""
        return int(self.byte_lengths()[np.asarray(ids, dtype=np.int64)].sum())

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


def pack_tokenizer(tokenizer: Tokenizer) -> dict:
    """A tokenizer as plain data, e.g. for a checkpoint: its class, `to_dict()` and fingerprint."""
    return {"class": type(tokenizer).__name__, "data": tokenizer.to_dict(), "fingerprint": tokenizer.fingerprint()}


def unpack_tokenizer(packed: dict, where: str) -> Tokenizer:
    """The tokenizer `pack_tokenizer` saved, checked against its fingerprint (the same ids)."""
    cls = TOKENIZER_CLASSES.get(packed["class"])
    if cls is None:
        raise ConfigError(f"{where} holds a {packed['class']} tokenizer, a class lmlab does not know; "
                          f"import the plugin that defines it (plugins=[...])")
    tokenizer = cls.from_dict(packed["data"], where)
    if tokenizer.fingerprint() != packed["fingerprint"]:
        raise ConfigError(f"{where}: its {packed['class']} tokenizer rebuilds with fingerprint "
                          f"{tokenizer.fingerprint()}, not the saved {packed['fingerprint']}: its token ids would differ")
    return tokenizer
