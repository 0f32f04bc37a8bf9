"""The analysis of a compute-reward curve, with no messages and no store.

`analyse(points, method)` fits paper Eq. 1, R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B),
by the paper's procedure (App. A.5-A.7, `curve_service.fit`) and adds what a reader of a
fit asks next: bootstrap intervals of (A, B, C_mid), predictions with bands at the
requested compute (`curve_service.uncertainty`), the extrapolation's stability
(`curve_service.stability`) and, when asked, App. A.4's power law with its own band.
`compare(analyses, ...)` ranks runs (Sec. 3 / App. A.7, `curve_service.compare`) and adds
the early verdict (`curve_service.verdict`).

The gRPC servicer converts requests into `CurvePoints` and `Method`, calls these and
converts the `Analysis` back; it adds nothing of its own. Every range is checked here or in
the core modules, raising `CurveInputError` named by the core's field (`compute[3]`,
`method.level`); the servicer renames a field to the request's path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from curve_service.compare import Comparison, compare_fits
from curve_service.errors import CurveInputError
from curve_service.fit import FitResult, fit_sigmoid
from curve_service.grid import GridSpec
from curve_service.points import MAX_POINTS, check_compute
from curve_service.power_law import PowerLawParams, fit_power_law, predict_power_law
from curve_service.sigmoid import SigmoidParams, sigmoid, validate_params
from curve_service.stability import Stability, check_target, extrapolation_stability
from curve_service.uncertainty import (
    DEFAULT_BAND,
    BandSpec,
    band_spec,
    bootstrap_params,
    bootstrap_power_law,
    param_intervals,
    power_law_band,
    prediction_band,
)
from curve_service.verdict import EarlyVerdict, early_verdict

MAX_RESAMPLES = 2_000  # 200 resamples take ~0.5 s; 2,000 bound one request to seconds

FitFunction = Callable[..., FitResult]  # fit_sigmoid's signature


@dataclass(frozen=True)
class CurvePoints:
    """What to fit: [N] compute (> 0, one unit) and reward (in [-1, 1]) with, optionally,
    [N] seed labels fitted together (`series`) and [N] standard errors (reward units,
    0 = unknown; the fit weights by 1 / stderr^2 when any is known). r0: fixed R0 (None =
    the reward at the lowest compute). min_compute, max_compute: the fit window. grid: the
    (A, C_mid) grid searched (None = `default_grid` of the data)."""

    compute: Sequence[float]
    reward: Sequence[float]
    r0: float | None = None
    series: Sequence[str] | None = None
    stderr: Sequence[float] | None = None
    min_compute: float | None = None
    max_compute: float | None = None
    grid: GridSpec | None = None

    def fit(self, fitter: FitFunction = fit_sigmoid) -> FitResult:
        """The sigmoid fit of these points (`fit_sigmoid`, or a wrapper of it that times
        it). Raises CurveInputError naming `compute[i]`, `reward[i]`, `stderr[i]`,
        `series`, `r0`, `min_compute` or `max_compute`."""
        return fitter(
            self.compute,
            self.reward,
            r0=self.r0,
            min_compute=self.min_compute,
            max_compute=self.max_compute,
            grid=self.grid,
            series=self.series,
            stderr=self.stderr,
        )


@dataclass(frozen=True)
class Method:
    """How to analyse a fit: `resamples` bootstrap resamples (0 = none, at most 2,000)
    seeded by `seed`; `band`, what bands cover and at which level; `power_law`: also fit
    App. A.4's power law; `predict`: [M] compute to predict at; `target`: where the
    stability check predicts (None = 2x the largest compute). Build it with `checked`."""

    resamples: int = 0
    seed: int = 0
    band: BandSpec = DEFAULT_BAND
    power_law: bool = False
    predict: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    target: float | None = None

    @classmethod
    def checked(
        cls,
        resamples: int = 0,
        seed: int = 0,
        band: str = "",
        seed_sd: float | None = None,
        level: float = 0.0,
        power_law: bool = False,
        predict: Sequence[float] = (),
        target: float | None = None,
    ) -> Method:
        """A Method with every range checked before any fit work: resamples in
        0..2,000, the band (`band_spec`: kind, seed_sd in [0, 0.5], level in (0, 1); 0 =
        0.9), at most MAX_POINTS predict values, each finite and > 0, and a finite target
        > 0. Raises CurveInputError naming `method.bootstrap_resamples`, `method.band`,
        `method.seed_sd`, `method.level`, `predict_compute` or `target_compute`."""
        if resamples > MAX_RESAMPLES:
            raise CurveInputError(
                "method.bootstrap_resamples", f"must be <= {MAX_RESAMPLES}, got {resamples}"
            )
        spec = band_spec(band, seed_sd, level, prefix="method.")
        if len(predict) > MAX_POINTS:
            raise CurveInputError("predict_compute", f"at most {MAX_POINTS} values")
        targets = check_compute(np.asarray(predict, dtype=np.float64), "predict_compute")
        return cls(
            resamples=int(resamples),
            seed=int(seed),
            band=spec,
            power_law=power_law,
            predict=targets,
            target=None if target is None else check_target(target),
        )


@dataclass(frozen=True)
class Band:
    """Predictions [M] at `compute` with their band: lower = upper = reward where no
    uncertainty was drawn."""

    compute: NDArray[np.float64]
    reward: NDArray[np.float64]
    lower: NDArray[np.float64]
    upper: NDArray[np.float64]

    @classmethod
    def exact(cls, compute: NDArray[np.float64], reward: NDArray[np.float64]) -> Band:
        return cls(compute, reward, reward, reward)


@dataclass(frozen=True)
class Analysis:
    """A fit and what `analyse` added to it.

    samples: bootstrap (A, B, C_mid) draws [S, 3], None without a bootstrap; intervals:
    [3, 2] central `level` intervals of A, B, C_mid (None without a bootstrap);
    predictions: at Method.predict; stability: the extrapolation's stability check;
    power_law: App. A.4's fit and its predictions (None unless asked)."""

    fit: FitResult
    method: Method
    samples: NDArray[np.float64] | None
    intervals: NDArray[np.float64] | None
    predictions: Band
    stability: Stability
    power_law: PowerLawParams | None = None
    power_law_predictions: Band | None = None


