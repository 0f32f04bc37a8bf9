"""Is the fit's extrapolation predictable yet? How far its prediction at a target compute
moved over the last few evaluations, against the width of its band there.

Refit the fit's points without the last j evaluation computes (j = 1..K), predict at the
target each time: `moved` is the largest distance of those predictions from the fit's
own, `band_half_width` half the width of the fit's band at the target
(`uncertainty.prediction_band`), and their ratio gives the verdict. A window that ends
before C_mid leaves A undetermined (paper App. A.7): each new point then shifts the
extrapolation by about as much as the band, or more, and the verdict says so.

Pure numpy/scipy: no I/O, no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from curve_service.errors import CurveInputError
from curve_service.fit import FitResult, refine
from curve_service.points import MAX_COMPUTE, MIN_COMPUTE, MIN_POINTS
from curve_service.sigmoid import sigmoid
from curve_service.uncertainty import DEFAULT_BAND, BandSpec, bootstrap_params, prediction_band

# K: refits after dropping the last 1, 2, 3 evaluations. Three is the recent history a user
# watches before extending a run (three evaluations are a few percent of its compute), and
# keeps the check to three fits.
REFITS = 3
# A refit is a fit, so it needs the fit's minimum; the check needs at least one refit.
MIN_CHECK_POINTS = MIN_POINTS + 1
# The default target: the next doubling of the compute spent, the extension a user weighs.
TARGET_FACTOR = 2.0
# The band when the request asked for no bootstrap: 64 noise-model resamples, seeded,
# refitted together (`batch.refine_batch`, a few ms in all), so a Fit without a bootstrap
# stays inside its 50 ms budget at 100 points; they size the 90% band to within about a
# sixth of 1,000 resamples', well inside the verdict's factor-of-two thresholds.
CHECK_RESAMPLES = 64
CHECK_SEED = 0
# Moves below this much reward are no movement: under the resolution of any held-out
# evaluation (1,000 prompts x 16 samples: about 0.004 standard error). It keeps noiseless
# points, whose band has zero width, from reading as unstable.
BAND_FLOOR = 1e-3
# moved <= 0.5 band half-width: the last points moved the prediction well inside what
# its band already allows; extrapolating from it is as good as the band says.
STABLE_RATIO = 0.5
# moved <= the band half-width: the prediction still moves by about what its band allows;
# a few more evaluations should settle it. Beyond, the last points moved it by more than
# its band: the band understates how little these points determine (e.g. A before C_mid).
SETTLING_RATIO = 1.0
TOO_FEW, STABLE, SETTLING, UNSTABLE = "too few points", "stable", "settling", "unstable"


@dataclass(frozen=True)
class Stability:
    """How stable a fit's prediction at `target_compute` (the points' unit) is.

    history: (reward, lower, upper) at the target of the fit (with its band) and of each
    refit without its last j = 1..K evaluations, in j order (refits carry no band: lower =
    upper = reward). moved: the largest |refit - fit| prediction (reward units);
    band_half_width: half the fit's band there; ratio: moved / max(band_half_width,
    BAND_FLOOR); verdict: "too few points", "stable", "settling" or "unstable"; summary:
    one line.
    """

    target_compute: float
    history: tuple[tuple[float, float, float], ...]
    moved: float
    band_half_width: float
    ratio: float
    verdict: str
    summary: str


def check_target(value: float, name: str = "target_compute") -> float:
    """value as a float; raises CurveInputError(name) unless finite in [1e-30, 1e30]."""
    v = float(value)
    if not (math.isfinite(v) and MIN_COMPUTE <= v <= MAX_COMPUTE):
        raise CurveInputError(
            name, f"must be finite and > 0 (in [{MIN_COMPUTE:g}, {MAX_COMPUTE:g}]), got {value}"
        )
    return v


def default_target(fit: FitResult) -> float:
    """TARGET_FACTOR (2) x the largest compute the fit used, in the points' unit."""
    return TARGET_FACTOR * float(fit.compute.max())


def extrapolation_stability(
    fit: FitResult,
    target_compute: float | None = None,
    samples: NDArray[np.float64] | None = None,
    spec: BandSpec = DEFAULT_BAND,
) -> Stability:
    """How far `fit`'s prediction at target_compute moved over its last K = 3 evaluations.

    target_compute: > 0, the points' unit; None = `default_target` (2x the largest compute
    used). samples: the fit's bootstrap samples [S, 3] (A, B, C_mid) behind its band; None
    = CHECK_RESAMPLES (64) resamples seeded CHECK_SEED. spec: the band the movement is
    measured against (`uncertainty.BandSpec`: by default a 90% prediction band). The
    evaluations dropped are the last distinct compute values (with several seeds, every
    seed's point there). Each refit is the fit's continuous
    refinement (paper App. A.5) started from the fit's parameters within its grid's
    bounds, as the bootstrap resamples are: ~1-2 ms instead of a grid search of ~10 ms,
    and on the tests' curves, windows before C_mid included, the same optimum as a fresh
    fit.

    Verdict: "too few points" below 5 points (no refit keeps 4); else by ratio = moved /
    max(band half-width, BAND_FLOOR): "stable" <= 0.5, "settling" <= 1, "unstable" above.
    Raises CurveInputError("target_compute") for a bad target.
    """
    target = default_target(fit) if target_compute is None else check_target(target_compute)
    if samples is None:
        samples = bootstrap_params(fit, CHECK_RESAMPLES, CHECK_SEED)
    center, lower, upper = (float(v[0]) for v in prediction_band(fit, samples, [target], spec=spec))
    half_width = (upper - lower) / 2.0
    refits = _refit_predictions(fit, target)
    history = ((center, lower, upper), *((r, r, r) for r in refits))
    if fit.points_used < MIN_CHECK_POINTS or not refits:
        summary = (
            f"{TOO_FEW}: {fit.points_used} points; no refit without the last evaluation "
            f"keeps the {MIN_POINTS} a fit needs"
        )
        return Stability(target, history, 0.0, half_width, 0.0, TOO_FEW, summary)
    moved = max(abs(r - center) for r in refits)
    ratio = moved / max(half_width, BAND_FLOOR)
    verdict = STABLE if ratio <= STABLE_RATIO else SETTLING if ratio <= SETTLING_RATIO else UNSTABLE
    summary = (
        f"{verdict}: the prediction at C={target:.4g} moved {moved:.3f} over the last "
        f"{len(refits)} points, a band of +-{half_width:.3f}"
    )
    return Stability(target, history, moved, half_width, ratio, verdict, summary)


def _refit_predictions(fit: FitResult, target: float) -> list[float]:
    """Predictions at target of the refits without the last j = 1..K distinct computes
    that keep at least MIN_POINTS points."""
    computes = np.unique(fit.compute)  # ascending
    out = []
    for j in range(1, REFITS + 1):
        keep = fit.compute < computes[-j] if j < computes.size else fit.compute < 0
        if np.count_nonzero(keep) < MIN_POINTS:
            break
        weights = fit.weights[keep] if fit.weights is not None else None
        p = refine(fit.compute[keep], fit.reward[keep], fit.params, fit.grid, weights=weights)
        out.append(float(sigmoid(target, p.a, p.b, p.c_mid, p.r0)))
    return out
