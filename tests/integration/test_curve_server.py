"""Contract tests of scalerl.v1.CurveService over a real in-process gRPC server."""

from __future__ import annotations

import csv
import math
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from curve_service.errors import CurveInputError, StoreFullError, UnknownRunError
from curve_service.metrics import CurveMetrics, start_metrics_server
from curve_service.server import CurveServicer, serve
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.store import MemoryRunStore
from scalerl.rpc import channel as grpc_channel
from scalerl.v1 import curve_pb2, curve_pb2_grpc

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FIG1 = REPO.parent / "shared" / "data" / "curves" / "scalerl_fig1_fit_points.csv"
TIMEOUT_S = 30.0
TRUTH = SigmoidParams(a=0.8, b=1.5, c_mid=0.1, r0=0.1)  # a CPU-scale run, accelerator-hours


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[curve_pb2_grpc.CurveServiceStub, CurveServicer]]:
    servicer = CurveServicer(metrics=CurveMetrics())
    server, port, _ = serve(port=0, servicer=servicer)
    with grpc_channel.channel(f"127.0.0.1:{port}") as ch:
        yield curve_pb2_grpc.CurveServiceStub(ch), servicer
    server.stop(None)


@pytest.fixture
def stub(service: tuple) -> curve_pb2_grpc.CurveServiceStub:
    return service[0]


def _points(compute: np.ndarray, reward: np.ndarray) -> list[curve_pb2.CurvePoint]:
    return [curve_pb2.CurvePoint(compute=c, reward=r) for c, r in zip(compute, reward, strict=True)]


def _fits(servicer: CurveServicer, status: str) -> float:
    return servicer.metrics.registry.get_sample_value(
        "scalerl_curve_fits_total", {"status": status}
    )


