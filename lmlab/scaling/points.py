"""The data every scaling fit reads: one point per (run, checkpoint) with its model size N, training
tokens D, compute C and loss, as `lmlab scaling collect` writes them (CSV) and the fitters take them."""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from lmlab.errors import ConfigError


@dataclass(frozen=True)
class Point:
    run: str  # the run folder (and checkpoint) the point came from, named in every error about it
    n: float  # parameters the fit counts (non-embedding by default, as Kaplan et al. and Hoffmann et al.)
    d: float  # training tokens seen
    loss: float
    c: float = math.nan  # training FLOPs; NaN: 6 N D
    n_total: float = math.nan  # all parameters, embeddings included
    budget: float = math.nan  # the IsoFLOP budget the run was planned for (NaN outside a sweep)

    @property
    def flops(self) -> float:
        return 6 * self.n * self.d if math.isnan(self.c) else self.c


def check_points(points: Sequence[Point], needed: int, what: str) -> None:
    """One clear error before a fit: enough points for its parameters, and every size, token count and
    loss positive and finite (the offending run named)."""
    if len(points) < needed:
        raise ConfigError(f"{what} needs at least {needed} points (one more than its free parameters), got "
                          f"{len(points)}; add runs or pick a fit with fewer parameters")
    for p in points:
        for name in ("n", "d", "loss"):
            value = getattr(p, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"run {p.run!r}: {name}={value} is not a positive finite number; "
                                  "a diverged or unfinished run? Drop it from the table")


def arrays(points: Sequence[Point]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(N, D, C, L) as float64 arrays."""
    return (np.array([p.n for p in points], float), np.array([p.d for p in points], float),
            np.array([p.flops for p in points], float), np.array([p.loss for p in points], float))


def write_points(points: Iterable[Point], path: str | Path) -> None:
    names = [f.name for f in fields(Point)]
    with Path(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for p in points:
            writer.writerow(asdict(p))


def read_points(path: str | Path) -> list[Point]:
    """Points from a CSV with at least the columns run, n, d and loss (c, n_total and budget optional)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such points table: {path} (write one with `lmlab scaling collect`)")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    required = {"run", "n", "d", "loss"}
    if not rows or not required <= set(rows[0]):
        raise ConfigError(f"{path}: a points table needs the columns {sorted(required)}; it has "
                          f"{sorted(rows[0]) if rows else 'no rows'}")
    optional = [f.name for f in fields(Point) if f.name not in required]
    points = []
    for line, row in enumerate(rows, start=2):
        try:
            extra = {k: float(row[k]) for k in optional if row.get(k) not in (None, "")}
            points.append(Point(row["run"], float(row["n"]), float(row["d"]), float(row["loss"]), **extra))
        except ValueError as err:
            raise ConfigError(f"{path} line {line}: {err}") from None
    return points
