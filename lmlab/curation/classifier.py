"""Text classifiers for quality and toxicity filtering: lmlab's fastText-style model, or a fastText `.bin` file.

lmlab's model is fastText's supervised one (Joulin et al. 2017): the hashed word n-grams of a text (words and,
by default, bigrams, into `buckets` rows) averaged into one embedding, and a linear layer to the labels.
Training data use fastText's format, one example a line: `__label__NAME the text ...` (the prefix is dropped
from label names). A `.bin` file (a fastText model, e.g. Dolma's NSFW or hate-speech classifier) loads through
the `fasttext` package, so both answer `predict(text) -> (label, probability)`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lmlab.atomic import atomic_write
from lmlab.checks import at_least
from lmlab.curation.dedup import normalize
from lmlab.curation.hashing import ngram_hashes
from lmlab.errors import ConfigError

LABEL_PREFIX = "__label__"


@dataclass
class ClassifierConfig:
    dim: int = 32
    buckets: int = 1 << 18  # hashed n-gram rows of the embedding table
    word_ngrams: int = 2  # n-grams of 1..word_ngrams words
    epochs: int = 5
    lr: float = 0.05
    batch_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        at_least("classifier", self, 1, "dim", "buckets", "word_ngrams", "epochs", "batch_size")
        if not self.lr > 0:
            raise ConfigError(f"classifier.lr must be > 0, got {self.lr}")


def read_labelled(path: str | Path) -> list[tuple[str, str]]:
    """(label, text) pairs from a fastText-format file; a line without a label is an error naming it."""
    examples = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        label, _, text = line.partition(" ")
        if not label.startswith(LABEL_PREFIX):
            raise ConfigError(f"{path}:{line_no}: a line must start with {LABEL_PREFIX}NAME, got {label[:40]!r}")
        examples.append((label.removeprefix(LABEL_PREFIX), text))
    return examples


class BagOfNgrams(nn.Module):
    def __init__(self, cfg: ClassifierConfig, n_labels: int):
        super().__init__()
        self.embed = nn.EmbeddingBag(cfg.buckets, cfg.dim, mode="mean", sparse=True)
        self.out = nn.Linear(cfg.dim, n_labels)
        nn.init.uniform_(self.embed.weight, -1 / cfg.dim, 1 / cfg.dim)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids, offsets))


class TextClassifier:
    """lmlab's fastText-style classifier: `train`, `predict`, `save`, `load`."""

    def __init__(self, cfg: ClassifierConfig, labels: Sequence[str], model: BagOfNgrams | None = None):
        self.cfg, self.labels = cfg, list(labels)
        self.model = model or BagOfNgrams(cfg, len(self.labels))

    def features(self, text: str) -> np.ndarray:
        words = normalize(text).split() or [""]
        grams = [ngram_hashes(words, n) for n in range(1, self.cfg.word_ngrams + 1) if n <= len(words)]
        return (np.concatenate(grams) % np.uint64(self.cfg.buckets)).astype(np.int64)

    def _batch(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        feats = [self.features(t) for t in texts]
        offsets = torch.tensor(np.cumsum([0] + [len(f) for f in feats[:-1]]), dtype=torch.long)
        return torch.from_numpy(np.concatenate(feats)), offsets

    @classmethod
    def train(cls, examples: Sequence[tuple[str, str]], cfg: ClassifierConfig | None = None) -> TextClassifier:
        cfg = cfg or ClassifierConfig()
        labels = sorted({label for label, _ in examples})
        if len(labels) < 2:
            raise ConfigError(f"a classifier needs examples of at least 2 labels, got {labels}")
        torch.manual_seed(cfg.seed)
        clf = cls(cfg, labels)
        index = {label: i for i, label in enumerate(labels)}
        sparse = torch.optim.SparseAdam(list(clf.model.embed.parameters()), lr=cfg.lr)
        dense = torch.optim.Adam(list(clf.model.out.parameters()), lr=cfg.lr)
        order, rng = list(range(len(examples))), random.Random(cfg.seed)
        clf.model.train()
        for _ in range(cfg.epochs):
            rng.shuffle(order)
            for start in range(0, len(order), cfg.batch_size):
                batch = [examples[i] for i in order[start:start + cfg.batch_size]]
                ids, offsets = clf._batch([text for _, text in batch])
                target = torch.tensor([index[label] for label, _ in batch])
                loss = nn.functional.cross_entropy(clf.model(ids, offsets), target)
                sparse.zero_grad()
                dense.zero_grad()
                loss.backward()
                sparse.step()
                dense.step()
        clf.model.eval()
        return clf

    @torch.no_grad()
    def predict_batch(self, texts: Sequence[str]) -> list[tuple[str, float]]:
        probs = self.model(*self._batch(texts)).softmax(-1)
        best = probs.max(-1)
        return [(self.labels[i], float(p)) for p, i in zip(best.values, best.indices)]

    def predict(self, text: str) -> tuple[str, float]:
        return self.predict_batch([text])[0]

    def accuracy(self, examples: Sequence[tuple[str, str]]) -> float:
        predicted = self.predict_batch([text for _, text in examples])
        return sum(p == label for (p, _), (label, _) in zip(predicted, examples)) / max(len(examples), 1)

    def save(self, path: str | Path) -> Path:
        state = {"config": asdict(self.cfg), "labels": self.labels, "model": self.model.state_dict()}
        atomic_write(Path(path), lambda tmp: torch.save(state, tmp))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> TextClassifier:
        state = torch.load(path, map_location="cpu", weights_only=True)
        clf = cls(ClassifierConfig(**state["config"]), state["labels"])
        clf.model.load_state_dict(state["model"])
        clf.model.eval()
        return clf


def existing_model(path: str | Path, what: str, sources: str = "") -> Path:
    """The model file's path; a missing file is one clear error saying where models come from (`sources`, else
    MODEL_SOURCES)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{what} model file {path} does not exist: {sources or MODEL_SOURCES}")
    return path


MODEL_SOURCES = ("train a classifier with `lmlab data train-classifier`, or give the path of a fastText .bin model "
                 "(e.g. lid.176.bin for language ID, Dolma's NSFW or hate-speech classifiers)")


class FastTextClassifier:
    """A fastText `.bin` (or `.ftz`) model through the `fasttext` package (pip install fasttext-wheel)."""

    def __init__(self, path: str | Path, sources: str = ""):
        """`sources`: where such a model comes from, for the error a missing file gives (MODEL_SOURCES by default)."""
        path = existing_model(path, "fastText", sources or MODEL_SOURCES)
        try:
            import fasttext
        except ImportError:
            raise ConfigError(f"{path} is a fastText model: pip install fasttext-wheel to load it") from None
        self.model = fasttext.load_model(str(path))

    def predict(self, text: str) -> tuple[str, float]:
        # the list form: fasttext 0.9's single-text form fails under NumPy 2 (np.array(copy=False))
        labels, probs = self.model.predict([text.replace("\n", " ")])
        return labels[0][0].removeprefix(LABEL_PREFIX), min(float(probs[0][0]), 1.0)


def load_classifier(path: str | Path) -> TextClassifier | FastTextClassifier:
    """lmlab's saved classifier, or a fastText `.bin`/`.ftz` file; a missing file is one clear error."""
    path = existing_model(path, "classifier")
    return FastTextClassifier(path) if path.suffix in (".bin", ".ftz") else TextClassifier.load(path)
