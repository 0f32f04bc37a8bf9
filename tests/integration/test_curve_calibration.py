"""The curve service's prediction ledger end to end: the service predicts at every refit of
a recorded series, later points grade the predictions, `Calibration` aggregates them, the
grades survive a restart with Redis, a trim takes back what it removes, and bad requests
name their field (`scalerl curve calibration` too)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import grpc
import numpy as np
import pytest
from curve_stub import eval_record

from curve_service.ledger import LEDGER_HORIZONS, Prediction
from curve_service.metrics import CurveMetrics
from curve_service.redis_store import RedisRunStore
from curve_service.server import CurveServicer, serve
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.store import MemoryRunStore, RunStore
from scalerl.rpc import channel as grpc_channel
from scalerl.run_folder import append_record
from scalerl.state.client import connect
from scalerl.v1 import curve_pb2, curve_pb2_grpc
from scalerl_cli import main as cli

pytestmark = pytest.mark.integration
TIMEOUT_S = 30.0
TRUTH = SigmoidParams(a=0.8, b=1.5, c_mid=4.0, r0=0.1)


def record(servicer: CurveServicer, run_id: str, compute: float, reward: float, task: str = ""):
    point = curve_pb2.CurvePoint(compute=compute, reward=reward, stderr=0.02)
    request = curve_pb2.RecordPointRequest(run_id=run_id, point=point, task=task)
    return servicer.RecordPoint(request, None)


def truth(compute: float) -> float:
    return float(predict(TRUTH, np.array([compute]))[0])


def hand(made_at: float, target: float, value: float, half: float) -> Prediction:
    return Prediction("", made_at, target, value, value - half, value + half, 0.9, "sigmoid")


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> RunStore:
    if request.param == "memory":
        return MemoryRunStore()
    return RedisRunStore(connect(request.getfixturevalue("redis_url")))


def test_calibration_returns_the_hand_computed_coverage_and_mae(
    store: RunStore, run_id: str
) -> None:
    servicer = CurveServicer(store=store, metrics=CurveMetrics())
    for compute, reward in [(1.0, 0.30), (2.0, 0.50)]:
        record(servicer, run_id, compute, reward)
    store.add_predictions(
        run_id,
        [
            hand(1.0, 1.8, 0.45, 0.10),  # graded at 2.0 by 0.50: covered, |error| 0.05
            hand(2.0, 3.0, 0.70, 0.05),  # graded at 3.0 by 0.60: missed, 0.10
            hand(2.0, 5.0, 0.66, 0.02),  # at 6.0 (1.2x its target) by 0.70: missed, 0.04
            hand(2.0, 4.0, 0.60, 0.20),  # the first point past 4 is 6.0, 1.5x: not graded
            hand(2.0, 20.0, 0.75, 0.10),  # not reached
        ],
    )
    for compute, reward in [(3.0, 0.60), (6.0, 0.70)]:
        record(servicer, run_id, compute, reward)
    request = curve_pb2.CalibrationRequest(run_ids=[run_id], horizons=[1, 2, math.inf])
    reply = servicer.Calibration(request, None)
    # The service's own predictions came from its one refit, at 4 points (made at 6.0):
    # none is reached yet.
    assert (reply.graded, reply.pending) == (3, 2 + len(LEDGER_HORIZONS))
    near, far = reply.rows
    assert (near.horizon_low, near.horizon_high, near.graded) == (1.0, 2.0, 2)
    assert near.coverage == 0.5
    assert near.mae == pytest.approx((0.05 + 0.10) / 2)
    assert near.mean_width == pytest.approx((0.20 + 0.10) / 2)
    assert near.bias == pytest.approx((-0.05 + 0.10) / 2)  # predicted - actual
    assert near.method == far.method == "sigmoid"
    assert (far.horizon_low, far.graded, far.coverage) == (2.0, 1, 0.0)
    assert far.mae == pytest.approx(0.04)
    (overall,) = reply.overall
    assert (overall.level, overall.graded) == (0.9, 3)
    assert overall.coverage == pytest.approx(1 / 3)
    assert overall.mae == pytest.approx((0.05 + 0.10 + 0.04) / 3)


def test_the_service_predicts_at_every_refit_and_later_points_grade_it(run_id: str) -> None:
    metrics = CurveMetrics()
    servicer = CurveServicer(metrics=metrics)
    for compute in range(1, 9):
        record(servicer, run_id, float(compute), truth(compute))
    ledger = servicer.store.predictions(run_id)
    # One refit per point from the 4th on, each at 1.5x, 2x and 4x its largest compute.
    made = sorted((p.made_at, p.target) for p in ledger)
    assert made == [(m, h * m) for m in (4.0, 5.0, 6.0, 7.0, 8.0) for h in LEDGER_HORIZONS]
    for p in ledger:
        assert (p.level, p.method, p.task) == (0.9, "sigmoid", "")
        assert p.lower <= p.value <= p.upper
    reply = servicer.Calibration(curve_pb2.CalibrationRequest(), None)
    # Graded: 4 -> 6 (at 6), 4 -> 8 (at 8) and 5 -> 7.5 (at 8, within 1.25x of 7.5).
    by_key = {(p.made_at, p.target): p for p in ledger}
    graded = [(by_key[(4.0, 6.0)], truth(6)), (by_key[(4.0, 8.0)], truth(8))]
    graded.append((by_key[(5.0, 7.5)], truth(8)))
    assert (reply.graded, reply.pending) == (3, 12)
    (overall,) = reply.overall
    covered = [p.lower <= actual <= p.upper for p, actual in graded]
    assert overall.coverage == pytest.approx(sum(covered) / 3)
    assert overall.mae == pytest.approx(sum(abs(p.value - a) for p, a in graded) / 3)
    exposition = metrics.registry.get_sample_value
    labels = {"run_id": run_id, "task": ""}
    assert exposition("scalerl_curve_graded_predictions", labels) == 3
    coverage = exposition("scalerl_curve_realized_coverage", {**labels, "level": "0.9"})
    assert coverage == pytest.approx(sum(covered) / 3)


def test_a_retried_point_stores_its_predictions_once(run_id: str) -> None:
    servicer = CurveServicer(metrics=CurveMetrics())
    for compute in range(1, 6):
        record(servicer, run_id, float(compute), truth(compute))
    before = sorted(p.key for p in servicer.store.predictions(run_id))
    record(servicer, run_id, 5.0, truth(5))  # the learner's retry after a lost reply
    assert sorted(p.key for p in servicer.store.predictions(run_id)) == before
    assert len(before) == 2 * len(LEDGER_HORIZONS)


def test_grades_survive_a_restart_with_redis(redis_url: str, run_id: str) -> None:
    first = CurveServicer(store=RedisRunStore(connect(redis_url)), metrics=CurveMetrics())
    for compute in range(1, 9):
        record(first, run_id, float(compute), truth(compute))
    request = curve_pb2.CalibrationRequest(run_ids=[run_id])
    before = first.Calibration(request, None)
    # A new service process: only Redis remembers the run, its points and its ledger.
    second = CurveServicer(store=RedisRunStore(connect(redis_url)), metrics=CurveMetrics())
    after = second.Calibration(request, None)
    assert after == before and after.graded == 3


def test_a_trim_takes_back_the_predictions_made_from_the_points_it_removes(
    store: RunStore, run_id: str
) -> None:
    servicer = CurveServicer(store=store, metrics=CurveMetrics())
    for compute in range(1, 9):
        record(servicer, run_id, float(compute), truth(compute))
    servicer.TrimRun(curve_pb2.TrimRunRequest(run_id=run_id, max_compute=5.0), None)
    assert sorted({p.made_at for p in store.predictions(run_id)}) == [4.0, 5.0]
    reply = servicer.Calibration(curve_pb2.CalibrationRequest(run_ids=[run_id]), None)
    # The points at 6..8 that graded them are gone too: nothing is graded.
    assert (reply.graded, reply.pending) == (0, 6)


def test_the_ledger_is_capped_per_run(run_id: str) -> None:
    metrics = CurveMetrics()
    servicer = CurveServicer(store=MemoryRunStore(max_predictions=4), metrics=metrics)
    for compute in range(1, 7):
        record(servicer, run_id, float(compute), truth(compute))
    assert len(servicer.store.predictions(run_id)) == 4
    # Refits at 4, 5 and 6 made 9 predictions: the 5 past the cap were counted, not stored.
    assert metrics.registry.get_sample_value("scalerl_curve_ledger_dropped_total") == 5


def test_each_series_has_its_own_ledger(run_id: str) -> None:
    servicer = CurveServicer(metrics=CurveMetrics())
    for compute in range(1, 9):
        record(servicer, run_id, float(compute), truth(compute), task="math")
        record(servicer, run_id, float(compute), truth(compute) / 2, task="code")
    math_only = curve_pb2.CalibrationRequest(run_ids=[run_id], task="math")
    both = curve_pb2.CalibrationRequest(run_ids=[run_id])
    assert servicer.Calibration(math_only, None).graded == 3
    assert servicer.Calibration(both, None).graded == 6
    none = curve_pb2.CalibrationRequest(run_ids=[run_id], task="")
    assert servicer.Calibration(none, None).graded == 0


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (curve_pb2.CalibrationRequest(run_ids=["never-recorded"]), "run_ids[0]"),
        (curve_pb2.CalibrationRequest(run_ids=["a b"]), "run_ids[0]"),
        (curve_pb2.CalibrationRequest(horizons=[0.0, 2.0]), "horizons[0]"),
        (curve_pb2.CalibrationRequest(horizons=[-1.0, 2.0]), "horizons[0]"),
        (curve_pb2.CalibrationRequest(horizons=[2.0, 1.5]), "horizons[1]"),
        (curve_pb2.CalibrationRequest(horizons=[2.0]), "horizons"),
        (curve_pb2.CalibrationRequest(task="Not A Task"), "task"),
    ],
)
def test_bad_calibration_requests_are_invalid_argument(stub, request_, field) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Calibration(request_, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: ")


def test_calibration_is_open_to_anyone_recording_is_not(run_id: str) -> None:
    from scalerl.rpc.security import Security

    servicer = CurveServicer(metrics=CurveMetrics())
    for compute in range(1, 9):
        record(servicer, run_id, float(compute), truth(compute))
    server, port, _ = serve(port=0, servicer=servicer, security=Security(token="secret"))
    try:
        with grpc_channel.channel(f"127.0.0.1:{port}") as ch:
            stub = curve_pb2_grpc.CurveServiceStub(ch)
            reply = stub.Calibration(curve_pb2.CalibrationRequest(), timeout=TIMEOUT_S)
            point = curve_pb2.CurvePoint(compute=9.0, reward=0.0)
            with pytest.raises(grpc.RpcError) as err:
                stub.RecordPoint(curve_pb2.RecordPointRequest(run_id=run_id, point=point))
    finally:
        server.stop(None)
    assert reply.graded == 3
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _run_folder(path: Path, rewards: list[float]) -> Path:
    path.mkdir()
    for step, reward in enumerate(rewards):
        for task in ("addition", ""):
            record_ = eval_record(step, float(step), reward, task)
            append_record(path, record_)
    return path


def test_cli_grades_run_folders(tmp_path: Path, capsys) -> None:
    runs = [
        _run_folder(tmp_path / name, [truth(max(c, 1e-9)) for c in range(9)])
        for name in ("one", "two")
    ]
    assert cli.main([*("curve", "calibration"), *map(str, runs), "--task", "", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # Each run: steps 0..8 at compute 0..8 (0 recorded at 1e-9), R0 its step-0 evaluation.
    # Refits from the 4th point, made at 3..8; graded: 3 -> 4.5 (by 5), 3 -> 6, 4 -> 6,
    # 4 -> 8 and 5 -> 7.5 (by 8): 5 per series.
    assert report["run_ids"] == ["one", "two"] and report["graded"] == 10
    assert cli.main(["curve", "calibration", *map(str, runs)]) == 0  # with the task series
    assert capsys.readouterr().out.startswith("20 predictions graded")
    # A sweep's seed folders share their names: each is named by its path below the rest.
    (tmp_path / "lr-1").mkdir()
    (tmp_path / "lr-3").mkdir()
    seeds = [_run_folder(tmp_path / lr / "seed-0", [0.1, 0.2]) for lr in ("lr-1", "lr-3")]
    assert cli.main(["curve", "calibration", *map(str, seeds), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_ids"] == ["lr-1-seed-0", "lr-3-seed-0"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--horizons", "0,2"], "--horizons value 1: must be >= 1"),
        (["--horizons", "x"], "--horizons: not a number: 'x'"),
        (["--run", "r1"], "--run: picks runs of --server"),
        ([], "runs: give run folders to grade, or --server"),
    ],
)
def test_cli_bad_calibration_input_exits_2(tmp_path: Path, capsys, args, message) -> None:
    folders = [] if not args or args[0] == "--run" else [str(_run_folder(tmp_path / "r", [0.1]))]
    assert cli.main(["curve", "calibration", *folders, *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_calibration_of_a_server_names_an_unknown_run(address: str, capsys) -> None:
    assert cli.main(["curve", "calibration", "--server", address, "--run", "nobody"]) == 2
    assert "--run nobody: no run named 'nobody' was recorded" in capsys.readouterr().err