def _invalid(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value


# --- Fit ------------------------------------------------------------------------------


def test_fit_on_the_scout_run(stub: curve_pb2_grpc.CurveServiceStub) -> None:
    if not FIG1.exists():
        pytest.skip(f"digitized ScaleRL Fig. 1a points not found at {FIG1}")
    with FIG1.open() as f:
        rows = [r for r in csv.DictReader(f) if r["run"] == "scout_17bx16_moe"]
    compute = np.array([float(r["gpu_hours"]) for r in rows])
    reward = np.array([float(r["pass_rate"]) for r in rows])
    reply = stub.Fit(
        curve_pb2.FitRequest(points=_points(compute, reward), r0=0.5116, min_compute=1500),
        timeout=TIMEOUT_S,
    )
    # Paper Table 1 (Scout): A = 0.710, B = 1.65.
    assert reply.points_used == 20
    assert abs(reply.params.a - 0.710) <= 0.01
    assert abs(reply.params.b - 1.65) <= 0.10
    assert reply.params.r0 == 0.5116
    assert reply.sse == pytest.approx(2.527e-4, rel=0.01)
    assert list(reply.warnings) == []


def test_fit_takes_r0_from_the_lowest_compute_and_reports_warnings(stub) -> None:
    compute = np.array([0.08, 0.01, 0.02, 0.04, 0.16])  # unsorted on purpose
    reply = stub.Fit(
        curve_pb2.FitRequest(points=_points(compute, predict(TRUTH, compute))),
        timeout=TIMEOUT_S,
    )
    assert reply.params.r0 == pytest.approx(float(predict(TRUTH, [0.01])[0]))
    assert reply.points_used == 5
    assert any("only 5 points" in w for w in reply.warnings)


@pytest.mark.parametrize(
    ("compute", "reward", "field"),
    [
        ([1.0, 2.0, 3.0, 4.0], [0.1, 0.2, math.nan, 0.4], "points[2].reward"),
        ([1.0, -2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4], "points[1].compute"),
        ([1.0, 2.0, 3.0], [0.1, 0.2, 0.3], "points: 3 points"),
    ],
)
def test_fit_rejects_bad_points_naming_the_field(service, compute, reward, field) -> None:
    stub, servicer = service
    before = _fits(servicer, "invalid")
    request = curve_pb2.FitRequest(points=_points(np.array(compute), np.array(reward)))
    err = _invalid(stub.Fit, request)
    assert err.details().startswith(field)
    assert _fits(servicer, "invalid") == before + 1


def test_fit_rejects_a_bad_window(stub) -> None:
    points = _points(np.arange(1.0, 7.0), np.linspace(0.1, 0.6, 6))
    err = _invalid(stub.Fit, curve_pb2.FitRequest(points=points, min_compute=5, max_compute=2))
    assert err.details().startswith("max_compute: must be > min_compute (5)")


def test_a_bug_in_a_handler_is_internal_and_counted(service, monkeypatch) -> None:
    """Any exception that is not a domain error reaches the client as INTERNAL (never a
    retryable code), through the one error interceptor; the fit counts as an error."""
    stub, servicer = service

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the fit")

    monkeypatch.setattr("curve_service.recorded.fit_sigmoid", broken)
    errors_before = _fits(servicer, "error")
    points = _points(np.geomspace(0.01, 1.0, 6), predict(TRUTH, np.geomspace(0.01, 1.0, 6)))
    for call, request in [
        (stub.Fit, curve_pb2.FitRequest(points=points)),
        (
            stub.CompareRuns,
            curve_pb2.CompareRunsRequest(runs=[curve_pb2.FitRequest(points=points)] * 2),
        ),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        method = "Fit" if call is stub.Fit else "CompareRuns"
        assert err.value.details() == f"{method} failed: RuntimeError; see server log"
    assert _fits(servicer, "error") == errors_before + 2


# --- RecordPoint / GetRun ---------------------------------------------------------------


def test_record_points_then_get_run(service) -> None:
    stub, servicer = service
    compute = np.geomspace(0.01, 1.0, 8)
    reward = predict(TRUTH, compute)
    order = [3, 0, 5, 1, 7, 2, 6, 4]  # arrival order need not be compute order
    replies = [
        stub.RecordPoint(
            curve_pb2.RecordPointRequest(
                run_id="cpu-run.1",
                point=curve_pb2.CurvePoint(compute=compute[i], reward=reward[i]),
                r0=0.1,
            ),
            timeout=TIMEOUT_S,
        )
        for i in order
    ]
    assert [r.points for r in replies] == list(range(1, 9))
    assert [r.HasField("fit") for r in replies] == [False] * 3 + [True] * 5
    assert replies[-1].fit.points_used == 8

    run = stub.GetRun(curve_pb2.GetRunRequest(run_id="cpu-run.1"), timeout=TIMEOUT_S)
    assert run.run_id == "cpu-run.1"
    assert [p.compute for p in run.points] == pytest.approx(list(compute))
    assert [p.reward for p in run.points] == pytest.approx(list(reward))
    got = (run.fit.params.a, run.fit.params.b, run.fit.params.c_mid, run.fit.params.r0)
    assert got == pytest.approx((0.8, 1.5, 0.1, 0.1), rel=1e-5)

    registry = servicer.metrics.registry
    total = {"run_id": "cpu-run.1", "task": ""}  # the run's total series
    assert registry.get_sample_value("scalerl_curve_asymptote", total) == (
        pytest.approx(0.8, rel=1e-5)
    )
    assert registry.get_sample_value("scalerl_curve_points", total) == 8


def test_record_point_retry_is_idempotent_and_conflicts_are_rejected(stub) -> None:
    def record(compute: float, reward: float, **kw) -> curve_pb2.RecordPointResponse:
        point = curve_pb2.CurvePoint(compute=compute, reward=reward)
        request = curve_pb2.RecordPointRequest(run_id="retry", point=point, **kw)
        return stub.RecordPoint(request, timeout=TIMEOUT_S)

    for c in (1.0, 2.0, 4.0, 8.0):
        first = record(c, 0.1 * c**0.5, r0=0.05)
    again = record(8.0, 0.1 * 8.0**0.5, r0=0.05)
    assert again.points == 4
    assert again.fit == first.fit

    err = _invalid(stub.RecordPoint, _record_request("retry", 8.0, 0.9))
    assert err.details().startswith("point.compute: run 'retry' already has compute=8")
    err = _invalid(stub.RecordPoint, _record_request("retry", 16.0, 0.5, r0=0.3))
    assert err.details() == "r0: run 'retry' has r0=0.05; got 0.3"
    run = stub.GetRun(curve_pb2.GetRunRequest(run_id="retry"), timeout=TIMEOUT_S)
    assert len(run.points) == 4  # nothing half-applied


def _record_request(run_id: str, compute: float, reward: float, **kw) -> object:
    point = curve_pb2.CurvePoint(compute=compute, reward=reward)
    return curve_pb2.RecordPointRequest(run_id=run_id, point=point, **kw)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_record_request("bad id!", 1.0, 0.1), "run_id"),
        (_record_request("ok", math.nan, 0.1), "point.compute"),
        (_record_request("ok", 1.0, 2.0), "point.reward"),
        (curve_pb2.RecordPointRequest(run_id="ok"), "point"),
    ],
)
def test_record_point_rejects_bad_input(stub, request_, field) -> None:
    err = _invalid(stub.RecordPoint, request_)
    assert err.details().startswith(f"{field}: ")


