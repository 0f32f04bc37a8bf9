"""Per-point standard errors end to end: the store backends keep them (memory and Redis
pass the same tests), the RPCs fit by them and return them, `CurveClient` sends them, the
learner records its evaluations' ones and `scalerl curve fit` reads them from a CSV."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from curve_stub import fit_request

from curve_service.errors import CurveInputError, UnknownRunError
from curve_service.fit import fit_sigmoid
from curve_service.noise import binomial_stderr
from curve_service.redis_store import RedisRunStore
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.store import MemoryRunStore, RunSnapshot, RunStore
from learner_service.evaluation.reporter import EvalReporter
from learner_service.progress import RunProgress
from scalerl.rpc.clients.curve import ZERO_COMPUTE, CurveClient
from scalerl.rpc.errors import InvalidArgument
from scalerl.run_folder import EvalRecord, append_record
from scalerl.state.client import connect
from scalerl.state.keys import RunKeys, run_key
from scalerl.v1 import curve_pb2
from scalerl_cli import main as cli

pytestmark = pytest.mark.integration
TIMEOUT_S = 30.0
TRUTH = SigmoidParams(a=0.8, b=1.5, c_mid=100.0, r0=0.1)
COMPUTE = np.geomspace(1.0, 2000.0, 12)
# 0.36 x 0.64 / (10 prompts x 10 samples) = 0.002304 = 0.048^2.
BINOMIAL = 0.048


def _reward(c: float) -> float:
    return float(predict(TRUTH, [c])[0])


# --- the store backends ---------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
def store(request) -> RunStore:
    """Each backend of `RunStore` (Redis: the tests' redis-server, a fresh run id per test)."""
    if request.param == "memory":
        return MemoryRunStore()
    return RedisRunStore(connect(request.getfixturevalue("redis_url")))


def test_a_snapshot_carries_one_stderr_per_point() -> None:
    points = ((1.0, 0.2), (2.0, 0.3))
    assert RunSnapshot("r", points, None, 2).stderr == (0.0, 0.0)  # unknown
    assert RunSnapshot("r", (), None, 0).stderr == ()
    assert RunSnapshot("r", points, None, 2, stderr=(0.01, 0.0)).known_stderr == (0.01, 0.0)
    assert RunSnapshot("r", points, None, 2).known_stderr is None  # the unweighted fit
    with pytest.raises(ValueError, match="^1 standard errors for 2 points$"):
        RunSnapshot("r", points, None, 2, stderr=(0.01,))


def test_stderr_round_trips_aligned_after_out_of_order_records_and_trim(
    store: RunStore, run_id: str
) -> None:
    for c, se in ((4.0, 0.04), (1.0, 0.01), (8.0, 0.0), (2.0, 0.02)):
        store.record(run_id, c, _reward(c), 0.1, stderr=se)
    snap = store.get(run_id)
    assert [c for c, _ in snap.points] == [1.0, 2.0, 4.0, 8.0]
    assert snap.stderr == (0.01, 0.02, 0.04, 0.0)
    assert snap.revision == 4
    if isinstance(store, RedisRunStore):  # what another replica (or a restart) reads
        again = RedisRunStore(store._redis).get(run_id)
        assert (again.points, again.stderr) == (snap.points, snap.stderr)
    series, removed = store.trim(run_id, 2.0)
    assert removed == 2 and series[""].stderr == (0.01, 0.02)
    got = store.get(run_id)
    assert (got.points, got.stderr, got.revision) == (snap.points[:2], (0.01, 0.02), 5)
    # A point recorded again above the bound starts without the trimmed one's stderr.
    store.record(run_id, 4.0, _reward(4.0), None)
    assert store.get(run_id).stderr == (0.01, 0.02, 0.0)
    series, _ = store.trim(run_id, 0.0)
    assert (series[""].points, series[""].stderr) == ((), ())


def test_retries_fill_an_unknown_stderr_and_refuse_a_different_one(
    store: RunStore, run_id: str
) -> None:
    store.record(run_id, 1.0, 0.2, 0.1, stderr=0.01)
    store.record(run_id, 2.0, 0.3, None)  # unknown
    # An identical retry without a stderr is a no-op, and forgets nothing.
    same = store.record(run_id, 1.0, 0.2, None)
    assert (same.stderr, same.revision) == ((0.01, 0.0), 2)
    assert store.record(run_id, 1.0, 0.2, None, stderr=0.01).revision == 2
    # A retry that brings the unknown stderr stores it: a new revision.
    filled = store.record(run_id, 2.0, 0.3, None, stderr=0.03)
    assert (filled.points, filled.stderr, filled.revision) == (
        ((1.0, 0.2), (2.0, 0.3)),
        (0.01, 0.03),
        3,
    )
    assert store.get(run_id).stderr == (0.01, 0.03)
    with pytest.raises(CurveInputError) as err:
        store.record(run_id, 2.0, 0.3, None, stderr=0.05)
    assert err.value.field == "point.stderr"
    assert err.value.message == (
        f"run {run_id!r} already has compute=2 with stderr 0.03; got stderr 0.05"
    )
    # A different reward is still the point's conflict, whatever its stderr.
    with pytest.raises(CurveInputError, match=r"^point.compute: "):
        store.record(run_id, 2.0, 0.4, None, stderr=0.03)
    got = store.get(run_id)
    assert (got.points, got.stderr, got.revision) == (filled.points, (0.01, 0.03), 3)


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, 1.5])
def test_a_bad_stderr_is_refused_and_changes_nothing(
    store: RunStore, run_id: str, bad: float
) -> None:
    store.record(run_id, 1.0, 0.2, 0.1, stderr=0.01)
    for c in (1.0, 2.0):  # a retry of a recorded point and a new point
        with pytest.raises(CurveInputError) as err:
            store.record(run_id, c, 0.2, None, stderr=bad)
        assert err.value.field == "point.stderr"
        assert err.value.message == f"must be finite in [0, 1], got {bad}"
    got = store.get(run_id)
    assert (got.points, got.stderr, got.revision) == (((1.0, 0.2),), (0.01,), 1)
    with pytest.raises(CurveInputError, match=r"^point.stderr: "):
        store.record(f"{run_id}-new", 1.0, 0.2, None, stderr=bad)
    with pytest.raises(UnknownRunError):
        store.get(f"{run_id}-new")  # the refused first point made no run


