"""The one fit shape (FitSummary, FitSpec) and the one client (CurveClient) of the curve
service, against a real in-process server."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from curve_service.metrics import CurveMetrics
from curve_service.server import CurveServicer, serve
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.store import MemoryRunStore
from scalerl.ports import free_port
from scalerl.rpc.clients.base import RpcFailed
from scalerl.rpc.clients.curve import ZERO_COMPUTE, CurveClient, FitSpec
from scalerl.rpc.clients.curve_results import (
    FIT_KEYS,
    RANKED_RUN_KEYS,
    STABILITY_KEYS,
    FitSummary,
    Prediction,
    RankedRun,
    TrimmedRun,
    write_curve_json,
)
from scalerl.rpc.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from scalerl.v1 import curve_pb2

TRUTH = SigmoidParams(a=0.8, b=1.5, c_mid=100.0, r0=0.1)
COMPUTE = np.geomspace(1.0, 2000.0, 12)
# The documented dict form of a fit: written out here so that a change to FIT_KEYS or
# to_dict that is not also a deliberate change of this list fails.
DOCUMENTED_KEYS = {
    "A",
    "B",
    "C_mid",
    "R0",
    "A_interval",
    "B_interval",
    "C_mid_interval",
    "interval_level",
    "interval_resamples",
    "sse",
    "points_used",
    "warnings",
    "grid",
    "predictions",
    "power_law",
    "power_law_predictions",
    "compute_unit",
    "stability",
}


def _full_reply() -> curve_pb2.FitResponse:
    reply = curve_pb2.FitResponse(
        params=curve_pb2.CurveParams(a=0.71, b=1.65, c_mid=6500.0, r0=0.51),
        sse=2.5e-4,
        points_used=20,
        warnings=["only 5 points used"],
        grid=curve_pb2.FitGrid(description="A 0.450..0.800 step 0.005 (71)"),
        predictions=[curve_pb2.Prediction(compute=5e4, reward=0.70, lower=0.69, upper=0.72)],
        power_law=curve_pb2.PowerLawFit(a=0.75, d=2.0, b=0.4, sse=3e-4),
        power_law_predictions=[
            curve_pb2.Prediction(compute=5e4, reward=0.74, lower=0.74, upper=0.74)
        ],
        stability=curve_pb2.Stability(
            target_compute=1e5,
            history=[
                curve_pb2.Prediction(compute=1e5, reward=0.705, lower=0.69, upper=0.72),
                curve_pb2.Prediction(compute=1e5, reward=0.701, lower=0.701, upper=0.701),
            ],
            moved=0.004,
            band_half_width=0.015,
            ratio=0.004 / 0.015,
            verdict="stable",
            summary="stable: the prediction at C=1e+05 moved 0.004 over the last 1 points",
        ),
    )
    iv = reply.intervals
    iv.a.CopyFrom(curve_pb2.Interval(lower=0.70, upper=0.72))
    iv.b.CopyFrom(curve_pb2.Interval(lower=1.5, upper=1.8))
    iv.c_mid.CopyFrom(curve_pb2.Interval(lower=6000.0, upper=7000.0))
    iv.level, iv.resamples = 0.9, 200
    return reply


# --- FitSummary: proto -> FitSummary -> dict ------------------------------------------


def test_fit_summary_round_trip_keeps_every_field() -> None:
    fit = FitSummary.from_proto(_full_reply(), compute_unit="gpu-hours")
    assert (fit.a, fit.b, fit.c_mid, fit.r0) == (0.71, 1.65, 6500.0, 0.51)
    assert (fit.a_interval, fit.b_interval) == ((0.70, 0.72), (1.5, 1.8))
    assert fit.c_mid_interval == (6000.0, 7000.0)
    assert (fit.interval_level, fit.interval_resamples) == (0.9, 200)
    assert fit.predictions == (Prediction(compute=5e4, reward=0.70, lower=0.69, upper=0.72),)
    out = fit.to_dict()
    assert set(out) == DOCUMENTED_KEYS == set(FIT_KEYS)
    assert out["A_interval"] == [0.70, 0.72] and out["C_mid_interval"] == [6000.0, 7000.0]
    assert out["predictions"] == [{"compute": 5e4, "reward": 0.70, "lower": 0.69, "upper": 0.72}]
    assert out["power_law"] == {"A": 0.75, "D": 2.0, "B": 0.4, "sse": 3e-4}
    assert out["power_law_predictions"][0]["reward"] == 0.74
    assert (out["sse"], out["points_used"], out["compute_unit"]) == (2.5e-4, 20, "gpu-hours")
    assert out["warnings"] == ["only 5 points used"]
    assert out["grid"] == "A 0.450..0.800 step 0.005 (71)"
    assert fit.stability.history[1] == Prediction(
        compute=1e5, reward=0.701, lower=0.701, upper=0.701
    )
    assert set(out["stability"]) == set(STABILITY_KEYS)
    assert out["stability"]["history"][0] == {
        "compute": 1e5,
        "reward": 0.705,
        "lower": 0.69,
        "upper": 0.72,
    }
    assert (out["stability"]["moved"], out["stability"]["band_half_width"]) == (0.004, 0.015)
    assert out["stability"]["verdict"] == "stable"
    assert out["stability"]["target_compute"] == 1e5
    assert json.loads(json.dumps(out)) == out  # plain JSON types only


def test_a_fit_without_bootstrap_has_the_same_keys_with_none() -> None:
    reply = curve_pb2.FitResponse(params=curve_pb2.CurveParams(a=0.8, b=1.5, c_mid=1, r0=0.1))
    out = FitSummary.from_proto(reply).to_dict()
    assert set(out) == DOCUMENTED_KEYS
    assert out["A_interval"] is None and out["interval_level"] is None
    assert out["interval_resamples"] == 0
    assert out["power_law"] is None and out["predictions"] == []
    assert out["compute_unit"] is None and out["stability"] is None


def test_ranked_run_dict_adds_the_comparison_keys() -> None:
    fit = FitSummary.from_proto(_full_reply())
    out = RankedRun(index=1, rank=2, fit=fit, b_at_shared_a=1.2, p_best_a=0.25).to_dict()
    assert (
        set(out)
        == set(RANKED_RUN_KEYS)
        == DOCUMENTED_KEYS
        | {
            "rank",
            "B_at_shared_A",
            "C_mid_at_shared_A",
            "p_best_A",
            "p_best_B",
            "reward_at_compute",
            "p_best_at_compute",
        }
    )
    assert (out["rank"], out["B_at_shared_A"], out["C_mid_at_shared_A"]) == (2, 1.2, None)
    assert (out["p_best_A"], out["p_best_B"]) == (0.25, None)


def test_write_curve_json_writes_the_dict_form(tmp_path: Path) -> None:
    fit = FitSummary.from_proto(_full_reply(), compute_unit="accelerator-hours")
    path = write_curve_json(tmp_path / "curve.json", fit)
    assert json.loads(path.read_text()) == fit.to_dict()


# --- FitSpec: the one place a FitRequest is built ---------------------------------------


def test_fit_spec_sets_only_the_options_given() -> None:
    plain = FitSpec(compute=[1.0, 2.0], reward=[0.1, 0.2]).to_proto()
    assert not plain.HasField("r0") and not plain.HasField("min_compute")
    assert not plain.HasField("target_compute")
    assert [p.series for p in plain.points] == ["", ""]
    assert [p.stderr for p in plain.points] == [0.0, 0.0]  # unknown
    assert not plain.method.HasField("seed_sd") and plain.method.band == ""
    spec = FitSpec(
        compute=[1.0, 2.0],
        reward=[0.1, 0.2],
        series=["s0", "s1"],
        stderr=[0.02, 0.0],
        r0=0.0,  # a set R0 of 0 is sent, not dropped
        max_compute=5.0,
        bootstrap_resamples=50,
        seed=3,
        level=0.8,
        paper_grid=True,
        power_law=True,
        seed_sd=0.0,  # a set 0 (the data's noise only) is sent, not dropped
        band="curve",
        predict_compute=[10.0],
        target_compute=20.0,
    )
    request = spec.to_proto()
    assert request.HasField("r0") and request.r0 == 0.0
    assert request.target_compute == 20.0
    assert (request.max_compute, list(request.predict_compute)) == (5.0, [10.0])
    m = request.method
    assert (m.bootstrap_resamples, m.seed, m.level, m.paper_grid, m.power_law) == (
        50,
        3,
        pytest.approx(0.8),
        True,
        True,
    )
    assert m.HasField("seed_sd") and (m.seed_sd, m.band) == (0.0, "curve")
    assert [(p.compute, p.reward, p.series, p.stderr) for p in request.points] == [
        (1.0, 0.1, "s0", 0.02),
        (2.0, 0.2, "s1", 0.0),
    ]
    with pytest.raises(ValueError, match="2 compute values, 1 rewards"):
        FitSpec(compute=[1.0, 2.0], reward=[0.1]).to_proto()
    with pytest.raises(ValueError, match="2 series labels and 1 standard errors$"):
        FitSpec(compute=[1.0, 2.0], reward=[0.1, 0.2], stderr=[0.01]).to_proto()


def test_fit_spec_from_evals_is_the_run_convention() -> None:
    evals = [
        SimpleNamespace(compute=0.0, pass_rate=0.2, stderr=None),  # a record without one
        SimpleNamespace(compute=0.5, pass_rate=0.4, stderr=0.03),
    ]
    spec = FitSpec.from_evals(evals, predict_compute=[1.0])
    assert list(spec.compute) == [ZERO_COMPUTE, 0.5]
    assert list(spec.stderr) == [0.0, 0.03]  # None = unknown
    assert (spec.r0, spec.bootstrap_resamples, spec.seed) == (0.2, 200, 0)
    assert list(spec.predict_compute) == [1.0]
    assert FitSpec.from_evals(evals, r0=0.1, bootstrap_resamples=0).r0 == 0.1


# --- CurveClient against a real server --------------------------------------------------


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    store = MemoryRunStore(max_runs=2)
    server, port, _ = serve(port=0, servicer=CurveServicer(store=store, metrics=CurveMetrics()))
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture
def client(address: str) -> Iterator[CurveClient]:
    with CurveClient(address, timeout_s=30.0, compute_unit="accelerator-hours") as c:
        yield c


def test_client_fit_returns_a_typed_summary(client: CurveClient) -> None:
    reward = predict(TRUTH, COMPUTE) + np.random.default_rng(0).normal(0, 0.01, 12)
    spec = FitSpec(
        compute=list(COMPUTE),
        reward=list(reward),
        r0=0.1,
        bootstrap_resamples=50,
        seed=1,
        predict_compute=[100.0, 1e4],
    )
    fit = client.fit(spec)
    assert fit.a == pytest.approx(0.8, abs=0.02) and fit.b == pytest.approx(1.5, rel=0.1)
    assert fit.r0 == 0.1 and fit.points_used == 12
    assert fit.a_interval[0] <= fit.a <= fit.a_interval[1]
    assert (fit.interval_level, fit.interval_resamples) == (0.9, 50)
    assert [q.compute for q in fit.predictions] == [100.0, 1e4]
    assert all(q.lower <= q.reward <= q.upper for q in fit.predictions)
    assert fit.grid.startswith("A ") and fit.compute_unit == "accelerator-hours"
    assert client.fit(spec) == fit  # seeded: the same request, the same summary


def test_client_compare_runs_ranks_by_b_at_a_shared_a(client: CurveClient) -> None:
    slow = FitSpec(compute=list(COMPUTE), reward=list(predict(TRUTH, COMPUTE)), r0=0.1)
    fast_reward = predict(SigmoidParams(0.81, 2.5, 100.0, 0.1), COMPUTE)
    fast = FitSpec(compute=list(COMPUTE), reward=list(fast_reward), r0=0.1)
    result = client.compare_runs([slow, fast])
    assert (result.best, result.decided_by) == (1, "B")
    assert result.shared_a == pytest.approx(0.805, abs=1e-6)
    assert [(r.index, r.rank) for r in result.runs] == [(0, 2), (1, 1)]
    assert result.runs[1].b_at_shared_a > result.runs[0].b_at_shared_a
    assert result.runs[0].fit.a == pytest.approx(0.8, rel=1e-5)
    assert "run 1 scales most efficiently" in result.summary


def test_client_record_point_and_trim_run_return_the_refreshed_fit(client: CurveClient) -> None:
    compute = np.geomspace(0.01, 1.0, 5)
    reward = predict(SigmoidParams(0.8, 1.5, 0.1, 0.1), compute)
    recorded = [
        client.record_point("client-run", c, r, r0=0.1)
        for c, r in zip(compute, reward, strict=True)
    ]
    assert [r.points for r in recorded] == [1, 2, 3, 4, 5]
    assert [r.fit is None for r in recorded] == [True] * 3 + [False] * 2
    last = recorded[-1].fit
    assert (last.a, last.b, last.c_mid, last.r0) == pytest.approx((0.8, 1.5, 0.1, 0.1), rel=1e-5)
    assert last.points_used == 5 and last.compute_unit == "accelerator-hours"

    trimmed = client.trim_run("client-run", float(compute[3]))
    assert isinstance(trimmed, TrimmedRun)
    assert (trimmed.points_removed, trimmed.points) == (1, 4)
    assert trimmed.fit.points_used == 4 and trimmed.fit.compute_unit == "accelerator-hours"
    got = (trimmed.fit.a, trimmed.fit.b, trimmed.fit.c_mid, trimmed.fit.r0)
    assert got == pytest.approx((0.8, 1.5, 0.1, 0.1), rel=1e-4)
    assert client.trim_run("client-run", float(compute[2])) == TrimmedRun(
        points_removed=1, points=3, fit=None
    )
    assert client.trim_run("client-run", float(compute[2])) == TrimmedRun(
        points_removed=0, points=3, fit=None
    )
    with pytest.raises(InvalidArgument) as err:
        client.trim_run("client-run", math.nan)
    assert (err.value.field, err.value.message) == (
        "max_compute",
        "must be finite and >= 0, got nan",
    )
    with pytest.raises(NotFound, match="no run named 'client-never'"):
        client.trim_run("client-never", 1.0)


def test_client_extrapolate_predicts_a_recorded_series_with_its_band() -> None:
    # A service of its own: the module's server holds two runs, which later tests count on.
    client = CurveClient.in_process(CurveServicer(metrics=CurveMetrics()))
    compute = np.geomspace(0.01, 1.0, 6)
    reward = predict(SigmoidParams(0.8, 1.5, 0.1, 0.1), compute)
    for c, r in zip(compute, reward, strict=True):
        client.record_point("extrapolated-run", c, r, r0=0.1, stderr=0.02)
    fit = client.get_run("extrapolated-run").fit
    at = [0.5, 2.0, 4.0]
    band = client.extrapolate("extrapolated-run", at)
    assert [p.compute for p in band] == at  # in the order asked
    expected = predict(SigmoidParams(fit.a, fit.b, fit.c_mid, fit.r0), at)
    assert [p.reward for p in band] == pytest.approx(list(expected), rel=1e-9)
    assert all(p.lower < p.reward < p.upper for p in band)
    assert band[2].upper - band[2].lower > band[0].upper - band[0].lower  # wider further out
    with pytest.raises(NotFound):
        client.extrapolate("extrapolated-never", at)
    client.record_point("extrapolated-short", 0.01, 0.1)
    with pytest.raises(FailedPrecondition, match="has no fit yet"):
        client.extrapolate("extrapolated-short", at)


def test_client_raises_domain_errors_with_the_request_field(client: CurveClient) -> None:
    bad = FitSpec(compute=[1.0, 2.0, 3.0, 4.0], reward=[0.1, math.inf, 0.3, 0.4])
    with pytest.raises(InvalidArgument) as err:
        client.fit(bad)
    assert (err.value.field, err.value.message) == ("points[1].reward", "must be finite, got inf")
    good = FitSpec(compute=list(COMPUTE), reward=list(predict(TRUTH, COMPUTE)), r0=0.1)
    out_of_range = FitSpec(compute=[1.0, 2.0, 3.0, 4.0], reward=[0.1, 0.2, 0.3, 1.5])
    with pytest.raises(InvalidArgument) as err:
        client.compare_runs([good, out_of_range])
    assert err.value.field == "runs[1].points[3].reward"
    assert err.value.message == "must be in [-1, 1], got 1.5"


def test_client_maps_other_statuses(address: str, client: CurveClient, monkeypatch) -> None:
    client.record_point("client-full", 1.0, 0.1)  # the store's second (last) run
    with pytest.raises(ResourceExhausted, match="maximum 2 runs"):
        client.record_point("client-one-too-many", 1.0, 0.1)
    with CurveClient(f"127.0.0.1:{free_port()}", timeout_s=5.0) as nobody:
        with pytest.raises(Unavailable):
            nobody.fit(FitSpec(compute=[1.0], reward=[0.1]))

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the fit")

    monkeypatch.setattr("curve_service.recorded.fit_sigmoid", broken)
    with pytest.raises(RpcFailed) as err:
        client.fit(FitSpec(compute=list(COMPUTE), reward=list(predict(TRUTH, COMPUTE))))
    assert err.value.status == "INTERNAL"
    assert str(err.value) == "Fit failed: RuntimeError; see server log"
