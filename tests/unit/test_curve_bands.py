"""Per-point noise, weighted fits, the batched refits and the three kinds of band."""

from __future__ import annotations

import math

import numpy as np
import pytest

from curve_service.batch import refine_batch
from curve_service.errors import CurveInputError
from curve_service.fit import fit_sigmoid, refine
from curve_service.noise import (
    MIN_STDERR,
    binomial_stderr,
    effective_stderr,
    fit_weights,
    point_noise,
)
from curve_service.power_law import fit_power_law, fit_power_law_batch
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.uncertainty import (
    DEFAULT_SEED_SD,
    BandSpec,
    band_spec,
    bootstrap_params,
    fit_noise,
    prediction_band,
)

TRUTH = SigmoidParams(a=0.7, b=1.5, c_mid=10.0, r0=0.2)
COMPUTE = np.geomspace(1.0, 100.0, 20)


def _noisy(seed: int, sd: float = 0.01) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return predict(TRUTH, COMPUTE) + rng.normal(0.0, sd, COMPUTE.size)


def test_binomial_stderr_matches_hand_values() -> None:
    # 200 prompts x 2 samples at p = 0.5: sqrt(0.25 / 400) = 0.025.
    assert binomial_stderr(0.5, 200, 2) == pytest.approx(0.025)
    # A +-1 score of mean -0.5 over 100 draws: sqrt((1 - 0.25) / 100) = 0.0866.
    assert binomial_stderr(-0.5, 100, 1) == pytest.approx(math.sqrt(0.75) / 10)
    assert binomial_stderr(1.0, 50, 4) == 0.0  # every sample passed: no spread seen
    assert binomial_stderr(0.3, 0, 16) == 0.0  # unknown counts: unknown error


def test_unknown_errors_take_the_median_and_all_are_floored() -> None:
    se = effective_stderr(np.array([0.0, 0.02, 0.04, 0.001]))
    # Known: 0.02, 0.04, 0.001 -> median 0.02; floor 0.25 x 0.02 = 0.005.
    np.testing.assert_allclose(se, [0.02, 0.02, 0.04, 0.005])
    w = fit_weights(np.array([0.0, 0.02, 0.04, 0.001]))
    raw = 1.0 / np.array([0.02, 0.02, 0.04, 0.005]) ** 2
    np.testing.assert_allclose(w, raw / raw.mean())
    assert effective_stderr(np.zeros(4)) is None and fit_weights(None) is None


def test_equal_errors_give_the_unweighted_fit() -> None:
    y = _noisy(1)
    plain = fit_sigmoid(COMPUTE, y, r0=0.2)
    even = fit_sigmoid(COMPUTE, y, r0=0.2, stderr=np.full(COMPUTE.size, 0.01))
    assert (even.a, even.b, even.c_mid) == pytest.approx((plain.a, plain.b, plain.c_mid), rel=1e-7)
    assert plain.weights is None and even.weights is not None


def test_a_noisy_point_with_its_error_pulls_the_fit_less() -> None:
    y = predict(TRUTH, COMPUTE)
    y[-3] += 0.2  # one evaluation far off, e.g. a held-out set of 20 prompts
    se = np.full(COMPUTE.size, 0.005)
    se[-3] = 0.2
    plain = fit_sigmoid(COMPUTE, y, r0=0.2)
    weighted = fit_sigmoid(COMPUTE, y, r0=0.2, stderr=se)
    assert abs(plain.a - TRUTH.a) > 0.02
    assert abs(weighted.a - TRUTH.a) < 0.002
    assert weighted.sse > plain.sse  # sse stays the unweighted sum, which plain minimises


