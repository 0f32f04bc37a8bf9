"""Uncertainty of a fitted Eq. 1 curve: residual bootstrap, parameter intervals, bands.

The band reflects reward noise only: not R0's error, nor a wrong model, nor the paper's
seed-to-seed spread (about +-0.02 in A, App. A.5). Seeded, so the same fit and seed give
the same intervals. Pure numpy.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray

from curve_service.errors import CurveInputError
from curve_service.fit import FitResult, refine
from curve_service.points import REWARD_LIMIT, check_compute, reward_floor
from curve_service.sigmoid import sigmoid

DEFAULT_LEVEL = 0.9


def check_level(level: float, name: str = "level") -> float:
    """level unchanged; raises CurveInputError(name) unless 0 < level < 1."""
    if not 0.0 < level < 1.0:
        raise CurveInputError(name, f"must be in (0, 1), got {level}")
    return level


def bootstrap_params(fit: FitResult, n_resamples: int = 64, seed: int = 0) -> NDArray[np.float64]:
    """Residual bootstrap of (A, B, C_mid) around a fit: [n_resamples, 3].

    Each resample adds residuals drawn with replacement (inflated by sqrt(N / (N - 3)) for
    the three fitted parameters) to the fitted curve, clipped to the reward range, and
    refines (A, B, C_mid) from the fit, R0 fixed. With several series (seeds) it also
    resamples whole seeds (a cluster bootstrap). Raises CurveInputError("n_resamples")
    unless n_resamples >= 1.
    """
    if n_resamples < 1:
        raise CurveInputError("n_resamples", f"must be >= 1, got {n_resamples}")
    n = fit.points_used
    fitted = sigmoid(fit.compute, fit.a, fit.b, fit.c_mid, fit.r0)
    resid = (fit.reward - fitted) * math.sqrt(n / max(n - 3, 1))
    floor = reward_floor(fit.reward)  # resampled pass rates stay in [0, 1]
    rng = np.random.default_rng(seed)
    series = fit.series if fit.series is not None else np.zeros(n, dtype=np.int64)
    n_series = int(series.max()) + 1
    out = np.empty((n_resamples, 3))
    for i in range(n_resamples):
        y = np.clip(fitted + rng.choice(resid, size=n, replace=True), floor, REWARD_LIMIT)
        weights = None
        if n_series > 1:  # several seeds: also resample whole seeds (cluster bootstrap)
            weights = rng.multinomial(n_series, np.full(n_series, 1.0 / n_series))[series]
        p = refine(fit.compute, y, fit.params, fit.grid, weights=weights)
        out[i] = (p.a, p.b, p.c_mid)
    return out


def param_intervals(
    fit: FitResult, samples: NDArray[np.float64], level: float = DEFAULT_LEVEL
) -> NDArray[np.float64]:
    """Central `level` percentile intervals [3, 2] (rows A, B, C_mid; columns lower, upper)
    from bootstrap samples [S, 3]; each interval contains the fitted value.

    Raises CurveInputError("level") unless 0 < level < 1.
    """
    q = (1.0 - check_level(level)) / 2.0
    lo, hi = np.quantile(samples, [q, 1.0 - q], axis=0)  # [3] each
    est = np.array([fit.a, fit.b, fit.c_mid])
    return np.stack([np.minimum(lo, est), np.maximum(hi, est)], axis=1)


def prediction_band(
    fit: FitResult,
    samples: NDArray[np.float64],
    compute: ArrayLike,
    level: float = DEFAULT_LEVEL,
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Prediction and central `level` band at compute [M] from bootstrap samples [S, 3].

    Returns (reward [M], lower [M], upper [M]); the band always contains the prediction.
    Raises CurveInputError("compute[i]" | "level", ...) for bad arguments.
    """
    q = (1.0 - check_level(level)) / 2.0
    c = check_compute(np.atleast_1d(np.asarray(compute, dtype=np.float64)))
    center = sigmoid(c, fit.a, fit.b, fit.c_mid, fit.r0)
    curves = sigmoid(c[None, :], samples[:, :1], samples[:, 1:2], samples[:, 2:3], fit.r0)
    lower = np.minimum(np.quantile(curves, q, axis=0), center)
    upper = np.maximum(np.quantile(curves, 1.0 - q, axis=0), center)
    return center, lower, upper
