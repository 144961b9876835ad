"""Byte-level BPE encoding and decoding (GPT-2 style), with a tiktoken fast path.

Encoding is merge-rank BPE: within each GPT-2 pre-token, repeatedly merge the adjacent pair
that comes earliest in the merge list. When `tiktoken` is installed and the vocabulary is in
merge order (each merge creates a new token whose id grows with the merge's rank), tiktoken's
Rust core is built from lmlab's own ranks and gives the same ids much faster; otherwise the
pure-Python path runs. Special tokens are matched by lmlab in both paths, longest first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from lmlab.errors import ConfigError
from lmlab.tokenizers import gpt2_files
from lmlab.tokenizers.base import Tokenizer
from lmlab.tokenizers.pretokenize import GPT2_PATTERN, GPT2_REGEX, safe_cut

try:
    import tiktoken
except ImportError:  # optional: the pure-Python path gives the same ids
    tiktoken = None


class BPETokenizer(Tokenizer):
    """Byte-level BPE from a vocab (id -> bytes) and merges (in rank order)."""

    def __init__(self, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
                 special_tokens: list[str] | None = None, use_tiktoken: bool = True):
        super().__init__(special_tokens or [])
        self.vocab = dict(vocab)
        self.merges = list(merges)
        for tok in self.special_tokens:  # special tokens missing from the vocab get new ids
            if tok.encode("utf-8") not in self.vocab.values():
                self.vocab[max(self.vocab, default=-1) + 1] = tok.encode("utf-8")
        self.id_of = {b: i for i, b in self.vocab.items()}
        if len(self.id_of) != len(self.vocab):
            raise ConfigError("the vocab maps two ids to the same bytes")
        missing = [b for b in range(256) if bytes([b]) not in self.id_of]
        if missing:
            raise ConfigError(f"a byte-level vocab needs all 256 single bytes; missing {missing[:5]}...")
        self._byte_ids = [self.id_of[bytes([b])] for b in range(256)]
        # (left id, right id) -> (rank, merged id)
        self._ranks: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, (a, b) in enumerate(self.merges):
            ids = [self.id_of.get(a), self.id_of.get(b), self.id_of.get(a + b)]
            if None in ids:
                raise ConfigError(f"merge {rank} ({a!r}, {b!r}) does not match the vocab: "
                                  f"{[a, b, a + b][ids.index(None)]!r} is not a token")
            self._ranks.setdefault((ids[0], ids[1]), (rank, ids[2]))
        self._cache: dict[str, list[int]] = {}
        self._fast = self._tiktoken_core() if use_tiktoken else None

    @classmethod
    def from_files(cls, vocab_path: str | Path, merges_path: str | Path,
                   special_tokens: list[str] | None = None) -> BPETokenizer:
        vocab, merges = gpt2_files.read(vocab_path, merges_path, special_tokens or [])
        return cls(vocab, merges, special_tokens)

    @classmethod
    def from_dir(cls, directory: str | Path, special_tokens: list[str] | None = None) -> BPETokenizer:
        directory = Path(directory)
        for name in ("vocab.json", "merges.txt"):
            if not (directory / name).is_file():
                raise ConfigError(f"{directory} has no {name}: not a saved BPE tokenizer")
        return cls.from_files(directory / "vocab.json", directory / "merges.txt", special_tokens)

    def to_dict(self) -> dict:
        vocab, merges = gpt2_files.to_entries(self.vocab, self.merges, self.special_tokens)
        return {"vocab": vocab, "merges": merges, "special_tokens": self.special_tokens}

    @classmethod
    def from_dict(cls, data: dict, where: str) -> BPETokenizer:
        specials = list(data["special_tokens"])
        return cls(*gpt2_files.from_entries(data["vocab"], data["merges"], specials, where), specials)

    def to_bpe(self) -> BPETokenizer:
        return self

    def save(self, directory: str | Path) -> Path:
        gpt2_files.write(directory, self.vocab, self.merges, self.special_tokens)
        return Path(directory)

    def _tiktoken_core(self):
        """tiktoken built from lmlab's ranks, if installed and exact for this vocab."""
        if tiktoken is None:
            return None
        made = [self.id_of[a + b] for a, b in self.merges]
        # tiktoken ranks a pair by its concatenation's id, which is merge-rank BPE only when
        # ids of merged tokens increase with the merge that first made them.
        firsts = list(dict.fromkeys(made))
        if firsts != sorted(firsts) or any(i < 256 for i in firsts) or len(firsts) != len(made):
            return None
        specials = {t.encode("utf-8") for t in self.special_tokens}
        ranks = {b: i for i, b in self.vocab.items() if b not in specials}
        return tiktoken.Encoding(name=f"lmlab-{self.fingerprint()}", pat_str=GPT2_PATTERN,
                                 mergeable_ranks=ranks, special_tokens={})

    @property
    def uses_tiktoken(self) -> bool:
        return self._fast is not None

    @property
    def vocab_size(self) -> int:
        return max(self.vocab) + 1

    def special_id(self, token: str) -> int:
        return self.id_of[token.encode("utf-8")]

    def _encode_ordinary(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode_ordinary(text)
        return self.encode_pure(text)

    def encode_pure(self, text: str) -> list[int]:
        """Merge-rank BPE in Python (no special tokens); the reference for the tiktoken path."""
        ids: list[int] = []
        cache = self._cache
        for match in GPT2_REGEX.finditer(text):
            piece = match.group()
            word = cache.get(piece)
            if word is None:
                word = cache[piece] = self._bpe(piece.encode("utf-8"))
            ids.extend(word)
        return ids

    def _bpe(self, piece: bytes) -> list[int]:
        word = [self._byte_ids[b] for b in piece]
        ranks = self._ranks
        while len(word) > 1:
            best = min(zip(word, word[1:]), key=lambda p: ranks.get(p, (float("inf"),))[0])
            if best not in ranks:
                break
            merged, (a, b) = ranks[best][1], best
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = out
        return word

    def encode_iterable(self, iterable: Iterable[str], block_chars: int = 1 << 16) -> Iterator[int]:
        """Ids of the concatenated strings, yielded lazily.

        Text is gathered into blocks of about `block_chars` and each block is encoded up to its
        last safe cut (see `pretokenize.safe_cut`), so the ids equal those of `encode` on the
        whole text while memory stays bounded by the block size plus the longest stretch of
        text without a safe cut.
        """
        pending: list[str] = []
        size = 0
        for chunk in iterable:
            pending.append(chunk)
            size += len(chunk)
            if size < block_chars:
                continue
            buffer = "".join(pending)
            cut = safe_cut(buffer, self.special_tokens)
            if cut:
                yield from self.encode(buffer[:cut])
                buffer = buffer[cut:]
            pending, size = [buffer], len(buffer)
        if pending:
            yield from self.encode("".join(pending))

    def decode(self, ids: Iterable[int]) -> str:
        vocab = self.vocab
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    def state(self) -> dict:
        digest = hashlib.sha256()
        for i in sorted(self.vocab):
            digest.update(i.to_bytes(4, "little") + self.vocab[i] + b"\0")
        for a, b in self.merges:
            digest.update(a + b"\1" + b + b"\0")
        return {"bpe": digest.hexdigest(), "special_tokens": self.special_tokens}