@dataclass(frozen=True)
class RunsComparison:
    """`compare`'s result: each run's analysis in order, the ranking and the early
    verdict."""

    analyses: tuple[Analysis, ...]
    result: Comparison
    early: EarlyVerdict


def analyse(points: CurvePoints, method: Method, fitter: FitFunction = fit_sigmoid) -> Analysis:
    """Fit `points` and analyse the fit by `method` (`analyse_fit`). Raises
    CurveInputError for bad points (see `CurvePoints.fit`)."""
    return analyse_fit(points.fit(fitter), method)


def analyse_fit(fit: FitResult, method: Method) -> Analysis:
    """Bootstrap intervals (App. A.6's noise model, `bootstrap_params`), predictions with
    bands at method.predict, the stability at method.target and, when asked, the power
    law (App. A.4) of a fit. Without a bootstrap, predictions carry no band."""
    targets = method.predict
    samples = intervals = None
    band = Band.exact(targets, sigmoid(targets, fit.a, fit.b, fit.c_mid, fit.r0))
    if method.resamples:
        samples = bootstrap_params(fit, method.resamples, method.seed)
        intervals = param_intervals(fit, samples, method.band.level)
        if targets.size:
            band = Band(targets, *prediction_band(fit, samples, targets, spec=method.band))
    stability = extrapolation_stability(fit, method.target, samples, method.band)
    analysis = Analysis(fit, method, samples, intervals, band, stability)
    return _with_power_law(analysis) if method.power_law else analysis


def _with_power_law(analysis: Analysis) -> Analysis:
    """The analysis with App. A.4's power law R = A - D / C^B, weighted as the sigmoid
    fit, and its predictions, with bands from its own bootstrap when one was asked."""
    fit, method = analysis.fit, analysis.method
    law = fit_power_law(fit.compute, fit.reward, fit.weights)
    targets = method.predict
    band = Band.exact(targets, predict_power_law(law, targets))
    if method.resamples and targets.size:
        draws = bootstrap_power_law(fit, law, method.resamples, method.seed)
        band = Band(targets, *power_law_band(fit, law, draws, targets, method.band))
    return dataclasses.replace(analysis, power_law=law, power_law_predictions=band)


def extrapolation_targets(compute: Sequence[float]) -> NDArray[np.float64]:
    """[M] compute to extrapolate to; raises CurveInputError("compute") unless 1 <= M <=
    MAX_POINTS (each value is checked by the prediction)."""
    if not 1 <= len(compute) <= MAX_POINTS:
        raise CurveInputError("compute", f"give 1..{MAX_POINTS} values, got {len(compute)}")
    return np.asarray(compute, dtype=np.float64)


def extrapolate(params: SigmoidParams, targets: NDArray[np.float64]) -> Band:
    """Eq. 1 with explicit parameters at [M] compute, each finite and > 0; explicit
    parameters carry no uncertainty. Raises CurveInputError naming `params.<name>` or
    `compute[i]`."""
    p = validate_params(params)
    return Band.exact(targets, sigmoid(check_compute(targets), p.a, p.b, p.c_mid, p.r0))


def extrapolate_band(
    fit: FitResult, samples: NDArray[np.float64], targets: NDArray[np.float64]
) -> Band:
    """A recorded fit's predictions at [M] compute with the default prediction band from
    its bootstrap `samples` [S, 3]."""
    return Band(targets, *prediction_band(fit, samples, targets, spec=DEFAULT_BAND))


def compare(
    analyses: Sequence[Analysis],
    margin: float,
    seeds: Sequence[int],
    grids: Sequence[GridSpec | None],
    at_compute: float | None = None,
) -> RunsComparison:
    """Rank 2..16 analysed runs by A, then B at a shared A within `margin` (reward units;
    Sec. 3 / App. A.7), and find how early the ranking settled (`early_verdict`, from each
    run's bootstrap samples, or its own draws seeded by `seeds` for runs without); with
    at_compute (the points' unit), rank them by their predicted reward there too. Raises
    CurveInputError("runs") for curves that do not all rise (or all fall), ("a_margin"),
    ("at_compute") unless finite and > 0."""
    fits = [a.fit for a in analyses]
    result = compare_fits(fits, margin)
    samples = [a.samples for a in analyses]
    early = early_verdict(fits, result, samples, seeds, margin, list(grids), at_compute)
    return RunsComparison(tuple(analyses), result, early)
