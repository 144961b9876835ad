"""Tokenized corpora cached on disk as memory-mapped arrays.

The key hashes the source's fingerprint and the tokenizer's, so a change to either builds a
new file and never overwrites one in use. Files are written under a temporary name and renamed
into place; the metadata file is renamed last and marks the entry complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from lmlab.atomic import atomic_write, atomic_write_text
from lmlab.data.sources import DataSourceError, TextSource
from lmlab.tokenizers import Tokenizer

_FLUSH_TOKENS = 1 << 20


@dataclass
class TokenCorpus:
    tokens: np.ndarray  # 1-D, memory-mapped, read-only
    n_bytes: int  # UTF-8 bytes of the text the tokens encode

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / max(len(self.tokens), 1)


def cache_key(source: TextSource, tokenizer: Tokenizer) -> str:
    return hashlib.sha256(f"{source.fingerprint()}|{tokenizer.fingerprint()}".encode()).hexdigest()[:20]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def load_or_build(source: TextSource, tokenizer: Tokenizer, cache_dir: str | Path, progress: bool = True) -> TokenCorpus:
    cache_dir = Path(cache_dir).expanduser()
    key = cache_key(source, tokenizer)
    bin_path, meta_path = cache_dir / f"{key}.bin", cache_dir / f"{key}.json"
    if not (meta_path.exists() and bin_path.exists()):
        cache_dir.mkdir(parents=True, exist_ok=True)
        _build(source, tokenizer, bin_path, meta_path, progress)
    meta = json.loads(meta_path.read_text())
    tokens = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["n_tokens"],))
    return TokenCorpus(tokens=tokens, n_bytes=meta["n_bytes"])


def _build(source: TextSource, tokenizer: Tokenizer, bin_path: Path, meta_path: Path, progress: bool) -> None:
    dtype = token_dtype(tokenizer.vocab_size)
    counts: dict[str, int] = {}
    atomic_write(bin_path, lambda tmp: counts.update(_write_tokens(source, tokenizer, tmp, dtype, progress)))
    meta = {"dtype": dtype.name, "n_tokens": counts["n_tokens"], "n_bytes": counts["n_bytes"],
            "source": source.fingerprint(), "tokenizer": tokenizer.fingerprint()}
    atomic_write_text(meta_path, json.dumps(meta, indent=2))


def _encoded(source: TextSource, tokenizer: Tokenizer, workers: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Each non-empty document with its ids, in order, encoded on `workers` threads (one per CPU): tiktoken's
    encoder releases the GIL, so a corpus of many documents encodes about that many times faster."""
    workers = workers or os.cpu_count() or 1
    docs = (doc for doc in source.documents() if doc)
    with ThreadPoolExecutor(workers) as pool:
        while block := list(islice(docs, 16 * workers)):  # bounded: the corpus need not fit in memory
            yield from zip(block, pool.map(tokenizer.encode_array, block))


def _write_tokens(source: TextSource, tokenizer: Tokenizer, path: Path, dtype: np.dtype,
                  progress: bool) -> dict[str, int]:
    """Stream every document's ids (each followed by end-of-text, if the tokenizer has one) to `path`."""
    eot = tokenizer.eot_id
    n_tokens = n_bytes = n_pending = 0
    pending: list[np.ndarray] = []
    with path.open("wb") as out:
        for doc, ids in tqdm(_encoded(source, tokenizer), desc="tokenizing", unit="doc", disable=not progress):
            pending.append(ids if eot is None else np.append(ids, eot))
            n_bytes += len(doc.encode("utf-8"))
            n_tokens += len(pending[-1])
            n_pending += len(pending[-1])
            if n_pending >= _FLUSH_TOKENS:
                out.write(np.concatenate(pending).astype(dtype).tobytes())
                pending.clear()
                n_pending = 0
        if pending:
            out.write(np.concatenate(pending).astype(dtype).tobytes())
    if n_tokens == 0:
        raise DataSourceError("the corpus is empty: the data source yielded no text")
    return {"n_tokens": n_tokens, "n_bytes": n_bytes}
