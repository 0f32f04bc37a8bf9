"""Bootstrap intervals, several seeds, CompareRuns and the power law (curve_service)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from curve_service.compare import compare_fits
from curve_service.errors import CurveInputError
from curve_service.fit import fit_fixed_a, fit_sigmoid
from curve_service.power_law import PowerLawParams, fit_power_law, predict_power_law
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.uncertainty import bootstrap_params, param_intervals

TRUTH = SigmoidParams(a=0.8, b=1.5, c_mid=100.0, r0=0.1)


def _noisy(compute: np.ndarray, seed: int, sd: float = 0.01) -> np.ndarray:
    return predict(TRUTH, compute) + np.random.default_rng(seed).normal(0.0, sd, compute.size)


def test_window_before_c_mid_warns_and_gives_wide_intervals() -> None:
    # Points up to 60 of a curve with C_mid = 100: only the lower half of the rise is seen.
    compute = np.geomspace(1.0, 60.0, 12)
    fit = fit_sigmoid(compute, _noisy(compute, 1), r0=0.1)
    assert any("before C_mid" in w for w in fit.warnings)
    bounds = param_intervals(fit, bootstrap_params(fit, 100, seed=0))
    # A is not pinned: its 90% interval spans more than 0.3 of reward (here about
    # [0.49, 1.0]), while the same curve observed past C_mid pins A to +-0.01.
    assert bounds[0, 1] - bounds[0, 0] > 0.3
    full = np.geomspace(1.0, 2000.0, 12)
    pinned = fit_sigmoid(full, _noisy(full, 1), r0=0.1)
    tight = param_intervals(pinned, bootstrap_params(pinned, 100, seed=0))
    assert tight[0, 1] - tight[0, 0] < 0.03
    assert tight[0, 0] <= 0.8 <= tight[0, 1]
    assert pinned.warnings == ()


def test_intervals_are_seeded_and_contain_the_estimate() -> None:
    compute = np.geomspace(1.0, 2000.0, 12)
    fit = fit_sigmoid(compute, _noisy(compute, 2), r0=0.1)
    a = param_intervals(fit, bootstrap_params(fit, 40, seed=3))
    b = param_intervals(fit, bootstrap_params(fit, 40, seed=3))
    np.testing.assert_array_equal(a, b)
    est = np.array([fit.a, fit.b, fit.c_mid])
    assert np.all(a[:, 0] <= est) and np.all(est <= a[:, 1])
    with pytest.raises(CurveInputError, match="^level: "):
        param_intervals(fit, bootstrap_params(fit, 4), level=1.0)


def test_several_seeds_are_fitted_together() -> None:
    compute = np.geomspace(1.0, 2000.0, 12)
    cs = np.concatenate([compute] * 3)  # the same compute in every seed is allowed
    rs = np.concatenate([_noisy(compute, k) for k in range(3)])
    series = ["s0"] * 12 + ["s1"] * 12 + ["s2"] * 12
    fit = fit_sigmoid(cs, rs, r0=0.1, series=series)
    assert fit.points_used == 36
    assert abs(fit.a - 0.8) < 0.01
    bounds = param_intervals(fit, bootstrap_params(fit, 40, seed=0))
    assert bounds[0, 0] < 0.8 < bounds[0, 1]
    with pytest.raises(CurveInputError) as err:  # a duplicate within one seed
        fit_sigmoid(cs, rs, r0=0.1, series=["s0"] * 36)
    assert err.value.field == "compute[12]"


def test_r0_of_several_seeds_is_the_mean_first_reward() -> None:
    compute = [1.0, 2.0, 4.0, 8.0, 1.0, 2.0, 4.0, 8.0]
    reward = [0.2, 0.3, 0.5, 0.6, 0.1, 0.3, 0.4, 0.6]
    fit = fit_sigmoid(compute, reward, series=["a"] * 4 + ["b"] * 4)
    assert fit.r0 == pytest.approx(0.15)  # (0.2 + 0.1) / 2


def test_compare_decides_by_a_when_asymptotes_differ() -> None:
    compute = np.geomspace(1.0, 2000.0, 12)
    low = fit_sigmoid(compute, predict(SigmoidParams(0.7, 3.0, 100, 0.1), compute), r0=0.1)
    high = fit_sigmoid(compute, predict(TRUTH, compute), r0=0.1)
    result = compare_fits([low, high], a_margin=0.02)
    assert (result.ranking, result.decided_by, result.shared_a) == ((1, 0), "A", None)


def test_compare_within_margin_refits_with_the_mean_a_and_compares_b() -> None:
    compute = np.geomspace(1.0, 2000.0, 12)
    slow = fit_sigmoid(compute, predict(TRUTH, compute), r0=0.1)
    fast = predict(SigmoidParams(0.81, 2.5, 100.0, 0.1), compute)
    quick = fit_sigmoid(compute, fast, r0=0.1)
    result = compare_fits([slow, quick], a_margin=0.02)
    assert result.decided_by == "B"
    assert result.shared_a == pytest.approx(0.805, abs=1e-6)  # (0.80 + 0.81) / 2
    assert result.ranking == (1, 0)
    assert result.refits[1][0] > result.refits[0][0]
    # At A fixed to the truth, the refit recovers B and C_mid exactly.
    p = fit_fixed_a(slow, 0.8)
    assert (p.a, p.b, p.c_mid) == pytest.approx((0.8, 1.5, 100.0), rel=1e-6)


def test_compare_rejects_bad_arguments() -> None:
    compute = np.geomspace(1.0, 2000.0, 12)
    fit = fit_sigmoid(compute, predict(TRUTH, compute), r0=0.1)
    with pytest.raises(CurveInputError, match="^runs: "):
        compare_fits([fit])
    with pytest.raises(CurveInputError, match="^a_margin: "):
        compare_fits([fit, fit], a_margin=float("nan"))


def test_power_law_recovers_its_parameters_in_any_unit() -> None:
    compute = np.geomspace(1.0, 1000.0, 30)
    reward = 0.8 - 0.5 * compute**-0.7  # App. A.4 form, A=0.8, D=0.5, B=0.7
    law = fit_power_law(compute, reward)
    assert (law.a, law.d, law.b) == pytest.approx((0.8, 0.5, 0.7), rel=1e-6)
    kilo = fit_power_law(compute * 1000.0, reward)
    # C x 1000 leaves A and B and scales D by 1000^B = 1000^0.7 = 125.89.
    assert (kilo.a, kilo.b) == pytest.approx((0.8, 0.7), rel=1e-6)
    assert kilo.d == pytest.approx(0.5 * 1000.0**0.7, rel=1e-6)
    # 0.8 - 0.5 / 10^0.7 = 0.8 - 0.5 / 5.0119 = 0.70024
    got = predict_power_law(PowerLawParams(0.8, 0.5, 0.7, 0.0), [10.0])
    assert got[0] == pytest.approx(0.70024, abs=1e-5)


@settings(max_examples=8, deadline=None)
@given(
    unit=st.sampled_from([1e-3, 1.0, 1e3, 1e5]),
    a=st.floats(0.5, 0.9),
    b=st.floats(0.8, 3.0),
    mid=st.floats(0.3, 0.7),
    seed=st.integers(0, 10_000),
)
def test_noisy_random_curves_recover_their_parameters(
    unit: float, a: float, b: float, mid: float, seed: int
) -> None:
    """Tolerance: with 30 points spanning three decades around C_mid and noise sd 0.003
    (a 1,000-prompt eval's pass-rate noise is ~0.01-0.015; 0.003 keeps the test about the
    method, not the noise), A within 0.02, B within 25% and C_mid within 25%."""
    compute = unit * np.geomspace(1.0, 1000.0, 30)
    truth = SigmoidParams(a=a, b=b, c_mid=unit * 1000.0**mid, r0=0.2)
    noise = np.random.default_rng(seed).normal(0.0, 0.003, 30)
    fit = fit_sigmoid(compute, np.clip(predict(truth, compute) + noise, 0, 1), r0=0.2)
    assert abs(fit.a - a) < 0.02
    assert fit.b == pytest.approx(b, rel=0.25)
    assert fit.c_mid == pytest.approx(truth.c_mid, rel=0.25)


def test_collapse_and_signed_rewards_are_flagged() -> None:
    compute = np.geomspace(1.0, 100.0, 12)
    rising = predict(SigmoidParams(0.8, 2.0, 10.0, 0.1), compute)
    collapsed = np.concatenate([rising[:9], [0.3, 0.2, 0.15]])
    fit = fit_sigmoid(compute, collapsed, r0=0.1)
    assert any("collapsed" in w for w in fit.warnings)
    signed = fit_sigmoid(compute, 2 * rising - 1, r0=-0.8)
    assert any("+/-1" in w for w in signed.warnings)
    assert not any("collapsed" in w for w in signed.warnings)
