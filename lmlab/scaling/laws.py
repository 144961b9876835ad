"""Scaling-law fits of the published methods, each answering the planner's question: for a compute
budget C (FLOPs), the loss-optimal parameters N*(C), tokens D*(C) and the loss to expect.

- `fit_power_law(x, loss)`: L = E + A / x^alpha in one variable (data or parameters alone), Huber on
  log-loss residuals as Hoffmann et al. fit; `floor=False` drops E (Kaplan et al.'s L = (x_c / x)^alpha).
- `fit_joint(points)`: L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. approach 3). Under
  C = 6 N D its optimum is N* = G (C/6)^(beta/(alpha+beta)), D* = (C/6)^(alpha/(alpha+beta)) / G with
  G = (alpha A / (beta B))^(1/(alpha+beta)).
- `fit_isoflop(points)`: approach 2: per budget a parabola of loss in log N; its minima give power laws
  N*(C) and D*(C), and L*(C) = E + A / C^alpha through the minima's losses.
- `fit_envelope(points)`: approach 1: over log-spaced budgets the lowest loss any run's training curve
  reaches (curves interpolated in log C); power laws through that frontier.
- `fit_kaplan(points)`: Kaplan et al.'s L(N) (each run's final loss) and L(C) (the frontier), no floor.

Every fit has `params()` (for `bootstrap`), and every compute-optimal fit `n_opt(C)`, `d_opt(C)`,
`tokens_per_parameter(C)` and `predicted_loss(C)`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Hashable, Sequence

import numpy as np

from lmlab.errors import ConfigError
from lmlab.scaling.points import Point, arrays, check_points
from lmlab.scaling.robust import HUBER_DELTA, fit_lse

# Hoffmann et al.'s grid of initialisations (log-space coefficients, exponents and floor).
COEFF_GRID = np.arange(0.0, 26.0, 5.0)
EXPONENT_GRID = np.arange(0.0, 2.01, 0.5)
FLOOR_GRID = np.arange(-1.0, 1.01, 0.5)


@dataclass(frozen=True)
class PowerLaw:
    """y = E + A / x^alpha (E = 0: a pure power law, y = A x^-alpha)."""

    A: float
    alpha: float
    E: float = 0.0

    def __call__(self, x):
        return self.E + self.A * np.power(np.asarray(x, float), -self.alpha)

    def params(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "alpha": self.alpha}


def fit_power_law(x: Sequence[float], loss: Sequence[float], floor: bool = True,
                  delta: float = HUBER_DELTA) -> PowerLaw:
    """L = E + A / x^alpha by Huber on log residuals from a grid of starts; floor=False fits L = A / x^alpha
    by least squares in log-log space (the fit is then linear)."""
    x, loss = np.asarray(x, float), np.asarray(loss, float)
    _check_xy(x, loss, 3 if floor else 2, "a power law" + (" with a floor" if floor else ""))
    if not floor:
        slope, intercept = np.polyfit(np.log(x), np.log(loss), 1)
        return PowerLaw(A=math.exp(intercept), alpha=-float(slope))
    a, alpha, e = fit_lse(np.log(x)[None], np.log(loss), [COEFF_GRID, EXPONENT_GRID, FLOOR_GRID], delta=delta)
    return PowerLaw(A=math.exp(a), alpha=alpha, E=math.exp(e))


def _check_xy(x: np.ndarray, y: np.ndarray, needed: int, what: str) -> None:
    if len(x) < needed:
        raise ConfigError(f"{what} needs at least {needed} points, got {len(x)}")
    bad = ~(np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(f"{what}: point {i} ({x[i]}, {y[i]}) is not positive and finite")


class ComputeOptimal(ABC):
    """What the planner asks of a fit: N*(C), D*(C) (by default C / 6N*) and the loss there."""

    @abstractmethod
    def n_opt(self, c): ...

    @abstractmethod
    def predicted_loss(self, c): ...

    def d_opt(self, c):
        return np.asarray(c, float) / (6 * self.n_opt(c))

    def tokens_per_parameter(self, c):
        return self.d_opt(c) / self.n_opt(c)


@dataclass(frozen=True)
class JointLaw(ComputeOptimal):
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n, d):
        return self.E + self.A * np.power(np.asarray(n, float), -self.alpha) + \
            self.B * np.power(np.asarray(d, float), -self.beta)

    def n_opt(self, c):
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        return g * np.power(np.asarray(c, float) / 6, self.beta / (self.alpha + self.beta))

    def predicted_loss(self, c):
        return self.loss(self.n_opt(c), self.d_opt(c))

    def params(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta,
                "a": self.beta / (self.alpha + self.beta), "b": self.alpha / (self.alpha + self.beta)}


def fit_joint(points: Sequence[Point], delta: float = HUBER_DELTA, init: JointLaw | None = None) -> JointLaw:
    """Hoffmann et al.'s approach 3 on every point (final and intermediate losses alike)."""
    check_points(points, 6, "the joint law L(N, D)")
    n, d, _, loss = arrays(points)
    start = None if init is None else [math.log(init.A), math.log(init.B), init.alpha, init.beta, math.log(init.E)]
    a, b, alpha, beta, e = fit_lse(np.log(np.stack([n, d])), np.log(loss),
                                   [COEFF_GRID, COEFF_GRID, EXPONENT_GRID, EXPONENT_GRID, FLOOR_GRID],
                                   delta=delta, init=start)
    return JointLaw(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta)


