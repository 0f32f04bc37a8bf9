"""Is the extrapolation predictable yet (curve_service.stability), and the early verdict
between runs (curve_service.verdict)."""

from __future__ import annotations

import numpy as np
import pytest

from curve_service.compare import compare_fits
from curve_service.errors import CurveInputError
from curve_service.fit import fit_sigmoid
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.stability import (
    BAND_FLOOR,
    check_target,
    extrapolation_stability,
)
from curve_service.uncertainty import BandSpec, bootstrap_params, prediction_band
from curve_service.verdict import early_verdict, fit_through, stable_from

TRUTH = SigmoidParams(a=0.8, b=1.5, c_mid=100.0, r0=0.1)


def _noisy(params: SigmoidParams, compute: np.ndarray, seed: int, sd: float = 0.01):
    return predict(params, compute) + np.random.default_rng(seed).normal(0.0, sd, compute.size)


# --- stability of one fit ----------------------------------------------------------------


def test_noiseless_points_are_stable_and_nothing_moves() -> None:
    compute = np.geomspace(1.0, 2000.0, 12)
    fit = fit_sigmoid(compute, predict(TRUTH, compute), r0=0.1)
    s = extrapolation_stability(fit)
    assert s.target_compute == 4000.0  # 2x the largest compute used
    assert s.verdict == "stable"
    assert len(s.history) == 4  # the fit and its 3 refits
    # Every refit of exact points recovers the truth: predictions agree to ~1e-6.
    truth_at_target = float(predict(TRUTH, [4000.0])[0])
    assert s.history[0][0] == pytest.approx(truth_at_target, abs=1e-6)
    assert s.moved < 1e-4
    assert s.ratio == pytest.approx(s.moved / max(s.band_half_width, BAND_FLOOR))
    assert s.summary.startswith("stable: the prediction at C=4000 moved 0.000 over the last 3")


def test_a_window_before_c_mid_is_unstable() -> None:
    # Points up to 60 of a curve with C_mid = 100 (the window the paper warns about, App.
    # A.7): A is undetermined, and each of the last evaluations moves the prediction at
    # 120 by more than its whole band (ratios 1.4 to 8 over seeds 0..4).
    compute = np.geomspace(1.0, 60.0, 12)
    short = []
    for seed in range(5):
        s = extrapolation_stability(fit_sigmoid(compute, _noisy(TRUTH, compute, seed), r0=0.1))
        assert s.verdict == "unstable" and s.ratio > 1.0, s.summary
        short.append(s.ratio)
    # Observed to 20,000 (past C_mid) with the same noise, the prediction moves far less
    # against its band: the median ratio over seeds 0..4 is below 1 (about 0.3 here),
    # against above 4 for the short window. (Single noisy fits can still read "unstable":
    # the residual bootstrap's band is narrow.)
    full = np.geomspace(1.0, 20_000.0, 30)
    ratios = [
        extrapolation_stability(fit_sigmoid(full, _noisy(TRUTH, full, seed), r0=0.1)).ratio
        for seed in range(5)
    ]
    assert np.median(ratios) < 1.0 < 4.0 < np.median(short)


def test_too_few_points_for_a_refit() -> None:
    compute = np.geomspace(1.0, 2000.0, 4)
    fit = fit_sigmoid(compute, predict(TRUTH, compute), r0=0.1)
    s = extrapolation_stability(fit)
    assert (s.verdict, s.moved, s.ratio, len(s.history)) == ("too few points", 0.0, 0.0, 1)
    assert s.summary.startswith("too few points: 4 points")
    five = np.geomspace(1.0, 2000.0, 5)
    s5 = extrapolation_stability(fit_sigmoid(five, predict(TRUTH, five), r0=0.1))
    assert len(s5.history) == 2 and s5.verdict != "too few points"  # one refit, on 4 points


def test_several_seeds_drop_whole_evaluations() -> None:
    # Two seeds at the same 5 computes: dropping the last evaluation drops both its points
    # and leaves 8 >= 4; 4 evaluations x 2 seeds allow 3 refits only down to 2 x 2 = 4.
    compute = np.geomspace(1.0, 2000.0, 5)
    cs = np.concatenate([compute, compute])
    rs = np.concatenate([_noisy(TRUTH, compute, 0), _noisy(TRUTH, compute, 1)])
    fit = fit_sigmoid(cs, rs, r0=0.1, series=["s0"] * 5 + ["s1"] * 5)
    s = extrapolation_stability(fit)
    assert len(s.history) == 1 + 3
    assert fit_through(fit, compute[-2]).points_used == 8