def test_redis_keeps_stderr_in_its_own_hash_and_old_series_load_unknown(
    redis_url: str, run_id: str
) -> None:
    client = connect(redis_url)
    keys = RunKeys(run_id)
    # A run as the curve service wrote it before points had a standard error.
    client.hset(keys.curve_points, mapping={repr(1.0): repr(0.2), repr(2.0): repr(0.3)})
    client.hset(keys.curve_meta, mapping={"r0": repr(0.1), "revision": 2})
    store = RedisRunStore(client)
    old = store.get(run_id)
    assert (old.points, old.stderr, old.revision) == (((1.0, 0.2), (2.0, 0.3)), (0.0, 0.0), 2)
    assert client.exists(keys.curve_stderr) == 0
    # Re-recorded with its stderr (a resumed learner), one point gains it; the rest stays.
    assert store.record(run_id, 2.0, 0.3, None, stderr=0.02).stderr == (0.0, 0.02)
    store.record(run_id, 4.0, 0.35, None, stderr=0.025)
    store.record(run_id, 8.0, 0.4, None)  # unknown: no field
    assert keys.curve_stderr == run_key(run_id, "curve", "stderr")
    assert client.hgetall(keys.curve_stderr) == {b"2.0": b"0.02", b"4.0": b"0.025"}
    store.trim(run_id, 2.0)
    assert client.hgetall(keys.curve_stderr) == {b"2.0": b"0.02"}
    assert client.hgetall(keys.curve_points) == {b"1.0": b"0.2", b"2.0": b"0.3"}
    # A task's stderr hash sits beside its points hash.
    store.record(run_id, 1.0, 0.5, 0.4, "math", stderr=0.015)
    task_key = run_key(run_id, "curve", "task", "math", "stderr")
    assert client.hgetall(task_key) == {b"1.0": b"0.015"}
    assert store.get(run_id, "math").stderr == (0.015,)
    assert store.get(run_id).stderr == (0.0, 0.02)


# --- the RPCs ---------------------------------------------------------------------------


def _noisy() -> np.ndarray:
    return predict(TRUTH, COMPUTE) + np.random.default_rng(3).normal(0.0, 0.005, COMPUTE.size)