@dataclass(frozen=True)
class FrontierFit(ComputeOptimal):
    """N*(C) and D*(C) as power laws through compute-optimal points (approaches 1 and 2), and L*(C)."""

    method: str
    n_law: PowerLaw  # N* = A C^-alpha (alpha < 0: N* grows with C)
    d_law: PowerLaw
    loss_law: PowerLaw  # L* = E + A / C^alpha
    optima: list[Point] = field(default_factory=list)  # the points the laws go through
    parabolas: dict[float, np.ndarray] = field(default_factory=dict)  # IsoFLOP: budget -> (c2, c1, c0) in log N

    def n_opt(self, c):
        return self.n_law(c)

    def d_opt(self, c):
        return self.d_law(c)

    def predicted_loss(self, c):
        return self.loss_law(c)

    def params(self) -> dict[str, float]:
        return {"a": -self.n_law.alpha, "b": -self.d_law.alpha, "loss_E": self.loss_law.E,
                "loss_A": self.loss_law.A, "loss_alpha": self.loss_law.alpha}


def _frontier(method: str, optima: list[Point], **extra) -> FrontierFit:
    c = np.array([p.flops for p in optima])
    loss = np.array([p.loss for p in optima])
    loss_law = fit_power_law(c, loss) if len(optima) >= 3 else fit_power_law(c, loss, floor=False)
    return FrontierFit(method, fit_power_law(c, [p.n for p in optima], floor=False),
                       fit_power_law(c, [p.d for p in optima], floor=False), loss_law, optima, **extra)


def law_to_json(fit: ComputeOptimal) -> dict:
    """The fields that rebuild a compute-optimal fit's laws (`law_from_json`), for fits.json and the planner."""
    if isinstance(fit, JointLaw):
        return {"kind": "joint", **asdict(fit)}
    return {"kind": "frontier", "method": fit.method,
            **{name: asdict(getattr(fit, name)) for name in ("n_law", "d_law", "loss_law")}}


def law_from_json(data: dict) -> ComputeOptimal:
    fields = {k: v for k, v in data.items() if k != "kind"}
    if data.get("kind") == "joint":
        return JointLaw(**fields)
    return FrontierFit(fields["method"], *(PowerLaw(**fields[name]) for name in ("n_law", "d_law", "loss_law")))


def budget_of(p: Point) -> float:
    """The budget a point belongs to: the sweep's planned one, else its own FLOPs (to 3 significant digits)."""
    return p.budget if not math.isnan(p.budget) else float(f"{p.flops:.3g}")


