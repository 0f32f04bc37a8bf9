"""Uncertainty of a fitted Eq. 1 curve: a noise-model bootstrap, parameter intervals, and
prediction bands that cover what they claim to.

Three sources of spread enter a band (`BandSpec.kind` chooses which):
1. The parameters. A parametric (noise-model) bootstrap: every draw redraws each point
   around the fitted curve with that point's own noise (`noise.point_noise`: its standard error,
   inflated when the residuals scatter more than the errors explain; without errors, the
   residuals' spread), refits (A, B, C_mid) with R0 fixed (`batch.refine_batch`, the fit's
   own weights), and evaluates the curve. With several seeds it also resamples whole seeds.
2. Seeds. Seeds of one recipe reach different asymptotes: the paper reads A within +-0.02
   as one result (Sec. 3, App. A.5). A run's own points cannot show where its trajectory
   goes after them, so each draw adds delta * u(C), delta ~ N(0, seed_sd): u = 0 up to the
   last fitted compute C_last and grows to 1 as C -> infinity, u = (s(C) - s(C_last)) / (1
   - s(C_last)) with s = 1 / (1 + (C_mid / C)^B) the draw's gain fraction: the share of
   the distance left to A at C_last that the curve covers by C. At infinite compute the
   asymptote is then uncertain by the paper's seed-to-seed spread on top of the fit's own.
   seed_sd defaults to 0.02 / 1.645 (the +-0.02 as a 90% range).
3. The evaluation. A new evaluation at C is itself noisy: "prediction" bands add N(0,
   sigma_eval) with sigma_eval the median of the points' noise (`fit_noise`).

"prediction" = 1 + 2 + 3 (where the next evaluation will land), "curve" = 1 + 2 (the run's
expected curve), "parameter" = 1 (the fit's own parameter uncertainty). Bands are central
percentiles of the draws; tests/integration/test_band_calibration.py checks their coverage
on simulated runs. Seeded: the same fit and seed give the same intervals. Pure numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from curve_service.batch import refine_batch
from curve_service.errors import CurveInputError
from curve_service.fit import FitResult
from curve_service.noise import point_noise
from curve_service.points import REWARD_LIMIT, check_compute, reward_floor
from curve_service.power_law import PowerLawParams, fit_power_law_batch, predict_power_law
from curve_service.sigmoid import gain_fraction, sigmoid

DEFAULT_LEVEL = 0.9
# The paper's seed-to-seed margin of A (+-0.02, Sec. 3 / App. A.5) read as a central 90%
# range of a normal spread: sd = 0.02 / z_0.95.
DEFAULT_SEED_SD = 0.02 / 1.645
MAX_SEED_SD = 0.5
PREDICTION, CURVE, PARAMETER = "prediction", "curve", "parameter"
BAND_KINDS = (PREDICTION, CURVE, PARAMETER)
# Draws of the seed and evaluation terms per bootstrap resample: their normal draws are
# cheap next to a refit, and more of them smooth the band's percentiles.
_TERM_DRAWS = 8
_TERM_SEED = 0x5EED


@dataclass(frozen=True)
class BandSpec:
    """What a band covers: kind ("prediction", "curve" or "parameter"), the between-seed
    standard deviation of A (reward units) and the central probability."""

    kind: str = PREDICTION
    seed_sd: float = DEFAULT_SEED_SD
    level: float = DEFAULT_LEVEL


DEFAULT_BAND = BandSpec()


def check_level(level: float, name: str = "level") -> float:
    """level unchanged; raises CurveInputError(name) unless 0 < level < 1."""
    if not 0.0 < level < 1.0:
        raise CurveInputError(name, f"must be in (0, 1), got {level}")
    return level


def band_spec(
    kind: str = "", seed_sd: float | None = None, level: float = 0.0, prefix: str = ""
) -> BandSpec:
    """A checked BandSpec: kind "" = "prediction", seed_sd None = DEFAULT_SEED_SD, level 0
    = DEFAULT_LEVEL. Raises CurveInputError naming "<prefix>band", "<prefix>seed_sd"
    (finite in [0, 0.5]) or "<prefix>level" (in (0, 1))."""
    kind = kind or PREDICTION
    if kind not in BAND_KINDS:
        raise CurveInputError(
            f"{prefix}band", f"must be one of {', '.join(BAND_KINDS)}; got {kind!r}"
        )
    sd = DEFAULT_SEED_SD if seed_sd is None else float(seed_sd)
    if not (math.isfinite(sd) and 0.0 <= sd <= MAX_SEED_SD):
        raise CurveInputError(
            f"{prefix}seed_sd", f"must be finite in [0, {MAX_SEED_SD:g}], got {seed_sd}"
        )
    return BandSpec(kind, sd, check_level(level or DEFAULT_LEVEL, f"{prefix}level"))


def fit_noise(fit: FitResult) -> NDArray[np.float64]:
    """`noise.point_noise` [N] of a sigmoid fit's points (its standard errors as the fit
    used them, or its residuals' spread)."""
    resid = fit.reward - sigmoid(fit.compute, fit.a, fit.b, fit.c_mid, fit.r0)
    return point_noise(resid, fit.stderr)


