"""GPT-2 pre-tokenization: split on special tokens, then on the GPT-2 regex; count in parallel.

Where text may be cut without changing the pre-tokens matters for both parallel counting and
streaming encoding. No GPT-2 pre-token holds a whitespace character *after* a non-whitespace
one, so the regex always ends a match at a position where a non-whitespace character is
followed by whitespace, and restarts there: cutting the text at such a position gives the same
pre-tokens. Cutting right before a special token is safe too, since text is split on special
tokens first. (A special token that itself contains whitespace rules out the first kind of cut.)
"""

from __future__ import annotations

import os
import re as std_re
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import regex
from tqdm import tqdm

from lmlab.errors import ConfigError

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_REGEX = regex.compile(GPT2_PATTERN)


def special_splitter(special_tokens: Iterable[str]) -> std_re.Pattern | None:
    """A regex that captures special tokens, longest first so overlapping ones resolve to the longest."""
    ordered = sorted(set(special_tokens), key=len, reverse=True)
    return std_re.compile("(" + "|".join(map(std_re.escape, ordered)) + ")") if ordered else None


def pretokens(text: str, splitter: std_re.Pattern | None) -> Iterator[str]:
    """Pre-tokens of `text` with special tokens removed (training never merges across them)."""
    for segment in (splitter.split(text)[::2] if splitter else (text,)):
        for match in GPT2_REGEX.finditer(segment):
            yield match.group()


def safe_cut(text: str, special_tokens: list[str], limit: int | None = None) -> int:
    """The last position <= limit where `text` can be cut without changing its pre-tokens (0: none)."""
    end = len(text) if limit is None else min(limit, len(text))
    if not any(any(c.isspace() for c in tok) for tok in special_tokens):
        for i in range(end - 1, 0, -1):
            if text[i].isspace() and not text[i - 1].isspace():
                return i
    splitter = special_splitter(special_tokens)
    starts = [m.start() for m in splitter.finditer(text, 0, end)] if splitter else []
    return starts[-1] if starts else 0


def _chunk_offsets(path: Path, n_chunks: int, special_tokens: list[str], probe: int = 1 << 16) -> list[int]:
    """Byte offsets that split the file into about n_chunks pieces, each cut at a safe position."""
    size = path.stat().st_size
    offsets = [0]
    with path.open("rb") as f:
        for k in range(1, n_chunks):
            target = max(size * k // n_chunks, offsets[-1])
            f.seek(target)
            raw = f.read(probe)
            lead = next((i for i, b in enumerate(raw) if b & 0xC0 != 0x80), len(raw))  # skip to a character start
            target += lead
            window = raw[lead:].decode("utf-8", errors="ignore")  # may only drop a cut character at the end
            # The last safe cut in the window's first half, else anywhere in the window.
            cut = safe_cut(window, special_tokens, limit=len(window) // 2) or safe_cut(window, special_tokens)
            if cut:
                offsets.append(target + len(window[:cut].encode("utf-8")))
    offsets.append(size)
    return sorted(set(offsets))


def _count_chunk(args: tuple[str, int, int, list[str]]) -> Counter:
    path, start, end, special_tokens = args
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte {start + err.start}: {err.reason})") from None
    del data
    return Counter(pretokens(text, special_splitter(special_tokens)))


def count_pretokens(path: str | Path, special_tokens: list[str], num_workers: int | None = None,
                    min_chunk_bytes: int = 1 << 20, progress: bool = False) -> Counter:
    """Counts of every pre-token in the file, over chunks of about `min_chunk_bytes` counted in
    parallel processes (a file of one chunk is counted here: starting workers would cost more)."""
    path = Path(path)
    size = path.stat().st_size
    n_chunks = max(1, size // min_chunk_bytes)
    offsets = _chunk_offsets(path, n_chunks, special_tokens) if n_chunks > 1 else [0, size]
    jobs = [(str(path), a, b, special_tokens) for a, b in zip(offsets, offsets[1:])]
    if len(jobs) == 1:
        return _count_chunk(jobs[0])
    total: Counter = Counter()
    workers = min(num_workers or os.cpu_count() or 1, len(jobs))
    with ProcessPoolExecutor(max_workers=workers) as pool, \
            tqdm(total=size, desc="pre-tokenizing", unit="B", unit_scale=True, disable=not progress) as bar:
        for (_, start, end, _), counts in zip(jobs, pool.map(_count_chunk, jobs)):
            total.update(counts)
            bar.update(end - start)
    return total