def test_a_subnormal_stderr_is_floored_and_the_fit_stays_finite() -> None:
    """A standard error of 2.2e-309 (found by the RPC fuzzer) overflowed 1 / stderr^2 and
    failed the fit with INTERNAL; every value now counts as at least MIN_STDERR."""
    stderr = np.array([2.2250738585072034e-309, 0.0, 0.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(effective_stderr(stderr), [MIN_STDERR] * 6)
    assert np.isfinite(fit_weights(stderr)).all()
    compute, reward = [1, 2, 4, 8, 16, 32], [0.1, 0.2, 0.35, 0.5, 0.6, 0.65]
    fit = fit_sigmoid(compute, reward, stderr=stderr)
    assert np.isfinite([fit.a, fit.b, fit.c_mid]).all()
    resid = np.asarray(reward) - 0.5
    assert np.isfinite(point_noise(resid, stderr)).all()


def test_bad_stderr_names_the_point() -> None:
    for bad in (-0.1, float("nan"), 1.5):
        se = np.full(COMPUTE.size, 0.01)
        se[2] = bad
        with pytest.raises(CurveInputError) as err:
            fit_sigmoid(COMPUTE, _noisy(0), stderr=se)
        assert err.value.field == "stderr[2]"


def test_batched_refinement_equals_one_refinement_per_draw() -> None:
    fit = fit_sigmoid(COMPUTE, _noisy(2), r0=0.2)
    rng = np.random.default_rng(3)
    draws = predict(TRUTH, COMPUTE)[None, :] + rng.normal(0.0, 0.01, (12, COMPUTE.size))
    weights = rng.uniform(0.5, 2.0, COMPUTE.size)
    got = refine_batch(COMPUTE, draws, fit.params, fit.grid, weights)
    for i in range(draws.shape[0]):
        p = refine(COMPUTE, draws[i], fit.params, fit.grid, weights=weights)
        np.testing.assert_allclose(got[i], [p.a, p.b, p.c_mid], rtol=1e-5)


def test_batched_power_law_equals_one_fit_per_draw() -> None:
    rng = np.random.default_rng(4)
    draws = 0.8 - 0.5 * COMPUTE**-0.7 + rng.normal(0.0, 0.005, (8, COMPUTE.size))
    got = fit_power_law_batch(COMPUTE, draws, np.ones(COMPUTE.size))
    for i in range(draws.shape[0]):
        law = fit_power_law(COMPUTE, draws[i])
        np.testing.assert_allclose(got[i], [law.a, law.d, law.b], rtol=2e-3)


def test_point_noise_widens_only_when_residuals_exceed_the_errors() -> None:
    resid = np.array([0.01, -0.01, 0.01, -0.01, 0.01, -0.01])
    # chi^2 / dof = 6 x 1 / 3 = 2 with errors 0.01: noise x sqrt(2).
    np.testing.assert_allclose(point_noise(resid, np.full(6, 0.01)), np.full(6, 0.01 * 2**0.5))
    # Errors 0.02 explain residuals of 0.01 (chi^2 / dof = 0.5): kept as given.
    np.testing.assert_allclose(point_noise(resid, np.full(6, 0.02)), np.full(6, 0.02))
    # No errors: sqrt(SSE / (N - 3)) = sqrt(6e-4 / 3) = 0.01414.
    np.testing.assert_allclose(point_noise(resid, None), np.full(6, math.sqrt(2e-4)))


def test_bootstrap_uses_the_points_errors() -> None:
    y = _noisy(5, sd=0.002)
    tight = fit_sigmoid(COMPUTE, y, r0=0.2, stderr=np.full(COMPUTE.size, 0.002))
    loose = fit_sigmoid(COMPUTE, y, r0=0.2, stderr=np.full(COMPUTE.size, 0.02))
    np.testing.assert_allclose(fit_noise(loose), 0.02)  # errors larger than the scatter
    a_tight = bootstrap_params(tight, 200, seed=0)[:, 0]
    a_loose = bootstrap_params(loose, 200, seed=0)[:, 0]
    assert np.std(a_loose) > 5 * np.std(a_tight)


def test_band_kinds_nest_and_the_seed_term_starts_after_the_data() -> None:
    fit = fit_sigmoid(COMPUTE, _noisy(6), r0=0.2, stderr=np.full(COMPUTE.size, 0.01))
    draws = bootstrap_params(fit, 200, seed=1)
    at = np.array([50.0, 100.0, 400.0, 1e6])
    widths = {}
    for kind in ("parameter", "curve", "prediction"):
        _, lo, hi = prediction_band(fit, draws, at, spec=BandSpec(kind, DEFAULT_SEED_SD))
        widths[kind] = hi - lo
    # Inside the data (C <= 100, the last point) the seed term adds nothing.
    np.testing.assert_allclose(widths["curve"][:2], widths["parameter"][:2], rtol=0.15)
    assert np.all(widths["curve"][2:] > widths["parameter"][2:])
    assert np.all(widths["prediction"] > widths["curve"])
    # At infinite compute the seed term's full +-1.645 sd = +-0.02 is in the band.
    assert widths["curve"][-1] >= 2 * 0.02 * 0.9


def test_noiseless_points_have_no_parameter_or_evaluation_spread() -> None:
    fit = fit_sigmoid(COMPUTE, predict(TRUTH, COMPUTE), r0=0.2)
    draws = bootstrap_params(fit, 16, seed=0)
    center, lo, hi = prediction_band(fit, draws, [500.0], spec=BandSpec("prediction", 0.0))
    assert hi[0] - lo[0] == pytest.approx(0.0, abs=1e-9)
    _, lo, hi = prediction_band(fit, draws, [500.0], spec=BandSpec("prediction", 0.01))
    assert hi[0] - lo[0] > 0.005  # the between-seed term alone


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "wide"}, "method.band"),
        ({"seed_sd": -0.01}, "method.seed_sd"),
        ({"seed_sd": float("nan")}, "method.seed_sd"),
        ({"seed_sd": 0.6}, "method.seed_sd"),
        ({"level": 1.0}, "method.level"),
    ],
)
def test_band_spec_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(CurveInputError) as err:
        band_spec(prefix="method.", **kwargs)
    assert err.value.field == field


def test_band_spec_defaults() -> None:
    assert band_spec() == BandSpec("prediction", 0.02 / 1.645, 0.9)
    assert band_spec("curve", 0.0, 0.8) == BandSpec("curve", 0.0, 0.8)