def _params(reply: curve_pb2.FitResponse) -> tuple[float, float, float]:
    return reply.params.a, reply.params.b, reply.params.c_mid


def test_fit_with_stderr_is_the_weighted_core_fit(stub) -> None:
    reward = _noisy()
    stderr = np.linspace(0.005, 0.03, COMPUTE.size)
    reply = stub.Fit(fit_request(COMPUTE, reward, stderr, r0=0.1), timeout=TIMEOUT_S)
    weighted = fit_sigmoid(COMPUTE, reward, r0=0.1, stderr=stderr)
    assert _params(reply) == (weighted.a, weighted.b, weighted.c_mid)
    plain = fit_sigmoid(COMPUTE, reward, r0=0.1)
    assert (weighted.a, weighted.b) != (plain.a, plain.b)  # the weights did something
    unweighted = stub.Fit(fit_request(COMPUTE, reward, r0=0.1), timeout=TIMEOUT_S)
    assert _params(unweighted) == (plain.a, plain.b, plain.c_mid)


def test_prompt_and_sample_counts_give_the_binomial_stderr(stub) -> None:
    assert binomial_stderr(0.36, 10, 10) == pytest.approx(BINOMIAL, abs=1e-15)
    reward = _noisy()
    request = fit_request(COMPUTE, reward, r0=0.1)
    stderr = []
    for i, point in enumerate(request.points):
        if i % 3 == 0:
            point.stderr = 0.01  # given: the counts are not used
            point.prompts, point.samples = 10, 10
        elif i % 3 == 1:
            point.prompts, point.samples = 64, 4
        elif i == 2:
            point.prompts = 64  # no samples: unknown
        stderr.append(point.stderr or binomial_stderr(point.reward, point.prompts, point.samples))
    assert stderr[:3] == [0.01, math.sqrt(reward[1] * (1 - reward[1]) / 256), 0.0]
    fit = fit_sigmoid(COMPUTE, reward, r0=0.1, stderr=stderr)
    assert _params(stub.Fit(request, timeout=TIMEOUT_S)) == (fit.a, fit.b, fit.c_mid)


def test_a_noisy_outlier_with_a_large_stderr_barely_moves_the_fit(stub) -> None:
    """The last point reads 0.1 low; with its stderr of 0.2 (the others' 0.005) the
    weighted fit keeps A within 0.01 of the truth, the unweighted one is pulled off."""
    reward = _noisy()
    reward[-1] -= 0.1
    stderr = np.full(COMPUTE.size, 0.005)
    stderr[-1] = 0.2
    weighted = stub.Fit(fit_request(COMPUTE, reward, stderr, r0=0.1), timeout=TIMEOUT_S)
    unweighted = stub.Fit(fit_request(COMPUTE, reward, r0=0.1), timeout=TIMEOUT_S)
    assert abs(weighted.params.a - TRUTH.a) <= 0.01
    assert abs(unweighted.params.a - TRUTH.a) > 0.03