def test_given_samples_and_target_set_the_band() -> None:
    compute = np.geomspace(1.0, 2000.0, 12)
    fit = fit_sigmoid(compute, _noisy(TRUTH, compute, 3), r0=0.1)
    samples = bootstrap_params(fit, 50, seed=7)
    spec = BandSpec(kind="curve", seed_sd=0.01, level=0.8)
    s = extrapolation_stability(fit, target_compute=500.0, samples=samples, spec=spec)
    center, lower, upper = prediction_band(fit, samples, [500.0], spec=spec)
    assert s.target_compute == 500.0
    assert s.history[0] == pytest.approx((center[0], lower[0], upper[0]))
    assert s.band_half_width == pytest.approx((upper[0] - lower[0]) / 2)
    assert extrapolation_stability(fit) == extrapolation_stability(fit)  # seeded


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 1e31])
def test_a_bad_target_names_the_field(bad: float) -> None:
    with pytest.raises(CurveInputError) as err:
        check_target(bad)
    assert err.value.field == "target_compute"


# --- the early verdict between runs ------------------------------------------------------

COMPUTE = np.geomspace(1.0, 2000.0, 16)


def _fits(*rewards: np.ndarray) -> list:
    return [fit_sigmoid(COMPUTE, r, r0=0.1) for r in rewards]


def test_a_clearly_higher_asymptote_is_best_with_probability_one() -> None:
    low = _noisy(SigmoidParams(0.7, 1.5, 100.0, 0.1), COMPUTE, 0)
    high = _noisy(TRUTH, COMPUTE, 1)
    fits = _fits(low, high)
    result = compare_fits(fits)
    v = early_verdict(fits, result, [None, None], [0, 0], 0.02)
    assert result.best == 1
    # A differ by 0.1 against a bootstrap spread of ~0.005: no draw reverses them.
    assert v.p_best_a[1] >= 0.99 and v.p_best_a[0] <= 0.01
    assert sum(v.p_best_a) == pytest.approx(1.0)
    assert v.p_best_b == {}  # decided by A: no B probabilities
    assert v.draws == 100
    assert v.line.startswith("run 1 has the best asymptote with probability 1.00 (100 joint")


def test_identical_curves_are_a_coin_flip() -> None:
    # The same noisy points twice, both with seed 0: the runs' bootstraps must still be
    # independent (paired resample by resample they would always tie, giving run 0 1.0).
    # 100 draws: a probability of 0.5 is estimated within +-0.15 (3 binomial sd).
    same = _noisy(TRUTH, COMPUTE, 4)
    fits = _fits(same, same)
    result = compare_fits(fits)
    v = early_verdict(fits, result, [None, None], [0, 0], 0.02)
    assert result.decided_by == "B"
    assert v.p_best_a[0] == pytest.approx(0.5, abs=0.15)
    assert v.p_best_a[1] == pytest.approx(0.5, abs=0.15)
    assert set(v.p_best_b) == {0, 1}
    assert v.p_best_b[0] == pytest.approx(0.5, abs=0.15)


def _crossing_fits() -> list:
    """Run 1 levels off at 0.6 (below run 0's 0.7) up to compute 100, then climbs towards
    0.85."""
    fast = predict(SigmoidParams(0.7, 2.0, 10.0, 0.1), COMPUTE)
    early = predict(SigmoidParams(0.6, 2.0, 10.0, 0.1), COMPUTE)
    slow = np.where(COMPUTE <= 100.0, early, 0.6 + 0.25 * (1.0 - 100.0 / COMPUTE))
    return _fits(fast, slow)


def test_runs_that_cross_settle_on_the_later_winner() -> None:
    # Early comparisons name run 0, the full one run 1.
    fits = _crossing_fits()
    result = compare_fits(fits)
    assert result.best == 1
    through_100 = [fit_through(f, 100.0) for f in fits]
    assert compare_fits(through_100).best == 0  # before the climb, run 0 looked best
    since = stable_from(fits, 1, 0.02)
    assert since is not None and 100.0 < since < COMPUTE[-1]
    # From `since` on, every comparison names run 1; the computes before it do not.
    assert since in COMPUTE
    before = COMPUTE[np.searchsorted(COMPUTE, since) - 1]
    assert compare_fits([fit_through(f, before) for f in fits]).best != 1
    v = early_verdict(fits, result, [None, None], [0, 0], 0.02)
    assert v.stable_from == since
    assert f"the verdict has held since compute {since:.4g} (last point 2000)" in v.line


