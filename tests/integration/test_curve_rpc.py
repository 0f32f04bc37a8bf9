"""Fit options, CompareRuns, bad input, Redis persistence, trimming a run in both stores and
the `scalerl curve` CLI."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from curve_stub import fit_request

from curve_service.errors import CurveInputError, UnknownRunError
from curve_service.fit import fit_sigmoid
from curve_service.metrics import CurveMetrics
from curve_service.redis_store import RedisRunStore
from curve_service.server import CurveServicer, serve
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.store import MemoryRunStore, RunStore
from scalerl.rpc import channel as grpc_channel
from scalerl.rpc.clients.curve_results import FIT_KEYS
from scalerl.state.client import connect
from scalerl.v1 import curve_pb2, curve_pb2_grpc
from scalerl_cli import main as cli

pytestmark = pytest.mark.integration
TIMEOUT_S = 30.0
TRUTH = SigmoidParams(a=0.8, b=1.5, c_mid=100.0, r0=0.1)
COMPUTE = np.geomspace(1.0, 2000.0, 12)


def test_fit_returns_grid_intervals_band_and_power_law(stub) -> None:
    reward = predict(TRUTH, COMPUTE) + np.random.default_rng(0).normal(0, 0.01, 12)
    method = curve_pb2.FitMethod(bootstrap_resamples=50, seed=1, power_law=True)
    request = fit_request(COMPUTE, reward, r0=0.1, method=method, predict_compute=[1e4, 1e5])
    reply = stub.Fit(request, timeout=TIMEOUT_S)
    iv = reply.intervals
    assert (iv.level, iv.resamples) == (0.9, 50)
    assert iv.a.lower <= reply.params.a <= iv.a.upper
    assert iv.b.lower <= reply.params.b <= iv.b.upper
    assert iv.c_mid.lower <= reply.params.c_mid <= iv.c_mid.upper
    # Default grid: C_mid from a tenth of the lowest compute (0.1) to 10x the highest.
    assert (reply.grid.c_mid_min, reply.grid.c_mid_max) == pytest.approx((0.1, 20_000.0))
    assert reply.grid.a_step == 0.005
    assert [p.compute for p in reply.predictions] == [1e4, 1e5]
    for p in reply.predictions:
        assert p.lower <= p.reward <= p.upper and p.upper - p.lower < 0.1
    assert reply.power_law.b > 0 and len(reply.power_law_predictions) == 2
    assert stub.Fit(request, timeout=TIMEOUT_S) == reply  # seeded


def test_paper_grid_is_reported(stub) -> None:
    request = fit_request(
        COMPUTE * 20, predict(TRUTH, COMPUTE), r0=0.1, method=curve_pb2.FitMethod(paper_grid=True)
    )
    grid = stub.Fit(request, timeout=TIMEOUT_S).grid
    assert (grid.a_min, grid.a_max, grid.c_mid_min, grid.c_mid_max) == (0.45, 0.8, 100, 40_000)
    assert grid.description.startswith("A 0.450..0.800 step 0.005 (71)")


def test_compare_runs_over_grpc(stub) -> None:
    other = predict(SigmoidParams(0.81, 2.5, 100.0, 0.1), COMPUTE)
    request = curve_pb2.CompareRunsRequest(
        runs=[
            fit_request(COMPUTE, predict(TRUTH, COMPUTE), r0=0.1),
            fit_request(COMPUTE, other, r0=0.1),
        ]
    )
    reply = stub.CompareRuns(request, timeout=TIMEOUT_S)
    assert (reply.best, reply.decided_by) == (1, "B")
    assert reply.shared_a == pytest.approx(0.805, abs=1e-6)
    assert [r.rank for r in reply.runs] == [2, 1]
    assert reply.runs[1].b_at_shared_a > reply.runs[0].b_at_shared_a
    bad = curve_pb2.CompareRunsRequest(runs=[request.runs[0], fit_request([1.0], [0.1])])
    with pytest.raises(grpc.RpcError) as err:
        stub.CompareRuns(bad, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("runs[1].points: 1 points")


_C4 = [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (fit_request([], []), "points: 0 points"),
        (fit_request([1.0], [0.1]), "points: 1 points"),
        (fit_request(_C4[:3], [0.1, 0.2, 0.3]), "points: 3 points"),
        (fit_request(_C4, [0.1, math.inf, 0.3, 0.4]), "points[1].reward: must be finite"),
        (fit_request([1.0, 0.0, 3.0, 4.0], [0.1] * 4), "points[1].compute: must be > 0"),
        (fit_request([1.0, 2.0, 1.0, 4.0], [0.1] * 4), "points[2].compute: duplicates"),
        (fit_request(_C4, [0.1, 0.2, 0.3, -1.5]), "points[3].reward: must be in [-1, 1]"),
        (
            fit_request(_C4, [0.1] * 4, method=curve_pb2.FitMethod(bootstrap_resamples=5000)),
            "method.bootstrap_resamples: must be <= 2000",
        ),
        (fit_request(_C4, [0.1] * 4, predict_compute=[1.0, math.nan]), "predict_compute[1]"),
    ],
)
def test_bad_fit_requests_are_invalid_argument(stub, request_, field) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Fit(request_, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)


def test_a_million_points_are_rejected_and_the_server_stays_up(stub) -> None:
    n = 1_000_000
    request = curve_pb2.FitRequest()
    request.points.extend([curve_pb2.CurvePoint(compute=1.0, reward=0.5)] * n)
    with pytest.raises(grpc.RpcError) as err:
        stub.Fit(request, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "points: 1000000 points; at most 100000 allowed"
    ok = stub.Fit(fit_request(COMPUTE, predict(TRUTH, COMPUTE), r0=0.1), timeout=TIMEOUT_S)
    assert ok.params.a == pytest.approx(0.8, rel=1e-6)


def test_runs_survive_a_restart_with_redis(redis_url: str, run_id: str) -> None:
    reward = predict(TRUTH, COMPUTE)
    first = CurveServicer(store=RedisRunStore(connect(redis_url)), metrics=CurveMetrics())
    server, port, _ = serve(port=0, servicer=first)
    with grpc_channel.channel(f"127.0.0.1:{port}") as ch:
        stub = curve_pb2_grpc.CurveServiceStub(ch)
        for c, r in zip(COMPUTE, reward, strict=True):
            point = curve_pb2.CurvePoint(compute=c, reward=r)
            stub.RecordPoint(curve_pb2.RecordPointRequest(run_id=run_id, point=point, r0=0.1))
    server.stop(None).wait()
    # A new service process state: only Redis remembers the run.
    second = CurveServicer(store=RedisRunStore(connect(redis_url)), metrics=CurveMetrics())
    server, port, _ = serve(port=0, servicer=second)
    try:
        with grpc_channel.channel(f"127.0.0.1:{port}") as ch:
            stub = curve_pb2_grpc.CurveServiceStub(ch)
            run = stub.GetRun(curve_pb2.GetRunRequest(run_id=run_id), timeout=TIMEOUT_S)
    finally:
        server.stop(None)
    assert [p.compute for p in run.points] == list(COMPUTE)
    assert run.fit.params.r0 == 0.1
    assert run.fit.params.a == pytest.approx(0.8, rel=1e-5)


def test_redis_store_rejects_conflicts_without_writing(redis_url: str, run_id: str) -> None:
    store = RedisRunStore(connect(redis_url))
    store.record(run_id, 1.0, 0.2, 0.1)
    assert store.record(run_id, 1.0, 0.2, None).revision == 1  # identical retry
    with pytest.raises(ValueError, match="^point.compute: "):
        store.record(run_id, 1.0, 0.3, None)
    snap = store.get(run_id)
    assert (snap.points, snap.r0, snap.revision) == (((1.0, 0.2),), 0.1, 1)


@pytest.fixture(params=["memory", "redis"])
def store(request) -> RunStore:
    """Each backend of `RunStore` (Redis: the tests' redis-server, a fresh run id per test)."""
    if request.param == "memory":
        return MemoryRunStore()
    return RedisRunStore(connect(request.getfixturevalue("redis_url")))


def _record(store: RunStore, run_id: str, computes, r0: float | None = 0.1) -> None:
    for c in computes:
        store.record(run_id, c, float(predict(TRUTH, [c])[0]), r0)


def test_trim_removes_exactly_the_points_above_the_bound(store: RunStore, run_id: str) -> None:
    _record(store, run_id, [1.0, 2.0, 4.0, 8.0, 16.0])
    snap = store.get(run_id)
    fit = fit_sigmoid([c for c, _ in snap.points], [r for _, r in snap.points], r0=0.1)
    assert store.set_fit(run_id, 5, fit) is True
    # Nothing above the bound: a no-op, same revision, the fit kept.
    series, removed = store.trim(run_id, 16.0)
    kept = series[""]
    assert (removed, kept.revision) == (0, 5) and kept.fit is fit
    assert kept.points == snap.points
    # A point at exactly max_compute stays.
    series, removed = store.trim(run_id, 4.0)
    trimmed = series[""]
    assert removed == 2
    assert [c for c, _ in trimmed.points] == [1.0, 2.0, 4.0]
    assert trimmed.points == snap.points[:3]
    assert (trimmed.r0, trimmed.revision, trimmed.fit) == (0.1, 6, None)
    got = store.get(run_id)
    assert (got.points, got.r0, got.revision, got.fit) == (snap.points[:3], 0.1, 6, None)
    assert store.trim(run_id, 5.0) == ({"": got}, 0)  # nothing above 5: no new revision
    # The resumed timeline may record a different reward at a trimmed compute.
    assert store.record(run_id, 8.0, 0.5, None).points[-1] == (8.0, 0.5)
    series, removed = store.trim(run_id, 0.0)
    emptied = series[""]
    assert (emptied.points, emptied.r0, emptied.revision, removed) == ((), 0.1, 8, 4)
    assert store.get(run_id) == emptied
    assert store.record(run_id, 1.0, 0.3, 0.1).revision == 9  # the run lives on, R0 kept


@pytest.mark.parametrize("bad", [-1.0, -0.5, math.nan, math.inf, -math.inf])
def test_trim_refuses_a_bad_max_compute_and_changes_nothing(
    store: RunStore, run_id: str, bad: float
) -> None:
    _record(store, run_id, [1.0, 2.0, 4.0])
    before = store.get(run_id)
    with pytest.raises(CurveInputError, match=r"^max_compute: must be finite and >= 0, got ") as e:
        store.trim(run_id, bad)
    assert e.value.field == "max_compute"
    after = store.get(run_id)
    assert (after.points, after.r0, after.revision) == (before.points, 0.1, 3)


def test_trim_of_an_unknown_run_or_a_bad_run_id(store: RunStore, run_id: str) -> None:
    with pytest.raises(UnknownRunError) as err:
        store.trim(run_id, 1.0)
    assert err.value.status == "NOT_FOUND" and err.value.run_id == run_id
    with pytest.raises(UnknownRunError):
        store.get(run_id)  # trimming created nothing
    with pytest.raises(CurveInputError, match=r"^run_id: "):
        store.trim("bad id!", 1.0)


def test_trim_and_concurrent_records_lose_nothing(store: RunStore, run_id: str) -> None:
    """Records below the bound racing repeated trims: every record lands, the points above
    the bound go, and exactly one trim makes a revision (the others find nothing above)."""
    _record(store, run_id, [float(c) for c in range(41, 61)])  # revisions 1..20
    below = [float(c) for c in range(1, 41)]
    trims: list[int] = []

    def record(chunk: list[float]) -> None:
        _record(store, run_id, chunk, r0=None)

    def trim() -> None:
        for _ in range(30):
            trims.append(store.trim(run_id, 40.0)[1])

    threads = [threading.Thread(target=record, args=(below[i::4],)) for i in range(4)]
    threads.append(threading.Thread(target=trim))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = store.get(run_id)
    assert [c for c, _ in snap.points] == below
    assert [r for _, r in snap.points] == [float(predict(TRUTH, [c])[0]) for c in below]
    assert sum(trims) == 20 and sum(1 for n in trims if n) == 1
    assert (snap.r0, snap.revision) == (0.1, 20 + 40 + 1)


def _csv(path: Path, compute, reward) -> Path:
    rows = ["step,compute,reward"] + [
        f"{i},{float(c)!r},{float(r)!r}"
        for i, (c, r) in enumerate(zip(compute, reward, strict=True))
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_cli_fit_json(tmp_path: Path, capsys, monkeypatch) -> None:
    def no_server(*args, **kwargs):
        raise AssertionError("scalerl curve fit started a gRPC server")

    # Without --server the CLI calls the servicer in this process: no server, no port.
    monkeypatch.setattr("scalerl.rpc.server.make_server", no_server)
    monkeypatch.setattr("scalerl.rpc.services.make_server", no_server)
    points = _csv(tmp_path / "p.csv", COMPUTE, predict(TRUTH, COMPUTE))
    argv = ["curve", "fit", str(points), "--r0", "0.1", "--predict", "100,1e4", "--json"]
    assert cli.main([*argv, "--plot", str(tmp_path / "p.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == set(FIT_KEYS)  # the one dict form of a fit (FitSummary.to_dict)
    assert (out["A"], out["B"], out["C_mid"], out["R0"]) == pytest.approx((0.8, 1.5, 100, 0.1))
    assert (out["interval_level"], out["interval_resamples"]) == (0.9, 200)  # CLI default
    assert out["A_interval"][0] <= out["A"] <= out["A_interval"][1]
    assert len(out["predictions"]) == 2  # the plot's curve samples are not reported
    # At C = C_mid the reward is half way: (0.8 + 0.1) / 2 = 0.45.
    first = out["predictions"][0]
    assert set(first) == {"compute", "reward", "lower", "upper"}
    assert (first["compute"], first["reward"]) == pytest.approx((100.0, 0.45))
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("rows", "args", "message"),
    [
        ("compute,reward\n1,0.1\n2,abc\n", [], "line 3: reward: not a number: 'abc'"),
        ("compute,reward\n1,0.1\n2,0.2\n3,0.3\n-4,0.4\n", [], "line 5: compute: must be > 0"),
        ("compute,score\n1,0.1\n", [], "column 'reward' missing"),
        ("compute,reward\n1,0.1\n2,0.2\n", [], "points: 2 points"),
        ("compute,reward\n1,0.1\n2,0.2\n3,0.3\n4,0.4\n", ["--r0", "3"], "--r0: must be"),
        ("compute,reward\n1,0.1\n2,0.2\n3,0.3\n4,0.4\n", ["--band", "x"], "--band: must be"),
        ("compute,reward\n1,0.1\n2,0.2\n3,0.3\n4,0.4\n", ["--seed-sd", "1"], "--seed-sd: "),
    ],
)
def test_cli_bad_input_names_the_field_and_exits_2(tmp_path, capsys, rows, args, message) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(rows)
    assert cli.main(["curve", "fit", str(path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_cli_compare_against_a_server(address: str, tmp_path: Path, capsys) -> None:
    a = _csv(tmp_path / "a.csv", COMPUTE, predict(SigmoidParams(0.7, 3.0, 100.0, 0.1), COMPUTE))
    b = _csv(tmp_path / "b.csv", COMPUTE, predict(TRUTH, COMPUTE))
    argv = ["curve", "compare", str(a), str(b), "--r0", "0.1", "--json", "--server", address]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["best"], out["decided_by"], out["shared_A"]) == (str(b), "A", None)
