"""The fitters recover the laws that generated synthetic data (with noise where a fit must average it)."""

import math

import numpy as np
import pytest

from lmlab.errors import ConfigError
from lmlab.scaling import (JointLaw, Point, PowerLaw, bootstrap, fit_envelope, fit_isoflop, fit_joint, fit_kaplan,
                           fit_power_law, read_points, write_points)

CHINCHILLA = JointLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al.'s fitted law


def grid_points(law=CHINCHILLA, noise=0.005, seed=0):
    rng = np.random.default_rng(seed)
    return [Point(f"n{n:.3g}@{d:.3g}", n, d, float(law.loss(n, d) * math.exp(rng.normal(0, noise))))
            for n in np.logspace(7, 9, 6) for d in np.logspace(8.5, 10.5, 6)]


def isoflop_points(law=CHINCHILLA, budgets=(1e17, 1e18, 1e19), sizes=7):
    return [Point(f"c{c:.0e}-n{n:.3g}", n, c / (6 * n), float(law.loss(n, c / (6 * n))), budget=c)
            for c in budgets for n in law.n_opt(c) * np.logspace(-0.6, 0.6, sizes)]


def curve_points(law=CHINCHILLA):
    return [Point(f"n{n:.3g}@{d:.3g}", n, d, float(law.loss(n, d)))
            for n in np.logspace(6.5, 9, 8) for d in np.logspace(8, 11, 30)]


def test_joint_law_optimum_is_the_closed_form_minimum_along_an_isoflop_line():
    c = 1e21
    n = np.logspace(8, 11, 20001)
    best = n[np.argmin(CHINCHILLA.loss(n, c / (6 * n)))]
    assert CHINCHILLA.n_opt(c) == pytest.approx(best, rel=1e-3)
    assert CHINCHILLA.d_opt(c) * CHINCHILLA.n_opt(c) * 6 == pytest.approx(c)
    assert CHINCHILLA.params()["a"] == pytest.approx(0.28 / 0.62)


def test_joint_fit_recovers_the_law_from_noisy_losses_and_its_intervals_cover_it():
    points = grid_points()
    fit = fit_joint(points)
    # 0.5% multiplicative noise on 36 points: exponents within 0.03, the floor within 6%, N*(1e21) within 15%
    assert fit.alpha == pytest.approx(0.34, abs=0.03) and fit.beta == pytest.approx(0.28, abs=0.03)
    assert fit.E == pytest.approx(1.69, rel=0.06)
    assert fit.n_opt(1e21) == pytest.approx(CHINCHILLA.n_opt(1e21), rel=0.15)
    assert fit.predicted_loss(1e21) == pytest.approx(CHINCHILLA.predicted_loss(1e21), rel=0.01)
    intervals = bootstrap(lambda p: fit_joint(p, init=fit), [[p] for p in points], samples=60)
    for name, value in fit.params().items():
        low, high = intervals[name]
        assert low < value < high, (name, value, low, high)
    for name in ("alpha", "beta", "a"):  # this draw's exponents are covered (seeded: not a coin toss per run)
        assert intervals[name][0] <= CHINCHILLA.params()[name] <= intervals[name][1]


def test_noise_free_joint_fit_is_exact():
    fit = fit_joint(grid_points(noise=0.0))
    for name, true in CHINCHILLA.params().items():
        assert fit.params()[name] == pytest.approx(true, rel=1e-3)


def test_power_law_with_and_without_a_floor():
    x = np.logspace(6, 10, 12)
    law = PowerLaw(A=300.0, alpha=0.3, E=2.0)
    fit = fit_power_law(x, law(x))
    assert (fit.E, fit.A, fit.alpha) == pytest.approx((2.0, 300.0, 0.3), rel=1e-3)
    pure = fit_power_law(x, 5e3 * x ** -0.07, floor=False)
    assert (pure.A, pure.alpha, pure.E) == pytest.approx((5e3, 0.07, 0.0), rel=1e-9)