def fit_isoflop(points: Sequence[Point]) -> FrontierFit:
    """Approach 2: one parabola L = c2 (log N)^2 + c1 log N + c0 per budget (at least 3 sizes each);
    its vertex is that budget's N*, with D* = C / (6 N*) and the parabola's loss there."""
    check_points(points, 3, "an IsoFLOP fit")
    groups = defaultdict(list)
    for p in points:
        groups[budget_of(p)].append(p)
    optima, parabolas = [], {}
    for budget, group in sorted(groups.items()):
        if len({p.n for p in group}) < 3:
            raise ConfigError(f"IsoFLOP budget {budget:.3g}: {len({p.n for p in group})} model sizes "
                              f"({', '.join(p.run for p in group)}); a parabola needs at least 3")
        log_n = np.log([p.n for p in group])
        coeffs = np.polyfit(log_n, [p.loss for p in group], 2)
        if coeffs[0] <= 0:
            raise ConfigError(f"IsoFLOP budget {budget:.3g}: the losses of {', '.join(p.run for p in group)} do "
                              "not curve upward in log N (no minimum); widen the range of sizes around the optimum")
        vertex = -coeffs[1] / (2 * coeffs[0])
        if not log_n.min() <= vertex <= log_n.max():
            raise ConfigError(f"IsoFLOP budget {budget:.3g}: the parabola's minimum N={math.exp(vertex):.3g} lies "
                              f"outside the swept sizes {min(p.n for p in group):.3g}..{max(p.n for p in group):.3g}; "
                              "extend the sweep toward it")
        n_star = math.exp(vertex)
        optima.append(Point(f"isoflop {budget:.3g}", n_star, budget / (6 * n_star), float(np.polyval(coeffs, vertex)),
                            c=budget, budget=budget))
        parabolas[budget] = coeffs
    if len(optima) < 2:
        raise ConfigError(f"an IsoFLOP fit needs at least 2 budgets, got {len(optima)}")
    return _frontier("isoflop", optima, parabolas=parabolas)


def curves_of(points: Sequence[Point]) -> dict[str, list[Point]]:
    """Each run's points in token order: a run folder's checkpoints (the run name before its last '@step';
    a folder's own path may hold an '@')."""
    curves = defaultdict(list)
    for p in points:
        curves[p.run.rsplit("@", 1)[0]].append(p)
    return {run: sorted(curve, key=lambda p: p.d) for run, curve in curves.items()}


def fit_envelope(points: Sequence[Point], budgets: int = 100) -> FrontierFit:
    """Approach 1: at `budgets` log-spaced FLOP values the run whose training curve (interpolated in log C)
    reaches the lowest loss; power laws through that frontier."""
    check_points(points, 3, "an envelope fit")
    curves = [c for c in curves_of(points).values() if len(c) >= 2]
    if len(curves) < 2:
        raise ConfigError("an envelope fit needs training curves (2 or more checkpoints) of at least 2 runs")
    logs = [(np.log([p.flops for p in c]), np.array([p.loss for p in c]), c[0].n) for c in curves]
    grid = np.linspace(min(lc[0] for lc, _, _ in logs), max(lc[-1] for lc, _, _ in logs), budgets)
    optima = []
    for log_c in grid:
        reach = [(float(np.interp(log_c, lc, loss)), n) for lc, loss, n in logs if lc[0] <= log_c <= lc[-1]]
        if reach:
            loss, n = min(reach)
            c = math.exp(log_c)
            optima.append(Point(f"envelope {c:.3g}", n, c / (6 * n), loss, c=c))
    if len({p.n for p in optima}) < 2:
        raise ConfigError("one run is the lowest at every budget: the envelope gives no N*(C) trend; add larger "
                          "and smaller models, trained long enough that their curves cross")
    return _frontier("envelope", optima)


@dataclass(frozen=True)
class KaplanFit:
    """Kaplan et al. (2020): L(N) = (N_c / N)^alpha_N over each run's final loss, L(C) = (C_c / C)^alpha_C over
    the compute frontier, both without an irreducible floor."""

    loss_n: PowerLaw
    loss_c: PowerLaw

    def params(self) -> dict[str, float]:
        return {"alpha_N": self.loss_n.alpha, "N_c": _scale(self.loss_n), "alpha_C": self.loss_c.alpha,
                "C_c": _scale(self.loss_c)}

    def predicted_loss(self, flops):
        """L(C) = (C_c / C)^alpha_C: the frontier's loss at a budget, with no floor to flatten it."""
        return self.loss_c(flops)


