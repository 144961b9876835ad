"""The fitting machinery of Hoffmann et al. (2022, approach 3): a law written as a log-sum-exp of terms
linear in log-space parameters, fitted to log-losses under a Huber loss by L-BFGS from the best points of
a grid of initialisations. Both the joint law L(N, D) = E + A/N^alpha + B/D^beta and a one-variable law
L(x) = E + A/x^alpha take this form:

    log L = LSE(a_1 - alpha_1 log x_1, ..., a_k - alpha_k log x_k, e),   A_i = exp(a_i), E = exp(e)
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from lmlab.errors import ConfigError

HUBER_DELTA = 1e-3  # Hoffmann et al.'s: residuals of log-loss above 0.1% count linearly
STARTS = 8  # L-BFGS runs from the best grid points (the grid's objective is evaluated in one pass)


def minimize():
    """scipy.optimize.minimize, or one clear error naming the extra that installs it."""
    try:
        from scipy.optimize import minimize as scipy_minimize
    except ImportError:
        raise ConfigError("scaling-law fits use scipy's L-BFGS: pip install 'lmlab[scaling]'") from None
    return scipy_minimize


def huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Huber's loss of each residual and its derivative."""
    small = np.abs(r) <= delta
    value = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))
    return value, np.where(small, r, delta * np.sign(r))


def _terms(params: np.ndarray, logs: np.ndarray, floor: bool) -> np.ndarray:
    """(..., k [+1], points): the log-sum-exp's terms for parameter rows (..., 2k [+1]) and logs (k, points)."""
    k = logs.shape[0]
    a, alpha = params[..., :k, None], params[..., k:2 * k, None]
    terms = a - alpha * logs
    if floor:
        e = np.broadcast_to(params[..., 2 * k, None, None], terms.shape[:-2] + (1, logs.shape[1]))
        terms = np.concatenate([terms, e], axis=-2)
    return terms


def objective(params: np.ndarray, logs: np.ndarray, log_loss: np.ndarray, floor: bool,
              delta: float = HUBER_DELTA) -> np.ndarray:
    """The summed Huber loss of the log residuals, for one parameter row or a batch of rows."""
    terms = _terms(params, logs, floor)
    top = terms.max(axis=-2, keepdims=True)
    lse = (top + np.log(np.exp(terms - top).sum(axis=-2, keepdims=True)))[..., 0, :]
    return huber(lse - log_loss, delta)[0].sum(axis=-1)


def _value_and_grad(params: np.ndarray, logs: np.ndarray, log_loss: np.ndarray, floor: bool,
                    delta: float) -> tuple[float, np.ndarray]:
    k = logs.shape[0]
    terms = _terms(params, logs, floor)
    top = terms.max(axis=0, keepdims=True)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0, keepdims=True)
    lse = (top + np.log(total))[0]
    weights /= total  # each term's share of the sum: the gradient of LSE
    value, slope = huber(lse - log_loss, delta)
    grad = np.empty_like(params)
    grad[:k] = (weights[:k] * slope).sum(axis=1)
    grad[k:2 * k] = -(weights[:k] * slope * logs).sum(axis=1)
    if floor:
        grad[2 * k] = (weights[k] * slope).sum()
    return float(value.sum()), grad


def fit_lse(logs: np.ndarray, log_loss: np.ndarray, grid: Sequence[Sequence[float]], floor: bool = True,
            delta: float = HUBER_DELTA, init: Sequence[float] | None = None) -> list[float]:
    """The parameters (a_1..a_k, alpha_1..alpha_k[, e]) that minimise the Huber loss: L-BFGS from `init`,
    or from the STARTS best points of the grid (one list of values per parameter)."""
    run = minimize()
    if init is not None:
        starts = [np.asarray(init, float)]
    else:
        points = np.array(list(itertools.product(*grid)), float)
        scores = np.concatenate([objective(chunk, logs, log_loss, floor, delta)
                                 for chunk in np.array_split(points, max(1, len(points) // 4096))])
        starts = points[np.argsort(scores)[:STARTS]]
    best = None
    for start in starts:
        result = run(_value_and_grad, start, args=(logs, log_loss, floor, delta), jac=True, method="L-BFGS-B",
                     options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12})
        if best is None or result.fun < best.fun:
            best = result
    return [float(v) for v in best.x]
