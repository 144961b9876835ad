"""Deduplication: exact (lines, documents) and near-duplicate (MinHash + LSH, verified by true Jaccard).

MinHash: a document becomes the set of its word n-grams after normalisation (lower case, NFD, accents and
punctuation removed, whitespace collapsed), each n-gram a stable 64-bit hash (a polynomial in its words'
hashes); each of `num_hashes` hash functions (multiply-shift: odd a, then the high 32 bits of a x + b mod 2^64)
keeps its minimum over the set.
Two sets agree on one function's minimum with probability equal to their Jaccard similarity. LSH cuts the
signature into `num_bands` bands of r = num_hashes / num_bands rows: documents sharing any whole band are
candidates, which happens with probability 1 - (1 - s^r)^b at similarity s. Candidates whose true n-gram
Jaccard reaches the threshold are joined (union-find), and each cluster keeps its first document.

The file-level functions take CS336's shapes: every input file is one document, and the output folder gets
the files that are kept (line dedup: every file, less its duplicated lines), under the same names.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lmlab.curation.hashing import ngram_hashes

_NOT_WORD = re.compile(r"[^\w\s]")
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lower case, NFD with the combining accents dropped, punctuation removed, whitespace collapsed."""
    text = text.lower()
    if not text.isascii():  # most text needs no decomposition; skipping it saves most of the time
        decomposed = unicodedata.normalize("NFD", text)
        if len(decomposed) != len(text):  # something decomposed into a base and its marks: drop the marks
            text = "".join(ch for ch in decomposed if not unicodedata.combining(ch))
    return _SPACE.sub(" ", _NOT_WORD.sub(" ", text)).strip()


def shingles(text: str, n: int) -> np.ndarray:
    """The normalised text's word n-grams as sorted, distinct 64-bit hashes (a text of fewer than n words is
    one n-gram of all of them); the same in every process."""
    return np.unique(ngram_hashes(normalize(text).split(), n))


