"""Stable 64-bit hashes of words and word n-grams: the same in every process (unlike Python's `hash`), so that
signatures and features made apart (shards, workers, a saved model) agree."""

from __future__ import annotations

import hashlib

import numpy as np

_WORD_HASHES: dict[str, int] = {}  # words repeat (Zipf): each is hashed once per process
_MAX_CACHED_WORDS = 1 << 21
NGRAM_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: an n-gram's hash is a polynomial in its words' hashes


def word_hash(word: str) -> int:
    h = _WORD_HASHES.get(word)
    if h is None:
        if len(_WORD_HASHES) >= _MAX_CACHED_WORDS:
            _WORD_HASHES.clear()
        h = _WORD_HASHES[word] = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
    return h


def ngram_hashes(words: list[str], n: int) -> np.ndarray:
    """The hashes of the words' n-grams, in order (one n-gram of all the words when there are fewer than n)."""
    if not words:
        return np.empty(0, dtype=np.uint64)
    hashes = list(map(_WORD_HASHES.get, words))  # cached words at C speed; the new ones below
    if None in hashes:
        hashes = [word_hash(w) if h is None else h for w, h in zip(words, hashes)]
    h = np.array(hashes, dtype=np.uint64)
    k = min(n, len(words))
    count = len(words) - k + 1
    grams = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wraps mod 2^64, as intended
        for j in range(k):
            grams = grams * NGRAM_MULTIPLIER + h[j:j + count]
    return grams