def _invalid(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value


@pytest.mark.parametrize(("bad", "text"), [(-0.1, "-0.1"), (math.nan, "nan"), (1.5, "1.5")])
def test_a_bad_point_stderr_is_invalid_argument_naming_the_point(stub, bad, text) -> None:
    stderr = [0.01] * COMPUTE.size
    stderr[2] = bad
    request = fit_request(COMPUTE, _noisy(), stderr, r0=0.1)
    err = _invalid(stub.Fit, request)
    assert err.details() == f"points[2].stderr: must be finite in [0, 1], got {text}"
    compare = curve_pb2.CompareRunsRequest(runs=[fit_request(COMPUTE, _noisy()), request])
    err = _invalid(stub.CompareRuns, compare)
    assert err.details() == f"runs[1].points[2].stderr: must be finite in [0, 1], got {text}"


def _record(stub, run_id: str, point: curve_pb2.CurvePoint) -> curve_pb2.RecordPointResponse:
    request = curve_pb2.RecordPointRequest(run_id=run_id, point=point, r0=0.1)
    return stub.RecordPoint(request, timeout=TIMEOUT_S)


def test_record_point_keeps_the_stderr_and_get_run_returns_it(stub, run_id: str) -> None:
    reward = _noisy()
    stderr = [0.01 + 0.001 * i for i in range(COMPUTE.size)]
    for i in (5, 0, 11, 3, 1, 2, 4, 6, 7, 8, 9):
        _record(stub, run_id, curve_pb2.CurvePoint(compute=COMPUTE[i], reward=reward[i]))
        # The retry with its stderr: the learner re-recording on resume.
        _record(
            stub,
            run_id,
            curve_pb2.CurvePoint(compute=COMPUTE[i], reward=reward[i], stderr=stderr[i]),
        )
    # The 11th point by its counts: the service keeps the binomial stderr they give.
    counts = curve_pb2.CurvePoint(compute=COMPUTE[10], reward=0.36, prompts=10, samples=10)
    reply = _record(stub, run_id, counts)
    reward[10], stderr[10] = 0.36, BINOMIAL
    run = stub.GetRun(curve_pb2.GetRunRequest(run_id=run_id), timeout=TIMEOUT_S)
    assert [p.compute for p in run.points] == list(COMPUTE)
    assert [p.reward for p in run.points] == list(reward)
    got = [p.stderr for p in run.points]
    assert got[:10] + got[11:] == stderr[:10] + stderr[11:]
    assert got[10] == pytest.approx(BINOMIAL, abs=1e-15)
    assert [(p.prompts, p.samples) for p in run.points] == [(0, 0)] * COMPUTE.size
    # The series' fit is weighted by them: the same as the Fit of its points.
    fit = fit_sigmoid(COMPUTE, reward, r0=0.1, stderr=[p.stderr for p in run.points])
    assert _params(run.fit) == _params(reply.fit) == (fit.a, fit.b, fit.c_mid)
    fitted = stub.Fit(curve_pb2.FitRequest(run_id=run_id), timeout=TIMEOUT_S)
    assert _params(fitted) == (fit.a, fit.b, fit.c_mid)


def test_record_point_refuses_a_bad_or_conflicting_stderr(stub, run_id: str) -> None:
    point = curve_pb2.CurvePoint(compute=1.0, reward=0.2, stderr=2.0)
    err = _invalid(stub.RecordPoint, curve_pb2.RecordPointRequest(run_id=run_id, point=point))
    assert err.details() == "point.stderr: must be finite in [0, 1], got 2.0"
    with pytest.raises(grpc.RpcError) as missing:
        stub.GetRun(curve_pb2.GetRunRequest(run_id=run_id), timeout=TIMEOUT_S)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND  # nothing was recorded
    _record(stub, run_id, curve_pb2.CurvePoint(compute=1.0, reward=0.2, stderr=0.01))
    point.stderr = 0.02
    err = _invalid(stub.RecordPoint, curve_pb2.RecordPointRequest(run_id=run_id, point=point))
    assert err.details() == (
        f"point.stderr: run {run_id!r} already has compute=1 with stderr 0.01; got stderr 0.02"
    )


# --- CurveClient and the learner ------------------------------------------------------------


@pytest.fixture
def client(address: str) -> Iterator[CurveClient]:
    with CurveClient(address, timeout_s=TIMEOUT_S) as c:
        yield c


def test_client_records_and_reads_stderr(client: CurveClient, run_id: str) -> None:
    client.record_point(run_id, 1.0, 0.2, r0=0.1, stderr=0.01)
    client.record_point(run_id, 2.0, 0.36, prompts=10, samples=10)
    client.record_point(run_id, 4.0, 0.4)
    run = client.get_run(run_id)
    assert run.points == ((1.0, 0.2), (2.0, 0.36), (4.0, 0.4))
    assert run.stderr == pytest.approx((0.01, BINOMIAL, 0.0), abs=1e-15)
    with pytest.raises(InvalidArgument) as err:
        client.record_point(run_id, 8.0, 0.5, stderr=-0.5)
    assert (err.value.field, err.value.message) == (
        "point.stderr",
        "must be finite in [0, 1], got -0.5",
    )


def _eval(compute: float, pass_rate: float, stderr: float | None, task: str = "") -> EvalRecord:
    return EvalRecord(
        step=int(compute * 10) - 1,  # the first, at compute 0.1, is step 0 (R0)
        policy_version=int(compute * 10),
        compute=compute,
        task=task,
        pass_rate=pass_rate,
        stderr=stderr,
        parse_failure_rate=0.0,
        completions=64,
        mean_tokens=20.0,
        truncation_rate=0.0,
        seconds=1.0,
        learner_steps_meanwhile=0,
        time=0.0,
    )


def test_the_learner_sends_each_evaluations_stderr(
    address: str, client: CurveClient, run_id: str, tmp_path: Path
) -> None:
    reporter = EvalReporter(tmp_path, run_id, address)
    records = [
        _eval(0.0, 0.1, 0.05),  # step 0: at ZERO_COMPUTE
        _eval(0.1, 0.3, 0.04),
        _eval(0.2, 0.4, None),  # a record without one: unknown
        _eval(0.4, 0.5, 0.03),
        _eval(0.1, 0.6, 0.02, task="math"),
    ]
    for record in records:
        reporter.record_point(record, r0=0.1)
    run = client.get_run(run_id)
    assert [c for c, _ in run.points] == [ZERO_COMPUTE, 0.1, 0.2, 0.4]
    assert run.stderr == (0.05, 0.04, 0.0, 0.03)
    assert client.get_run(run_id, "math").stderr == (0.02,)


def test_the_resumed_learner_re_records_its_points_with_their_stderr(
    address: str, client: CurveClient, run_id: str, tmp_path: Path
) -> None:
    """A curve service holding the run's points without standard errors (recorded before
    points had one), and one the crash discarded: the resume trims that one and fills in
    the kept ones' stderr."""
    for c, r in ((0.1, 0.3), (0.2, 0.4), (0.4, 0.5), (0.8, 0.55)):
        client.record_point(run_id, c, r, r0=0.3)
    kept = [_eval(0.1, 0.3, 0.04), _eval(0.2, 0.4, 0.035), _eval(0.4, 0.5, None)]
    for record in kept:
        append_record(tmp_path, record)
    progress = RunProgress()
    EvalReporter(tmp_path, run_id, address).restore(progress)
    run = client.get_run(run_id)
    assert run.points == ((0.1, 0.3), (0.2, 0.4), (0.4, 0.5))
    assert run.stderr == (0.04, 0.035, 0.0)
    assert progress.r0 == 0.3  # the kept step-0 evaluation is the run's R0 again


# --- scalerl curve fit ------------------------------------------------------------------------


def _csv(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(["compute,reward,stderr", *rows]) + "\n")
    return path


def test_cli_fit_of_a_stderr_column_is_the_fit_rpc_with_those_stderr(
    address: str, stub, tmp_path: Path, capsys
) -> None:
    reward = _noisy()
    reward[-1] -= 0.1
    stderr = [0.005] * (COMPUTE.size - 1) + [0.2]
    cells = [repr(s) for s in stderr]
    cells[3] = ""  # an empty cell: unknown
    rows = [
        f"{float(c)!r},{float(r)!r},{s}" for c, r, s in zip(COMPUTE, reward, cells, strict=True)
    ]
    path = _csv(tmp_path / "p.csv", rows)
    argv = ["curve", "fit", str(path), "--r0", "0.1", "--bootstrap", "0", "--json"]
    assert cli.main([*argv, "--server", address]) == 0
    out = json.loads(capsys.readouterr().out)
    stderr[3] = 0.0
    reply = stub.Fit(fit_request(COMPUTE, reward, stderr, r0=0.1), timeout=TIMEOUT_S)
    assert (out["A"], out["B"], out["C_mid"]) == _params(reply)
    assert abs(out["A"] - TRUTH.a) <= 0.01  # the outlier's stderr kept it from pulling A


@pytest.mark.parametrize(
    ("stderr_cell", "message"),
    [
        ("abc", "line 4: stderr: not a number: 'abc'"),
        ("-0.1", "line 4: stderr: must be finite in [0, 1], got -0.1"),
        ("nan", "line 4: stderr: must be finite in [0, 1], got nan"),
    ],
)
def test_cli_bad_stderr_cell_exits_2_with_one_line(
    tmp_path: Path, capsys, stderr_cell: str, message: str
) -> None:
    cells = ["0.01", "", stderr_cell, "0.01"]
    rows = [f"{c},{0.1 * c},{s}" for c, s in zip((1, 2, 3, 4), cells, strict=True)]
    path = _csv(tmp_path / "bad.csv", rows)
    assert cli.main(["curve", "fit", str(path), "--bootstrap", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"scalerl curve: {path} {message}"]