class MinHasher:
    """`num_hashes` multiply-shift hash functions from a seed: the same seed gives the same signatures in any
    process, so signatures made apart (shards, workers) can be compared."""

    def __init__(self, num_hashes: int, seed: int = 0):
        if num_hashes < 1:
            raise ValueError(f"num_hashes must be >= 1, got {num_hashes}")
        rng = np.random.default_rng(seed)
        self.a = rng.integers(0, 2**63, num_hashes, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd
        self.b = rng.integers(0, 2**63, num_hashes, dtype=np.uint64)

    def signature(self, shingle_hashes: np.ndarray) -> np.ndarray:
        """(num_hashes,) uint32 minima over the shingles; an empty set's signature is all 2^32 - 1."""
        if not len(shingle_hashes):
            return np.full(len(self.a), 2**32 - 1, dtype=np.uint32)
        with np.errstate(over="ignore"):  # wraps mod 2^64, as multiply-shift hashing intends
            mixed = (shingle_hashes[:, None] * self.a[None, :] + self.b[None, :]) >> np.uint64(32)
        return mixed.min(axis=0).astype(np.uint32)


ALL_PAIRS_UP_TO = 64  # a larger LSH bucket (many copies of one page) pairs each member with its first, not all pairs


def lsh_candidates(signatures: np.ndarray, num_bands: int) -> set[tuple[int, int]]:
    """Pairs (i < j) of rows that agree on all of at least one band's rows. Within a bucket every pair is a
    candidate, except in buckets of more than ALL_PAIRS_UP_TO rows, whose members pair with the first only
    (linear, not quadratic, in the copies of a page repeated thousands of times)."""
    n, num_hashes = signatures.shape
    if num_bands < 1 or num_hashes % num_bands:
        raise ValueError(f"num_bands ({num_bands}) must divide num_hashes ({num_hashes})")
    rows = num_hashes // num_bands
    pairs = set()
    for band in range(num_bands):
        keys = np.ascontiguousarray(signatures[:, band * rows:(band + 1) * rows]).view(np.dtype((np.void, 4 * rows)))
        _, bucket, sizes = np.unique(keys.ravel(), return_inverse=True, return_counts=True)
        shared = np.flatnonzero(sizes[bucket] > 1)
        shared = shared[np.argsort(bucket[shared], kind="stable")]  # grouped by bucket, in row order inside one
        for members in np.split(shared, np.flatnonzero(np.diff(bucket[shared])) + 1):
            members = members.tolist()
            if len(members) > ALL_PAIRS_UP_TO:
                pairs.update((members[0], m) for m in members[1:])
            else:
                pairs.update((members[x], members[y]) for x in range(len(members)) for y in range(x + 1, len(members)))
    return pairs


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted arrays of distinct shingle hashes."""
    union = len(a) + len(b) - (common := len(np.intersect1d(a, b, assume_unique=True)))
    return common / union if union else 1.0


class UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        a, b = self.find(i), self.find(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)  # the earlier document stays the root: it is the one kept


def near_duplicate_clusters(texts: Sequence[str], num_hashes: int, num_bands: int, ngram: int,
                            jaccard_threshold: float, seed: int = 0) -> list[int]:
    """Each text's cluster: the index of the first text it is a near duplicate of (itself if none)."""
    if not 0 < jaccard_threshold <= 1:  # as the minhash stage checks it
        raise ValueError(f"jaccard_threshold must be in (0, 1], got {jaccard_threshold}")
    if ngram < 1:
        raise ValueError(f"ngrams must be >= 1, got {ngram}")
    hasher = MinHasher(num_hashes, seed)
    sets = [shingles(t, ngram) for t in texts]
    signatures = np.stack([hasher.signature(s) for s in sets]) if sets else np.zeros((0, num_hashes), np.uint32)
    clusters = UnionFind(len(texts))
    for i, j in sorted(lsh_candidates(signatures, num_bands)):
        if jaccard(sets[i], sets[j]) >= jaccard_threshold:
            clusters.union(i, j)
    return [clusters.find(i) for i in range(len(texts))]


def _read(paths: Sequence[os.PathLike]) -> list[str]:
    return [Path(p).read_text(encoding="utf-8", errors="replace") for p in paths]


def _write_kept(out: Path, paths: Sequence[os.PathLike], texts: Sequence[str], keep: Sequence[bool]) -> list[Path]:
    """Writes each kept text to `out` under its input file's name; returns the files written."""
    written = []
    for path, text, kept in zip(paths, texts, keep):
        if kept:
            written.append(out / Path(path).name)
            written[-1].write_text(text, encoding="utf-8")
    return written


def _output_folder(output_directory: os.PathLike, paths: Sequence[os.PathLike]) -> Path:
    out = Path(output_directory)
    names = [Path(p).name for p in paths]
    if len(set(names)) != len(names):
        raise ValueError("input files share a name, so their outputs would overwrite one another in "
                         f"{out}: {sorted(n for n, c in Counter(names).items() if c > 1)[:3]}")
    out.mkdir(parents=True, exist_ok=True)
    return out


def minhash_deduplication(input_files: Sequence[os.PathLike], num_hashes: int, num_bands: int, ngrams: int,
                          jaccard_threshold: float, output_directory: os.PathLike, seed: int = 0) -> list[Path]:
    """Writes to `output_directory` the input files that are not near duplicates of an earlier one; returns them."""
    out = _output_folder(output_directory, input_files)
    texts = _read(input_files)
    clusters = near_duplicate_clusters(texts, num_hashes, num_bands, ngrams, jaccard_threshold, seed)
    return _write_kept(out, input_files, texts, [cluster == i for i, cluster in enumerate(clusters)])


def line_key(line: str) -> bytes:
    """A line's identity without its line ending (a file's last line may lack one)."""
    return hashlib.blake2b(line.rstrip("\r\n").encode(), digest_size=12).digest()


def exact_line_deduplication(input_files: Sequence[os.PathLike], output_directory: os.PathLike) -> list[Path]:
    """Two passes over the files: count every line (by a 96-bit hash), then rewrite each file without the lines
    that occur more than once anywhere in the corpus (all their copies go: boilerplate, menus, footers)."""
    out = _output_folder(output_directory, input_files)
    counts: Counter[bytes] = Counter()
    for path in input_files:
        with open(path, encoding="utf-8", errors="replace") as f:
            counts.update(line_key(line) for line in f)
    written = []
    for path in input_files:
        target = out / Path(path).name
        with open(path, encoding="utf-8", errors="replace") as f, open(target, "w", encoding="utf-8") as dst:
            dst.writelines(line for line in f if counts[line_key(line)] == 1)
        written.append(target)
    return written


def document_key(text: str) -> bytes:
    """A document's identity for exact deduplication: a 128-bit hash of its text."""
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def first_occurrences(keys_by_shard: Sequence[Sequence[bytes]]) -> list[np.ndarray]:
    """Per shard, which keys no earlier one had, in (shard, position) order."""
    seen, keep = set(), []
    for keys in keys_by_shard:
        mask = np.zeros(len(keys), dtype=bool)
        for i, key in enumerate(keys):
            mask[i] = key not in seen
            seen.add(key)
        keep.append(mask)
    return keep


def exact_document_deduplication(input_files: Sequence[os.PathLike], output_directory: os.PathLike) -> list[Path]:
    """Writes the files whose exact text no earlier file had; returns them."""
    out = _output_folder(output_directory, input_files)
    texts = _read(input_files)
    return _write_kept(out, input_files, texts, first_occurrences([[document_key(t) for t in texts]])[0])
