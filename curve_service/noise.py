"""How noisy each evaluation point is, and what the fit does with it.

An evaluation's held-out reward is itself an estimate: a mean over P prompts x K samples.
Its standard error (the spread over prompts / sqrt(P), or the binomial sqrt(p (1 - p) / n)
for n = P K pass/fail samples) tells the fit how much to trust it. The fit weights each
squared residual by 1 / stderr^2 (weighted least squares), and the noise-model bootstrap
(`curve_service.uncertainty`) redraws each point with its own spread.

A standard error of 0 means "unknown". A fit uses weights only when some point has one:
the unknown ones then take the median of the known, and every one is floored at a quarter
of that median, so a point that happened to score 0 or 1 on every sample (a binomial
estimate of 0) cannot dominate the fit. Pure numpy.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray

from curve_service.errors import CurveInputError

MAX_STDERR = 1.0  # a reward in [-1, 1] has a standard deviation of at most 1
_FLOOR_OF_MEDIAN = 0.25
# No standard error counts as smaller than this: a pass rate that precise would take some
# 1e11 samples, and a subnormal one (2e-309) overflowed 1 / stderr^2 and failed the fit.
MIN_STDERR = 1e-6


def binomial_stderr(reward: float, prompts: int, samples: int) -> float:
    """Standard error of a mean reward over prompts x samples independent draws.

    A pass rate (reward in [0, 1]) is a mean of 0/1 outcomes, variance p (1 - p); a signed
    score (reward < 0 possible) a mean of -1/+1 outcomes, variance 1 - r^2. Returns
    sqrt(variance / (prompts * samples)); 0.0 (unknown) when either count is 0. This
    ignores that prompts differ in difficulty, which makes the spread over prompts the
    better estimate when the evaluator has it (the learner sends that one).
    """
    n = int(prompts) * int(samples)
    if n <= 0:
        return 0.0
    variance = reward * (1.0 - reward) if reward >= 0.0 else 1.0 - reward * reward
    return math.sqrt(max(variance, 0.0) / n)


def check_stderr(stderr: ArrayLike, n: int, name: str = "stderr") -> NDArray[np.float64]:
    """stderr [n] as floats (0 = unknown); raises CurveInputError("<name>" or
    "<name>[i]") for a length other than n or a value that is not finite in [0, 1]."""
    s = np.asarray(stderr, dtype=np.float64).reshape(-1)
    if s.size != n:
        raise CurveInputError(name, f"{s.size} standard errors for {n} points")
    bad = np.flatnonzero(~np.isfinite(s) | (s < 0) | (s > MAX_STDERR))
    if bad.size:
        raise CurveInputError(
            f"{name}[{bad[0]}]", f"must be finite in [0, {MAX_STDERR:g}], got {s[bad[0]]}"
        )
    return s


def check_stderr_value(value: float, name: str) -> float:
    """One standard error (reward units; 0 = unknown) as a float; raises
    CurveInputError(name) unless it is finite in [0, 1]."""
    v = float(value)
    if not (math.isfinite(v) and 0.0 <= v <= MAX_STDERR):
        raise CurveInputError(name, f"must be finite in [0, {MAX_STDERR:g}], got {value}")
    return v


def effective_stderr(stderr: NDArray[np.float64] | None) -> NDArray[np.float64] | None:
    """The standard errors a fit uses [N], or None when no point has one (then the fit is
    unweighted, as the paper's). Unknown (0) values take the median of the known ones, and
    every value is floored at a quarter of that median and at MIN_STDERR."""
    if stderr is None:
        return None
    known = stderr[stderr > 0]
    if known.size == 0:
        return None
    median = float(np.median(known))
    filled = np.where(stderr > 0, stderr, median)
    return np.maximum(filled, max(_FLOOR_OF_MEDIAN * median, MIN_STDERR))


def fit_weights(stderr: NDArray[np.float64] | None) -> NDArray[np.float64] | None:
    """Weights [N] of the squared residuals, 1 / stderr^2 scaled to mean 1 (so a weighted
    SSE is on the scale of an unweighted one), from `effective_stderr`; None = unweighted."""
    se = effective_stderr(stderr)
    if se is None:
        return None
    w = 1.0 / np.square(se)
    scaled: NDArray[np.float64] = w / w.mean()
    return scaled


def point_noise(
    resid: NDArray[np.float64], stderr: NDArray[np.float64] | None, n_params: int = 3
) -> NDArray[np.float64]:
    """Standard deviation [N] of each point's reward around a fitted curve, the noise model
    of the bootstraps (`curve_service.uncertainty`, `curve_service.power_law`).

    resid: [N] reward - fitted; stderr: [N] the points' standard errors (0 = unknown) or
    None; n_params: the curve's fitted parameters. With errors (`effective_stderr`): those,
    times sqrt(max(1, chi^2 / (N - n_params))) where chi^2 = sum (resid / stderr)^2, so
    residuals that scatter more than the errors explain (a held-out set's prompts are not
    independent draws, runs drift) widen the noise and never narrow it. Without: the
    residuals' root mean square sqrt(SSE / (N - n_params)) for every point.
    """
    dof = max(resid.size - n_params, 1)
    se = effective_stderr(stderr)
    if se is None:
        return np.full(resid.size, math.sqrt(float(resid @ resid) / dof))
    chi2 = float(np.sum(np.square(resid / se)))
    return se * math.sqrt(max(1.0, chi2 / dof))