def test_isoflop_minima_and_exponents():
    fit = fit_isoflop(isoflop_points())
    # The parabola in log N approximates each isoflop curve; its vertex sits near the true optimum.
    for optimum in fit.optima:
        assert optimum.n == pytest.approx(CHINCHILLA.n_opt(optimum.budget), rel=0.05)
    assert fit.params()["a"] == pytest.approx(CHINCHILLA.params()["a"], abs=0.01)
    assert fit.params()["a"] + fit.params()["b"] == pytest.approx(1.0, abs=1e-6)  # D* = C / 6N*
    assert fit.predicted_loss(1e20) == pytest.approx(CHINCHILLA.predicted_loss(1e20), rel=0.005)


def test_isoflop_on_exact_parabolas_finds_their_vertices():
    points = []
    for c, vertex in ((1e18, 1e8), (1e19, 3e8), (1e20, 9e8)):
        for log_n in np.log(vertex) + np.linspace(-1, 1, 5):
            points.append(Point(f"{c}-{log_n:.2f}", math.exp(log_n), c / (6 * math.exp(log_n)),
                                3.0 + 0.1 * (log_n - math.log(vertex)) ** 2, budget=c))
    fit = fit_isoflop(points)
    assert [p.n for p in fit.optima] == pytest.approx([1e8, 3e8, 9e8], rel=1e-6)
    assert fit.params()["a"] == pytest.approx(math.log(3) / math.log(10), rel=1e-6)


def test_envelope_and_kaplan_fits_follow_the_frontier():
    points = curve_points()
    fit = fit_envelope(points)
    assert fit.params()["a"] == pytest.approx(CHINCHILLA.params()["a"], abs=0.05)
    assert fit.n_opt(1e19) == pytest.approx(CHINCHILLA.n_opt(1e19), rel=0.3)
    kaplan = fit_kaplan(points)
    assert 0 < kaplan.params()["alpha_C"] < kaplan.params()["alpha_N"]


def test_isoflop_bootstrap_resamples_within_budgets():
    points = isoflop_points(sizes=9)
    budgets = [p.budget for p in points]
    intervals = bootstrap(fit_isoflop, [[p] for p in points], samples=15, strata=budgets)
    low, high = intervals["a"]
    assert low <= CHINCHILLA.params()["a"] + 0.01 and high >= CHINCHILLA.params()["a"] - 0.01


@pytest.mark.parametrize("change, message", [
    (lambda ps: ps[:4], "at least 6 points"),
    (lambda ps: [*ps[:-1], Point("diverged", ps[-1].n, ps[-1].d, float("nan"))], "run 'diverged': loss=nan"),
    (lambda ps: [*ps[:-1], Point("empty", 0.0, ps[-1].d, 3.0)], "run 'empty': n=0.0"),
])
def test_joint_fit_bad_input(change, message):
    with pytest.raises(ConfigError, match=message):
        fit_joint(change(grid_points()))


def test_isoflop_bad_input_names_the_budget():
    points = isoflop_points()
    with pytest.raises(ConfigError, match="budget 1e\\+17: 2 model sizes"):
        fit_isoflop(points[:2] + points[7:])
    one_sided = [p for p in points if p.n < CHINCHILLA.n_opt(p.budget)]  # 3 sizes below each optimum
    with pytest.raises(ConfigError, match="outside the swept sizes"):
        fit_isoflop(one_sided)


def test_points_table_round_trip(tmp_path):
    points = [Point(p.run, p.n, p.d, p.loss, c=6 * p.n * p.d, n_total=1.2 * p.n, budget=p.budget)
              for p in isoflop_points()[:3]]
    write_points(points, tmp_path / "points.csv")
    assert read_points(tmp_path / "points.csv") == points
    (tmp_path / "bad.csv").write_text("run,n\nx,1\n")
    with pytest.raises(ConfigError, match="needs the columns"):
        read_points(tmp_path / "bad.csv")


def test_isoflop_residual_refits_bracket_the_fit_with_five_sizes_a_budget():
    from lmlab.scaling.laws import intervals, isoflop_residual_fits

    rng = np.random.default_rng(1)
    points = [Point(p.run, p.n, p.d, p.loss * math.exp(rng.normal(0, 0.003)), budget=p.budget)
              for p in isoflop_points(sizes=5)]
    fit = fit_isoflop(points)
    refits = isoflop_residual_fits(fit, points, samples=16)
    assert len(refits) >= 14  # the sizes stay: only the losses are redrawn
    low, high = intervals(refits)["a"]
    assert low < fit.params()["a"] < high and high - low < 0.2