def test_a_verdict_that_changes_at_the_last_point_is_not_stable() -> None:
    # Run 1 levels off at 0.62, below run 0's 0.7, and its last two evaluations jump to
    # 0.9: with one of them its fitted A is 0.66 (run 0 best), with both 0.74 (run 1).
    base = predict(SigmoidParams(0.7, 2.0, 10.0, 0.1), COMPUTE)
    jump = predict(SigmoidParams(0.62, 2.0, 10.0, 0.1), COMPUTE)
    jump[-2:] = 0.9
    fits = _fits(base, jump)
    result = compare_fits(fits)
    assert result.best == 1
    assert stable_from(fits, 1, 0.02) is None
    v = early_verdict(fits, result, [None, None], [0, 0], 0.02)
    assert v.stable_from is None and "not yet stable" in v.line


def test_early_verdict_rejects_mismatched_inputs() -> None:
    fits = _fits(predict(TRUTH, COMPUTE), predict(TRUTH, COMPUTE))
    with pytest.raises(CurveInputError, match="^runs: "):
        early_verdict(fits, compare_fits(fits), [None], [0, 0], 0.02)


# --- the verdict at a compute ------------------------------------------------------------


def test_at_a_compute_a_run_that_has_not_bent_is_called_where_its_asymptote_is_not() -> None:
    # Run 0 bends to 0.75 by compute 10; run 1 rises slowly (C_mid 1000, far past the last
    # point at 100): its asymptote is open, so 18% of the joint draws give it the higher A
    # (too close to call at 0.9), yet at the compute spent no draw puts it above run 0.
    compute = np.geomspace(1.0, 100.0, 12)
    rng = np.random.default_rng(0)
    fast = predict(SigmoidParams(0.75, 2.5, 10.0, 0.1), compute) + rng.normal(0, 0.02, 12)
    slow = predict(SigmoidParams(0.9, 1.0, 1000.0, 0.1), compute) + rng.normal(0, 0.02, 12)
    fits = [fit_sigmoid(compute, r, r0=0.1) for r in (fast, slow)]
    result = compare_fits(fits)
    v = early_verdict(fits, result, [None, None], [0, 0], 0.02, at_compute=100.0)
    assert result.best == 0 and v.p_best_a == (0.82, 0.18)
    at = v.at_compute
    assert at is not None and (at.compute, at.best, at.p_best) == (100.0, 0, (1.0, 0.0))
    for fit, reward in zip(fits, at.reward, strict=True):
        assert reward == pytest.approx(
            float(predict(SigmoidParams(fit.a, fit.b, fit.c_mid, 0.1), [100.0])[0])
        )
    assert at.reward[0] == pytest.approx(0.7319, abs=1e-4)
    assert at.line.startswith(
        "at compute 100, run 0 is predicted the best reward (0.7319) "
        "with probability 1.00 (100 joint bootstrap draws)"
    )
    assert early_verdict(fits, result, [None, None], [0, 0], 0.02).at_compute is None


def test_runs_that_cross_are_ranked_by_the_compute_asked() -> None:
    # Run 0 is ahead up to compute 100 and run 1 past it: at compute 50 run 0 is predicted
    # best, at 4000 run 1, and the prefix fits named run 0 at 50 from the fourth point on.
    fits = _crossing_fits()
    result = compare_fits(fits)
    near = early_verdict(fits, result, [None, None], [0, 0], 0.02, at_compute=50.0).at_compute
    far = early_verdict(fits, result, [None, None], [0, 0], 0.02, at_compute=4000.0).at_compute
    assert near is not None and far is not None
    assert (near.best, near.p_best) == (0, (1.0, 0.0))
    assert (far.best, far.p_best) == (1, (0.0, 1.0))
    assert near.reward[0] == pytest.approx(0.1 + 0.6 / (1 + (10 / 50) ** 2), abs=2e-3)  # Eq. 1
    assert near.stable_from == COMPUTE[3]  # the first cut where both runs have 4 points
    # The prefix through 263 (the second cut past the climb's start at 100) already puts
    # run 1 above run 0 at 4000, before its A clears the margin (from 437).
    assert far.stable_from == pytest.approx(263.48, abs=0.01) and far.stable_from in COMPUTE
    assert stable_from(fits, 1, 0.02) == pytest.approx(437.34, abs=0.01)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_compute_that_is_not_finite_and_positive_is_refused(bad: float) -> None:
    fits = _fits(predict(TRUTH, COMPUTE), predict(TRUTH, COMPUTE))
    with pytest.raises(CurveInputError) as err:
        early_verdict(fits, compare_fits(fits), [None, None], [0, 0], 0.02, at_compute=bad)
    assert err.value.field == "at_compute"
