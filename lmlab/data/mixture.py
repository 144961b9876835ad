"""`data=mixture`: several text sources mixed by a weighting rule, with each source's epochs reported.

    data:
      name: mixture
      sources:
        web: {name: text_files, paths: [data/clean/shards]}
        code: {name: text_files, paths: [data/code.jsonl]}
      mixing: {name: unimax, max_epochs: 4}
      budget: 2e8            # characters of training text (0: the sources' total)

The weighting rules are a registry (`lmlab list mixing`); each turns the sources' sizes (characters) and the
budget into how many characters to take from each:
- `proportional`: in proportion to size (plain concatenation, one epoch each at the default budget);
- `uniform`: the same from each;
- `temperature`: in proportion to size^(1/T) (T = 1 proportional, larger T flatter, as multilingual models do);
- `unimax`: uniform, but no source more than `max_epochs` passes; what a small source cannot take goes to the
  larger ones (Chung et al. 2023, "UniMax");
- `weights`: given shares by name.

A source is taken whole `floor(epochs)` times plus a seeded sample of its documents for the fraction. Before
that, each source's last documents are held out, as many characters as validation needs of it (`val_fraction`
of the stream, in the training mixture's proportions, at most half a source): validation is documents training
never sees, placed at the end of the stream, where the token cache takes its validation tokens from. The
training documents are shuffled (seeded), so every stretch of the stream holds the mixture.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from lmlab.data.sources import SOURCES, DataConfig, DataSourceError, TextSource, source_at, source_key
from lmlab.registry import Registry, RegistryError

MIXING = Registry("mixing", group="data/mixing", doc="how data=mixture weighs its sources")


@MIXING.register("proportional")
class Proportional:
    """In proportion to each source's size."""

    def __init__(self, cfg: object = None):
        pass

    def __call__(self, sizes: dict[str, float], budget: float) -> dict[str, float]:
        total = sum(sizes.values())
        return {name: budget * size / total for name, size in sizes.items()}


@MIXING.register("uniform")
class Uniform:
    """The same number of characters from every source, however small it is."""

    def __init__(self, cfg: object = None):
        pass

    def __call__(self, sizes: dict[str, float], budget: float) -> dict[str, float]:
        return {name: budget / len(sizes) for name in sizes}


@MIXING.register("temperature")
class Temperature:
    """In proportion to size^(1/temperature): 1 is proportional, larger is flatter."""

    @dataclass
    class Config:
        temperature: float = 2.0

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        if self.cfg.temperature <= 0:
            raise DataSourceError(f"data.mixing.temperature must be > 0, got {self.cfg.temperature}")

    def __call__(self, sizes: dict[str, float], budget: float) -> dict[str, float]:
        return Proportional()({name: size ** (1 / self.cfg.temperature) for name, size in sizes.items()}, budget)


@MIXING.register("unimax")
class UniMax:
    """Uniform over sources, at most `max_epochs` passes over each (Chung et al. 2023, UniMax).

    The budget a small source cannot take is shared by the larger ones, allocated smallest first."""

    @dataclass
    class Config:
        max_epochs: float = 1.0

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        if self.cfg.max_epochs <= 0:
            raise DataSourceError(f"data.mixing.max_epochs must be > 0, got {self.cfg.max_epochs}")

    def __call__(self, sizes: dict[str, float], budget: float) -> dict[str, float]:
        takes, left = {}, budget
        for i, (name, size) in enumerate(sorted(sizes.items(), key=lambda item: item[1])):
            takes[name] = min(left / (len(sizes) - i), self.cfg.max_epochs * size)
            left -= takes[name]
        return {name: takes[name] for name in sizes}


@MIXING.register("weights")
class Weights:
    """Given shares of the budget, by source name (normalised to sum to 1)."""

    @dataclass
    class Config:
        weights: dict[str, float] = field(default_factory=dict)

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()

    def __call__(self, sizes: dict[str, float], budget: float) -> dict[str, float]:
        if set(self.cfg.weights) != set(sizes) or any(w < 0 for w in self.cfg.weights.values()):
            raise DataSourceError(f"mixing weights need a weight >= 0 for each source {sorted(sizes)}, got "
                                  f"{dict(self.cfg.weights)}")
        total = sum(self.cfg.weights.values())
        return {name: budget * self.cfg.weights[name] / total for name in sizes}


