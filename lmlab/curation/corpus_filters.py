"""Filters that look across the whole corpus (deduplication), as pipeline stages: entries of FILTERS like the
document filters, but run in three steps so that shards can be processed apart, on any executor:

1. `scan(docs, side)`: in a worker, per shard: a small summary (hashes, signatures); bulky per-document data
   (MinHash's n-gram sets) goes to files under `side`, the shard's own folder;
2. `decide(summaries, sides, executor)`: once, on the driver: the global decision, one item per shard (what that
   shard keeps); heavy parts of it run as executor tasks (MinHash verifies its candidates per pair of shards);
3. `apply(docs, decision)`: in a worker, per shard: a Decision per document.

Documents are ordered by (shard, position), and of duplicates the first in that order is kept, so the output
does not depend on the executor or the number of workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmlab.atomic import atomic_write
from lmlab.checks import at_least
from lmlab.curation.dedup import (MinHasher, UnionFind, document_key, first_occurrences, jaccard, line_key,
                                  lsh_candidates, shingles)
from lmlab.curation.document import Document
from lmlab.curation.filters import FILTERS, Decision, check_fraction
from lmlab.errors import ConfigError


class CorpusFilter(ABC):
    def __init__(self, cfg: Any = None):
        self.cfg = cfg

    @abstractmethod
    def scan(self, docs: list[Document], side: Path) -> Any: ...

    @abstractmethod
    def decide(self, summaries: list[Any], sides: list[Path], executor: Any) -> list[Any]: ...

    @abstractmethod
    def apply(self, docs: list[Document], decision: Any) -> list[Decision]: ...


def _keep_or(rule: str, reason: str, mask: np.ndarray) -> list[Decision]:
    return [Decision.kept() if kept else Decision.dropped(rule, reason) for kept in mask]


@FILTERS.register("exact_dedup")
class ExactDocumentDedup(CorpusFilter):
    """Exact document deduplication: of documents with the same text (a 128-bit hash), the first is kept."""

    def scan(self, docs: list[Document], side: Path) -> list[bytes]:
        return [document_key(d.text) for d in docs]

    def decide(self, summaries: list[list[bytes]], sides: list[Path], executor: Any) -> list[np.ndarray]:
        return first_occurrences(summaries)

    def apply(self, docs: list[Document], decision: np.ndarray) -> list[Decision]:
        return _keep_or("duplicate", "exact_dedup: the same text as an earlier document", decision)


@FILTERS.register("line_dedup")
class LineDedup(CorpusFilter):
    """Exact line deduplication: every line that occurs more than once in the corpus is removed, all its copies
    (menus, footers, boilerplate); a document left with no text is dropped."""

    def scan(self, docs: list[Document], side: Path) -> Counter:
        return Counter(line_key(line) for d in docs for line in d.text.splitlines())

    def decide(self, summaries: list[Counter], sides: list[Path], executor: Any) -> list[set[bytes]]:
        total = Counter()
        for counts in summaries:
            total.update(counts)
        return [{key for key in counts if total[key] > 1} for counts in summaries]

    def apply(self, docs: list[Document], decision: set[bytes]) -> list[Decision]:
        out = []
        for d in docs:
            lines = d.text.splitlines(keepends=True)
            kept = "".join(line for line in lines if line_key(line) not in decision)
            out.append(Decision.kept(kept) if kept.strip() else
                       Decision.dropped("all_lines_duplicated", "line_dedup: every line occurs elsewhere"))
        return out


SHINGLES_FILE = "shingles.npz"


@FILTERS.register("minhash")
class MinHashDedup(CorpusFilter):
    """Near-duplicate removal: MinHash signatures, LSH bands, candidates verified by true n-gram Jaccard,
    clusters by union-find; each cluster keeps its first document (lmlab.curation.dedup has the details)."""

    @dataclass
    class Config:
        num_hashes: int = 100
        num_bands: int = 20
        ngrams: int = 5
        jaccard_threshold: float = 0.8  # the n-gram Jaccard similarity from which two documents are near duplicates
        seed: int = 0

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        at_least("minhash", self.cfg, 1, "num_hashes", "num_bands", "ngrams")
        # 0 would join every LSH candidate unverified; above 1 no pair qualifies and nothing is removed
        check_fraction("minhash.jaccard_threshold", self.cfg.jaccard_threshold, low_open=True)
        if self.cfg.num_hashes % self.cfg.num_bands:
            raise ConfigError(f"minhash: num_bands ({self.cfg.num_bands}) must divide num_hashes "
                             f"({self.cfg.num_hashes})")
        self.hasher = MinHasher(self.cfg.num_hashes, self.cfg.seed)

    def scan(self, docs: list[Document], side: Path) -> np.ndarray:
        sets = [shingles(d.text, self.cfg.ngrams) for d in docs]
        offsets = np.cumsum([0] + [len(s) for s in sets])
        flat = np.concatenate(sets) if sets else np.empty(0, np.uint64)
        atomic_write(side / SHINGLES_FILE, lambda tmp: _save_arrays(tmp, hashes=flat, offsets=offsets))
        if not sets:
            return np.zeros((0, self.cfg.num_hashes), np.uint32)
        return np.stack([self.hasher.signature(s) for s in sets])

    def decide(self, summaries: list[np.ndarray], sides: list[Path], executor: Any) -> list[np.ndarray]:
        sizes = [len(s) for s in summaries]
        starts = np.cumsum([0] + sizes)
        shard_of = np.repeat(np.arange(len(sizes)), sizes)
        signatures = np.concatenate(summaries) if summaries else np.zeros((0, self.cfg.num_hashes), np.uint32)
        by_shards = defaultdict(list)  # (shard a, shard b) -> candidate pairs as positions inside those shards
        for i, j in sorted(lsh_candidates(signatures, self.cfg.num_bands)):
            a, b = int(shard_of[i]), int(shard_of[j])
            by_shards[a, b].append((i - starts[a], j - starts[b]))
        tasks = [(str(sides[a]), str(sides[b]), pairs, self.cfg.jaccard_threshold) for (a, b), pairs in
                 sorted(by_shards.items())]
        clusters = UnionFind(len(signatures))
        for ((a, b), _), similar in zip(sorted(by_shards.items()), executor.map(verify_pairs, tasks, "minhash: verify")):
            for i, j in similar:
                clusters.union(int(starts[a] + i), int(starts[b] + j))
        roots = np.array([clusters.find(i) for i in range(len(signatures))], dtype=np.int64)
        first = roots == np.arange(len(signatures))
        return [first[starts[k]:starts[k + 1]] for k in range(len(sizes))]

    def apply(self, docs: list[Document], decision: np.ndarray) -> list[Decision]:
        return _keep_or("near_duplicate", f"minhash: Jaccard >= {self.cfg.jaccard_threshold:g} with an earlier "
                                          "document", decision)


def _save_arrays(path: Path, **arrays: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object: np.savez would add .npz to the temporary name
        np.savez(f, **arrays)


def _shingle_sets(side: str) -> tuple[np.ndarray, np.ndarray]:
    with np.load(Path(side) / SHINGLES_FILE) as data:
        return data["hashes"], data["offsets"]


def verify_pairs(side_a: str, side_b: str, pairs: list[tuple[int, int]], threshold: float) -> list[tuple[int, int]]:
    """The candidate pairs (positions in shard a, shard b) whose true n-gram Jaccard reaches the threshold."""
    hashes_a, offsets_a = _shingle_sets(side_a)
    hashes_b, offsets_b = (hashes_a, offsets_a) if side_b == side_a else _shingle_sets(side_b)
    return [(i, j) for i, j in pairs
            if jaccard(hashes_a[offsets_a[i]:offsets_a[i + 1]], hashes_b[offsets_b[j]:offsets_b[j + 1]]) >= threshold]