def bootstrap_params(fit: FitResult, n_resamples: int = 64, seed: int = 0) -> NDArray[np.float64]:
    """Noise-model bootstrap of (A, B, C_mid) around a fit: [n_resamples, 3].

    Each resample draws every point from N(fitted, point_noise) (clipped to the reward
    range) and refines (A, B, C_mid) from the fit with R0 fixed and the fit's weights
    (`batch.refine_batch`). With several series (seeds) it also resamples whole seeds (a
    cluster bootstrap). Raises CurveInputError("n_resamples") unless n_resamples >= 1.
    """
    if n_resamples < 1:
        raise CurveInputError("n_resamples", f"must be >= 1, got {n_resamples}")
    n = fit.points_used
    fitted = sigmoid(fit.compute, fit.a, fit.b, fit.c_mid, fit.r0)
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((n_resamples, n)) * fit_noise(fit)
    rewards = np.clip(fitted + noise, reward_floor(fit.reward), REWARD_LIMIT)
    weights = np.ones(n) if fit.weights is None else fit.weights
    series = fit.series if fit.series is not None else np.zeros(n, dtype=np.int64)
    n_series = int(series.max()) + 1
    if n_series > 1:  # several seeds: also resample whole seeds (cluster bootstrap)
        counts = rng.multinomial(n_series, np.full(n_series, 1.0 / n_series), size=n_resamples)
        weights = counts[:, series] * weights
    return refine_batch(fit.compute, rewards, fit.params, fit.grid, weights)


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
    spec: BandSpec | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Prediction of Eq. 1 and its central band at compute [M] from the fit's bootstrap
    samples [S, 3] (A, B, C_mid).

    spec: what the band covers (module docstring); None = the parameter band at `level`
    (spec.level wins when a spec is given). Returns (reward [M], lower [M], upper [M]); the
    band always contains the prediction. Raises CurveInputError("compute[i]" | "level").
    """
    spec = spec or BandSpec(PARAMETER, 0.0, level)
    c = check_compute(np.atleast_1d(np.asarray(compute, dtype=np.float64)))
    center = sigmoid(c, fit.a, fit.b, fit.c_mid, fit.r0)
    a, b, c_mid = samples[:, :1], samples[:, 1:2], samples[:, 2:3]
    curves = sigmoid(c[None, :], a, b, c_mid, fit.r0)  # [S, M]
    log_c, log_mid, last = np.log(c)[None, :], np.log(c_mid), math.log(float(fit.compute.max()))
    # The share of the distance left to A at the last fitted compute covered by C.
    s_last = gain_fraction(last, b, log_mid)
    unseen = np.maximum(gain_fraction(log_c, b, log_mid) - s_last, 0.0) / np.maximum(
        1.0 - s_last, 1e-12
    )
    return center, *_band(center, curves, unseen, float(np.median(fit_noise(fit))), spec)


def bootstrap_power_law(
    fit: FitResult, law: PowerLawParams, n_resamples: int, seed: int = 0
) -> NDArray[np.float64]:
    """Noise-model bootstrap of the power law (App. A.4) fitted to `fit`'s points: [S, 3]
    columns A, D, B. Each resample draws the points from N(law's curve, noise.point_noise)
    and refits by `power_law.fit_power_law_batch` with the fit's weights."""
    fitted = predict_power_law(law, fit.compute)
    noise = point_noise(fit.reward - fitted, fit.stderr)
    rng = np.random.default_rng(seed)
    draws = fitted + rng.standard_normal((n_resamples, fit.points_used)) * noise
    rewards = np.clip(draws, reward_floor(fit.reward), REWARD_LIMIT)
    weights = np.ones(fit.points_used) if fit.weights is None else fit.weights
    return fit_power_law_batch(fit.compute, rewards, weights)


def power_law_band(
    fit: FitResult,
    law: PowerLawParams,
    samples: NDArray[np.float64],
    compute: ArrayLike,
    spec: BandSpec,
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """The power law's prediction and band at compute [M] from its bootstrap samples
    [S, 3] (A, D, B), the same three terms as `prediction_band`. The seed term's share is
    the part of the remaining distance to A closed between the last fitted compute and C,
    1 - (C_last / C)^B (the power law has no R0 to measure a gain from). Returns (reward,
    lower, upper), each [M]."""
    c = check_compute(np.atleast_1d(np.asarray(compute, dtype=np.float64)))
    center = predict_power_law(law, c)
    a, d, b = samples[:, :1], samples[:, 1:2], samples[:, 2:3]
    log_c = np.log(c)[None, :]
    curves = a - d * np.exp(-b * log_c)  # [S, M]
    last = math.log(float(fit.compute.max()))
    unseen = np.maximum(1.0 - np.exp(-b * (log_c - last)), 0.0)
    resid = fit.reward - predict_power_law(law, fit.compute)
    sigma_eval = float(np.median(point_noise(resid, fit.stderr)))
    return center, *_band(center, curves, unseen, sigma_eval, spec)


def _band(
    center: NDArray[np.float64],
    curves: NDArray[np.float64],
    unseen: NDArray[np.float64],
    sigma_eval: float,
    spec: BandSpec,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(lower [M], upper [M]): central spec.level percentiles of the bootstrap's curves
    [S, M], for "curve" and "prediction" with the seed term delta * unseen [S, M] (and for
    "prediction" the evaluation's N(0, sigma_eval)) added, 8 normal draws per curve from a
    fixed seed so a band is reproducible; widened to contain center [M]."""
    q = (1.0 - check_level(spec.level)) / 2.0
    draws = curves
    if spec.kind != PARAMETER:
        rng = np.random.default_rng(_TERM_SEED)
        delta = rng.standard_normal((_TERM_DRAWS, curves.shape[0], 1)) * spec.seed_sd
        terms = curves[None] + delta * unseen[None]  # [D, S, M]
        if spec.kind == PREDICTION:
            terms = terms + rng.standard_normal(terms.shape) * sigma_eval
        draws = terms.reshape(-1, curves.shape[1])
    lower = np.minimum(np.quantile(draws, q, axis=0), center)
    upper = np.maximum(np.quantile(draws, 1.0 - q, axis=0), center)
    return lower, upper