@SOURCES.register("mixture")
class Mixture(TextSource):
    """Several sources mixed by a weighting rule (`lmlab list mixing`), with a held-out share of each."""

    @dataclass
    class Config(DataConfig):
        sources: dict[str, Any] = field(default_factory=dict)  # name -> a data source ({name: text_files, ...})
        mixing: Any = "proportional"  # an entry of `lmlab list mixing`, or {name: unimax, max_epochs: 4}
        budget: float = 0.0  # characters of training text; 0: the sources' training parts, all of them
        seed: int = 0

    def __init__(self, cfg: Config):
        self.key = key = source_key()
        if len(cfg.sources) < 1:
            raise DataSourceError(f"data=mixture needs {key}.sources: "
                                  "{NAME: {name: text_files, paths: [...]}, ...}")
        if cfg.budget < 0:
            raise DataSourceError(f"{key}.budget must be >= 0 (0: the sources' total), got {cfg.budget}")
        self.cfg = cfg
        self.sources = {name: _build(SOURCES, source, f"{key}.sources.{name}") for name, source in cfg.sources.items()}
        self.mixing = _build(MIXING, cfg.mixing, f"{key}.mixing")
        self.epochs: dict[str, float] = {}  # filled when the documents are made

    def documents(self) -> Iterator[str]:
        docs = {}
        for name, source in self.sources.items():
            docs[name] = [d for d in source.documents() if d]
            if not docs[name]:
                raise DataSourceError(f"{self.key}.sources.{name} has no documents")
        sizes = {name: float(sum(map(len, d))) for name, d in docs.items()}
        f = self.cfg.val_fraction
        budget = self.cfg.budget or (1 - f) * sum(sizes.values())
        # each source holds out what validation needs of it, f / (1 - f) of what training takes from its rest (at
        # most half of it), so the stream's last f is validation in the training mixture's proportions; what
        # training takes depends on what is left, so the split is found by iterating to its fixed point
        held = dict.fromkeys(sizes, 0.0)
        for _ in range(100):
            takes = self.mixing({n: sizes[n] - held[n] for n in sizes}, budget)
            new = {n: min(takes[n] * f / (1 - f), sizes[n] / 2) for n in sizes}
            if all(abs(new[n] - held[n]) <= 1e-6 * sizes[n] for n in sizes):
                break
            held = new
        cuts = {n: _split_point(d, held[n]) for n, d in docs.items()}
        train = {n: d[:cuts[n]] for n, d in docs.items()}
        train_sizes = {n: float(sum(map(len, d))) for n, d in train.items()}
        takes = self.mixing(train_sizes, budget)
        rng, stream, held_out = random.Random(self.cfg.seed), [], []
        first_pass = not self.epochs  # the tokenizer's training reads the documents before their encoding does
        for name, d in train.items():
            self.epochs[name] = takes[name] / train_sizes[name]
            stream += _take(d, takes[name], rng)
            held_out += docs[name][cuts[name]:]
        rng.shuffle(stream)
        if first_pass:
            print("data=mixture: " + ", ".join(f"{name} {self.epochs[name]:.2f} epochs ({takes[name] / 1e6:.3g}M "
                                               f"characters of {sizes[name] / 1e6:.3g}M)" for name in docs),
                  file=sys.stderr)
        yield from stream
        yield from held_out

    def fingerprint(self) -> str:
        key = [{n: s.fingerprint() for n, s in self.sources.items()}, self.cfg.mixing, self.cfg.budget,
               self.cfg.seed, self.cfg.val_fraction]
        return "mixture-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _build(registry: Registry, cfg: Any, key: str) -> Any:
    """The entry `cfg` selects, built; `key` is where the user wrote it (`data.sources.web`). These fields are typed
    as Any in the mixture's schema, so composing the config did not check them: a wrong name, key or type is one
    line naming `key`, worded as the command line's (lmlab.cli.compose)."""
    from lmlab.cli.compose import unknown_key_message, wrong_type_message

    with source_at(key):
        try:
            return registry.build(cfg)
        except OmegaConfBaseException as err:
            inner = re.sub(r"\[(\d+)\]", r".\1", err.full_key)  # paths[0] -> paths.0, as typed
            full_key = f"{key}.{inner}" if inner else key
            parent = err.parent_node
            if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and parent is not None:
                raise DataSourceError(unknown_key_message(full_key, parent, full_key.rpartition(".")[0])) from None
            if isinstance(err, ValidationError) and parent is not None:
                raise DataSourceError(wrong_type_message(full_key, err.value, parent, err.msg)) from None
            raise DataSourceError(f"{full_key}: {str(err).splitlines()[0]}") from None
        except RegistryError as err:  # an unknown entry name, or none
            raise DataSourceError(f"{key}: {err}") from None


def _split_point(docs: list[str], chars: float) -> int:
    """The index where the last `chars` characters begin, leaving at least one document before it."""
    seen = 0
    for i in range(len(docs) - 1, 0, -1):
        if seen >= chars:
            return i + 1
        seen += len(docs[i])
    return 1


def _take(docs: list[str], chars: float, rng: random.Random) -> list[str]:
    """Whole passes over the documents while `chars` allows, then a seeded sample of them for the rest."""
    size = sum(map(len, docs))
    passes = math.floor(chars / size)
    out, left = docs * passes, chars - passes * size
    for i in rng.sample(range(len(docs)), len(docs)):
        if left <= 0:
            break
        out.append(docs[i])
        left -= len(docs[i])
    return out