def test_get_run_of_an_unknown_run_is_not_found(stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.GetRun(curve_pb2.GetRunRequest(run_id="never-recorded"), timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "never-recorded" in err.value.details()


# --- TrimRun ----------------------------------------------------------------------------


def _trim(stub, run_id: str, max_compute: float) -> curve_pb2.TrimRunResponse:
    request = curve_pb2.TrimRunRequest(run_id=run_id, max_compute=max_compute)
    return stub.TrimRun(request, timeout=TIMEOUT_S)


def _gauge(servicer: CurveServicer, name: str, run_id: str, task: str = "") -> float | None:
    return servicer.metrics.registry.get_sample_value(name, {"run_id": run_id, "task": task})


def test_trim_run_drops_the_points_above_and_refits(service) -> None:
    """A resumed learner's discarded evaluations leave the curve: the points above the
    checkpoint's compute go, the run is refitted on the rest, the gauges follow."""
    stub, servicer = service
    compute = np.geomspace(0.01, 1.0, 8)
    reward = predict(TRUTH, compute)
    for c, r in zip(compute, reward, strict=True):
        stub.RecordPoint(_record_request("resumed", c, r, r0=0.1), timeout=TIMEOUT_S)

    reply = _trim(stub, "resumed", compute[5])  # the bound itself is kept
    assert (reply.points_removed, reply.points) == (2, 6)
    assert reply.fit.points_used == 6 and reply.fit.params.r0 == 0.1
    got = (reply.fit.params.a, reply.fit.params.b, reply.fit.params.c_mid)
    assert got == pytest.approx((0.8, 1.5, 0.1), rel=1e-4)
    run = stub.GetRun(curve_pb2.GetRunRequest(run_id="resumed"), timeout=TIMEOUT_S)
    assert [p.compute for p in run.points] == list(compute[:6])
    assert [p.reward for p in run.points] == list(reward[:6])
    assert run.fit == reply.fit
    assert _gauge(servicer, "scalerl_curve_points", "resumed") == 6

    fits_before = _fits(servicer, "ok")
    again = _trim(stub, "resumed", compute[5])  # nothing above: no change, no refit
    assert (again.points_removed, again.points, again.fit) == (0, 6, reply.fit)
    assert _fits(servicer, "ok") == fits_before

    # The resumed run records its new evaluations above the bound again.
    later = stub.RecordPoint(_record_request("resumed", 0.5, 0.7), timeout=TIMEOUT_S)
    assert later.points == 7 and later.fit.points_used == 7

    few = _trim(stub, "resumed", compute[2])  # 3 points left: too few for a fit
    assert (few.points_removed, few.points, few.HasField("fit")) == (4, 3, False)
    assert _gauge(servicer, "scalerl_curve_points", "resumed") == 3
    assert _gauge(servicer, "scalerl_curve_asymptote", "resumed") is None
    run = stub.GetRun(curve_pb2.GetRunRequest(run_id="resumed"), timeout=TIMEOUT_S)
    assert [p.compute for p in run.points] == list(compute[:3])
    assert not run.HasField("fit")


@pytest.mark.parametrize(
    ("max_compute", "details"),
    [
        (-1.0, "max_compute: must be finite and >= 0, got -1.0"),
        (math.nan, "max_compute: must be finite and >= 0, got nan"),
        (math.inf, "max_compute: must be finite and >= 0, got inf"),
        (None, "max_compute: required (0 removes every point)"),
    ],
)
def test_trim_run_rejects_a_bad_max_compute_and_changes_nothing(stub, max_compute, details) -> None:
    for c in (1.0, 2.0):
        stub.RecordPoint(_record_request("trim-bad", c, 0.1 * c), timeout=TIMEOUT_S)
    request = curve_pb2.TrimRunRequest(run_id="trim-bad")
    if max_compute is not None:
        request.max_compute = max_compute
    err = _invalid(stub.TrimRun, request)
    assert err.details() == details
    run = stub.GetRun(curve_pb2.GetRunRequest(run_id="trim-bad"), timeout=TIMEOUT_S)
    assert [p.compute for p in run.points] == [1.0, 2.0]


def test_trim_run_of_an_unknown_run_is_not_found_and_a_bad_id_invalid(stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _trim(stub, "never-trimmed", 1.0)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details() == "run_id: no run named 'never-trimmed'"
    err = _invalid(stub.TrimRun, curve_pb2.TrimRunRequest(run_id="bad id!", max_compute=1.0))
    assert err.details().startswith("run_id: ")


# --- Extrapolate ------------------------------------------------------------------------


def test_extrapolate_with_params(stub) -> None:
    params = curve_pb2.CurveParams(a=0.7, b=2.0, c_mid=100.0, r0=0.5)
    reply = stub.Extrapolate(
        curve_pb2.ExtrapolateRequest(params=params, compute=[200.0, 50.0]), timeout=TIMEOUT_S
    )
    # (100/200)^2 = 0.25 -> 0.5 + 0.2/1.25 = 0.66; (100/50)^2 = 4 -> 0.5 + 0.2/5 = 0.54.
    got = [[p.compute, p.reward, p.lower, p.upper] for p in reply.predictions]
    np.testing.assert_allclose(got, [[200.0, 0.66, 0.66, 0.66], [50.0, 0.54, 0.54, 0.54]])


def test_extrapolate_a_run_gives_a_band(stub) -> None:
    compute = np.geomspace(0.01, 0.5, 10)
    noise = np.random.default_rng(5).normal(0.0, 0.01, 10)
    for c, r in zip(compute, predict(TRUTH, compute) + noise, strict=True):
        stub.RecordPoint(_record_request("banded", c, r, r0=0.1), timeout=TIMEOUT_S)
    request = curve_pb2.ExtrapolateRequest(run_id="banded", compute=[1.0, 10.0])
    first = stub.Extrapolate(request, timeout=TIMEOUT_S)
    for p in first.predictions:
        assert p.lower < p.reward < p.upper
        assert p.upper - p.lower < 0.2
    assert stub.Extrapolate(request, timeout=TIMEOUT_S) == first  # seeded, cached


@pytest.mark.parametrize(
    ("request_", "code", "details"),
    [
        (curve_pb2.ExtrapolateRequest(compute=[1.0]), "INVALID_ARGUMENT", "params:"),
        (
            curve_pb2.ExtrapolateRequest(
                params=curve_pb2.CurveParams(a=0.7, b=2, c_mid=1, r0=0.5), run_id="x", compute=[1]
            ),
            "INVALID_ARGUMENT",
            "params:",
        ),
        (
            curve_pb2.ExtrapolateRequest(
                params=curve_pb2.CurveParams(a=0.7, b=2, c_mid=1, r0=0.5), compute=[1.0, -1.0]
            ),
            "INVALID_ARGUMENT",
            "compute[1]:",
        ),
        (
            curve_pb2.ExtrapolateRequest(
                params=curve_pb2.CurveParams(a=0.7, b=0, c_mid=1, r0=0.5), compute=[1.0]
            ),
            "INVALID_ARGUMENT",
            "params.b:",
        ),
        (curve_pb2.ExtrapolateRequest(run_id="nope", compute=[1.0]), "NOT_FOUND", "run_id:"),
    ],
)
def test_extrapolate_rejects_bad_requests(stub, request_, code, details) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Extrapolate(request_, timeout=TIMEOUT_S)
    assert err.value.code() == getattr(grpc.StatusCode, code)
    assert err.value.details().startswith(details)


def test_extrapolate_a_run_without_a_fit_fails_precondition(stub) -> None:
    stub.RecordPoint(_record_request("young", 1.0, 0.2), timeout=TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as err:
        stub.Extrapolate(curve_pb2.ExtrapolateRequest(run_id="young", compute=[2.0]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# --- /metrics and the console script ----------------------------------------------------


def test_metrics_endpoint_exposes_the_counters(service) -> None:
    stub, servicer = service
    points = _points(np.geomspace(0.01, 1.0, 6), predict(TRUTH, np.geomspace(0.01, 1.0, 6)))
    ok_before = _fits(servicer, "ok")
    stub.Fit(curve_pb2.FitRequest(points=points, r0=0.1), timeout=TIMEOUT_S)
    http, port = start_metrics_server(servicer.metrics, port=0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        http.shutdown()
        http.server_close()
    assert f'scalerl_curve_fits_total{{status="ok"}} {ok_before + 1}' in text
    assert 'scalerl_curve_fits_total{status="invalid"}' in text
    assert "scalerl_curve_fit_seconds_count" in text
    build = 'scalerl_build_info{device="cpu",dtype="float64",service="curve",version="0.1.0"}'
    assert f"{build} 1.0" in text


def test_console_script_serves_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "curve_service.main", "--port", "0", "--metrics-port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        words = line.split()
        assert words[:4] == ["curve", "service", "listening", "on"], line
        address, metrics_port = words[4], int(words[-1].lstrip(":"))
        grpc_channel.wait_healthy(address, timeout_s=TIMEOUT_S)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10):
            pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- the store behind the server --------------------------------------------------------


def test_store_is_thread_safe_and_rejects_stale_fits() -> None:
    store = MemoryRunStore()
    computes = [float(c) for c in range(1, 201)]

    def record(chunk: list[float]) -> None:
        for c in chunk:
            store.record("shared", c, 0.001 * c, None)

    threads = [threading.Thread(target=record, args=(computes[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = store.get("shared")
    assert [c for c, _ in snap.points] == computes  # every point, sorted
    assert snap.revision == 200
    assert store.set_fit("shared", 199, None) is False  # made from an older revision
    assert store.set_fit("shared", 200, None) is True


def test_store_limits_runs_and_points() -> None:
    store = MemoryRunStore(max_runs=1, max_points=2)
    store.record("a", 1.0, 0.1, None)
    store.record("a", 2.0, 0.2, None)
    with pytest.raises(CurveInputError, match=r"^point: run 'a' already holds 2 points"):
        store.record("a", 3.0, 0.3, None)
    with pytest.raises(StoreFullError):
        store.record("b", 1.0, 0.1, None)
    with pytest.raises(UnknownRunError):
        store.get("b")