def _scale(law: PowerLaw) -> float:
    """x_c of L = (x_c / x)^alpha, i.e. A^(1/alpha); inf where a near-flat fit puts it beyond a float."""
    log_scale = math.log(law.A) / law.alpha if law.alpha > 0 else math.inf
    return math.exp(log_scale) if log_scale < 700 else math.inf


def fit_kaplan(points: Sequence[Point]) -> KaplanFit:
    check_points(points, 2, "Kaplan's L(N)")
    finals = [curve[-1] for curve in curves_of(points).values()]
    loss_n = fit_power_law([p.n for p in finals], [p.loss for p in finals], floor=False)
    frontier = fit_envelope(points).optima
    return KaplanFit(loss_n, fit_power_law([p.flops for p in frontier], [p.loss for p in frontier], floor=False))


def bootstrap_fits(fit: Callable[[list[Point]], object], units: Sequence[Sequence[Point]], samples: int = 200,
                   seed: int = 0, strata: Sequence[Hashable] | None = None) -> list:
    """`samples` refits, each on units (points, or a run's whole curve) drawn with replacement; within each
    stratum (an IsoFLOP budget) when given. Draws whose fit fails (a degenerate resample) are left out; more
    than half failing is an error."""
    rng = np.random.default_rng(seed)
    strata = list(strata) if strata is not None else [0] * len(units)
    by_stratum = defaultdict(list)
    for i, s in enumerate(strata):
        by_stratum[s].append(i)
    fits = []
    for _ in range(samples):
        chosen = [i for members in by_stratum.values() for i in rng.choice(members, len(members))]
        try:
            fits.append(fit([p for i in chosen for p in units[i]]))
        except ConfigError:
            continue
    if samples - len(fits) > samples // 2:
        raise ConfigError(f"{samples - len(fits)} of {samples} bootstrap refits failed: too few points for a stable fit")
    return fits


def isoflop_residual_fits(fit: FrontierFit, points: Sequence[Point], samples: int = 200, seed: int = 0) -> list:
    """IsoFLOP refits on each budget's parabola plus its own residuals drawn with replacement: with 5 or so
    sizes a budget, resampling the points themselves too often leaves fewer than 3 distinct sizes."""
    rng = np.random.default_rng(seed)
    groups = defaultdict(list)
    for p in points:
        groups[budget_of(p)].append(p)
    fitted = {b: np.polyval(fit.parabolas[b], np.log([p.n for p in g])) for b, g in groups.items() if b in fit.parabolas}
    residuals = {b: np.array([p.loss for p in groups[b]]) - fitted[b] for b in fitted}
    fits = []
    for _ in range(samples):
        drawn = [replace(p, loss=float(loss)) for b in fitted
                 for p, loss in zip(groups[b], fitted[b] + rng.choice(residuals[b], len(groups[b])))]
        try:
            fits.append(fit_isoflop(drawn))
        except ConfigError:
            continue
    if samples - len(fits) > samples // 2:
        raise ConfigError(f"{samples - len(fits)} of {samples} IsoFLOP refits failed: the parabolas are too flat")
    return fits


def _percentile_interval(values: Sequence[float], level: float) -> tuple[float, float]:
    tail = 100 * (1 - level) / 2
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


def intervals(fits: Sequence, level: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile intervals of each of the fits' `params()` (non-finite values left out)."""
    draws: dict[str, list[float]] = defaultdict(list)
    for f in fits:
        for key, value in f.params().items():
            if math.isfinite(value):
                draws[key].append(value)
    return {key: _percentile_interval(v, level) for key, v in draws.items()}


def loss_interval(fits: Sequence, flops: float, level: float = 0.95) -> tuple[float, float] | None:
    """Percentile interval of the fits' predicted loss at `flops` (non-finite values left out; None without any)."""
    losses = [v for v in (float(f.predicted_loss(flops)) for f in fits) if math.isfinite(v)]
    return _percentile_interval(losses, level) if losses else None


def bootstrap(fit: Callable[[list[Point]], object], units: Sequence[Sequence[Point]], samples: int = 200,
              seed: int = 0, level: float = 0.95, strata: Sequence[Hashable] | None = None) -> dict[str, tuple[float, float]]:
    """Percentile intervals of `fit(points).params()` over `bootstrap_fits`."""
    return intervals(bootstrap_fits(fit, units, samples, seed, strata), level)
