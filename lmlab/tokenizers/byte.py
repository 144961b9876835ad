"""Byte-level tokenizer: one id per UTF-8 byte, then the special tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lmlab.tokenizers.base import EOT, TOKENIZERS, Tokenizer
from lmlab.tokenizers.bpe import BPETokenizer


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, special tokens from 256 on; needs no training."""

    @dataclass
    class Config:
        special_tokens: list[str] = field(default_factory=lambda: [EOT])

    def __init__(self, cfg: Config | None = None):
        super().__init__((cfg or self.Config()).special_tokens)
        self._special_ids = {tok: 256 + i for i, tok in enumerate(self.special_tokens)}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.special_tokens)

    def special_id(self, token: str) -> int:
        return self._special_ids[token]

    def _encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        if self._special_split is None or not self._special_split.search(text):
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        return super().encode_array(text)

    def decode(self, ids: list[int]) -> str:
        specials = {i: tok for tok, i in self._special_ids.items()}
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(specials[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def state(self) -> dict:
        return {"special_tokens": self.special_tokens}

    def to_dict(self) -> dict:
        return self.state()  # the special tokens are all there is

    @classmethod
    def from_dict(cls, data: dict, where: str) -> ByteTokenizer:
        return cls(cls.Config(special_tokens=list(data["special_tokens"])))

    def to_bpe(self) -> BPETokenizer:
        """A BPE with no merges: each byte is its own token, and the special tokens follow from 256 on."""
        return BPETokenizer({b: bytes([b]) for b in range(256)}, [], self.special_tokens)


@TOKENIZERS.register("byte", config=ByteTokenizer.Config)
def byte(source=None, cache_dir=None, progress: bool = True, *, cfg: ByteTokenizer.Config) -> ByteTokenizer:
    """UTF-8 bytes as ids 0..255, special tokens from 256 on; needs no training."""
    return ByteTokenizer(cfg)
