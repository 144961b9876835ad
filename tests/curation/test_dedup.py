"""Deduplication: exact lines and documents, MinHash near duplicates, and LSH's detection S-curve."""

import math

import numpy as np
import pytest

from lmlab.curation import exact_document_deduplication, exact_line_deduplication, minhash_deduplication
from lmlab.curation.dedup import MinHasher, jaccard, lsh_candidates, near_duplicate_clusters, normalize, shingles


def _write(folder, texts):
    folder.mkdir()
    paths = []
    for i, text in enumerate(texts):
        paths.append(folder / f"doc{i}.txt")
        paths[-1].write_text(text)
    return paths


def test_exact_line_dedup_drops_every_copy_of_a_repeated_line(tmp_path):
    paths = _write(tmp_path / "in", ["Home\nfirst story\nFooter © 2024\n", "Home\nsecond story\nFooter © 2024",
                                     "third story\n"])
    out = exact_line_deduplication(paths, tmp_path / "out")
    assert [p.read_text() for p in out] == ["first story\n", "second story\n", "third story\n"]


def test_exact_document_dedup_keeps_the_first_copy(tmp_path):
    paths = _write(tmp_path / "in", ["same text", "other text", "same text"])
    assert [p.name for p in exact_document_deduplication(paths, tmp_path / "out")] == ["doc0.txt", "doc1.txt"]


def test_normalisation_ignores_case_accents_punctuation_and_spacing():
    assert normalize("  Café,   CAFÉ!\n\tnaïve—") == "cafe cafe naive"
    assert len(shingles("The cat sat on the mat", 3)) == 4 and len(shingles("a b", 3)) == 1
    assert np.array_equal(shingles("The CAT sat, on the mat!", 3), shingles("the cat sat on the mat", 3))
    assert jaccard(shingles("a b c d", 1), shingles("c d e f", 1)) == pytest.approx(2 / 6)


def test_minhash_keeps_one_document_per_near_duplicate_cluster(tmp_path):
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(5000)]
    base = " ".join(rng.choice(vocab, 300))
    edited = base.replace(base.split()[10], "CHANGED", 1) + " and one more sentence at the end."
    other = " ".join(rng.choice(vocab, 300))
    paths = _write(tmp_path / "in", [base, other, edited.upper(), base])
    kept = minhash_deduplication(paths, num_hashes=100, num_bands=20, ngrams=5, jaccard_threshold=0.8,
                                 output_directory=tmp_path / "out")
    assert [p.name for p in kept] == ["doc0.txt", "doc1.txt"]
    assert kept[0].read_text() == base


def test_signatures_agree_across_processes_given_the_seed():
    a, b = MinHasher(64, seed=3), MinHasher(64, seed=3)
    items = shingles("x y z w", 3)
    assert np.array_equal(a.signature(items), b.signature(items))
    assert not np.array_equal(a.signature(items), MinHasher(64, seed=4).signature(items))


def _pair(rng, similarity, union=100):
    """Two documents of unique words (so their 1-gram sets are the word sets) of about this Jaccard similarity,
    and its exact value."""
    only = round((1 - similarity) * union / 2)  # words in one document only, each side
    common = union - 2 * only
    words = [f"t{x}" for x in rng.choice(10**9, union, replace=False)]
    shared, left, right = words[:common], words[common:common + only], words[common + only:]
    return " ".join(shared + left), " ".join(shared + right), common / union


@pytest.mark.parametrize("similarity", [0.3, 0.5, 0.7, 0.9])
def test_lsh_detection_follows_the_s_curve(similarity):
    """The share of pairs that become candidates is 1 - (1 - s^r)^b, within 4 standard errors."""
    rng, hasher, bands, rows, trials = np.random.default_rng(int(similarity * 10)), MinHasher(100, seed=1), 20, 5, 400
    found = 0
    for _ in range(trials):
        a, b, s = _pair(rng, similarity)
        sig = np.stack([hasher.signature(shingles(a, 1)), hasher.signature(shingles(b, 1))])
        found += bool(lsh_candidates(sig, bands))
    expected = 1 - (1 - s ** rows) ** bands
    error = math.sqrt(max(expected * (1 - expected), 1 / trials) / trials)
    assert abs(found / trials - expected) <= 4 * error, (found / trials, expected)


def test_bad_settings_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="divide"):
        near_duplicate_clusters(["a b c"], num_hashes=10, num_bands=3, ngram=1, jaccard_threshold=0.5)
    for threshold in (1.5, 0):  # 0 would join every LSH candidate unverified
        with pytest.raises(ValueError, match=r"jaccard_threshold must be in \(0, 1\]"):
            near_duplicate_clusters(["a b c"], num_hashes=10, num_bands=2, ngram=1, jaccard_threshold=threshold)
    paths = [_write(tmp_path / "x", ["a"])[0], _write(tmp_path / "y", ["b"])[0]]
    with pytest.raises(ValueError, match="share a name"):
        exact_line_deduplication(paths, tmp_path / "out")
