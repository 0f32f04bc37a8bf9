"""One curve series per task of a run: the store backends (memory and Redis pass the same
tests), the RPCs that name a series (RecordPoint, GetRun, Fit, Extrapolate, TrimRun) and
`CurveClient`'s calls for them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from curve_service.errors import (
    CurveInputError,
    StoreFullError,
    UnknownRunError,
    UnknownTaskError,
)
from curve_service.fit import fit_sigmoid
from curve_service.metrics import CurveMetrics
from curve_service.redis_store import RUNS_KEY, RedisRunStore
from curve_service.server import CurveServicer, serve
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.store import MAX_TASKS, MemoryRunStore, RunStore
from scalerl.rpc import channel as grpc_channel
from scalerl.rpc.clients.curve import CurveClient, FitSpec
from scalerl.rpc.clients.curve_results import RecordedRun
from scalerl.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from scalerl.state.client import connect
from scalerl.state.keys import TASK_NAME_PATTERN, RunKeys, run_key
from scalerl.v1 import curve_pb2, curve_pb2_grpc

pytestmark = pytest.mark.integration
TIMEOUT_S = 30.0
COMPUTE = np.geomspace(0.01, 1.0, 10)  # accelerator-hours of a CPU-scale run
# Two tasks that scale differently, and the run's total: their mean (equal weights).
MATH = SigmoidParams(a=0.8, b=1.5, c_mid=0.1, r0=0.1)
CODE = SigmoidParams(a=0.55, b=2.5, c_mid=0.2, r0=0.05)
TOTAL_R0 = 0.075
BAD_TASK = "task: must be '' (the run's total) or match {}, got {!r}"


def _reward(params: SigmoidParams, compute: float) -> float:
    return float(predict(params, [compute])[0])


def _total(compute: float) -> float:
    return 0.5 * (_reward(MATH, compute) + _reward(CODE, compute))


# --- the store backends ---------------------------------------------------------------


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def make_store(request) -> Callable[..., RunStore]:
    """store(new_runs, max_tasks): a fresh store of each backend that admits `new_runs` runs
    beyond those it already holds (the Redis ones share the tests' redis-server, or their
    3-master Redis Cluster)."""
    if request.param == "memory":
        return lambda new_runs=1000, max_tasks=MAX_TASKS: MemoryRunStore(new_runs, 1000, max_tasks)
    if request.param == "redis-cluster":
        client = connect(request.getfixturevalue("redis_cluster").url)
    else:
        client = connect(request.getfixturevalue("redis_url"))

    def redis_store(new_runs: int = 1000, max_tasks: int = MAX_TASKS) -> RunStore:
        held = client.scard(RUNS_KEY)
        return RedisRunStore(client, max_runs=held + new_runs, max_tasks=max_tasks)

    return redis_store


def _record_tasks(store: RunStore, run_id: str, computes) -> None:
    """Points of the two tasks (own R0s) and of the total at each compute, in that order."""
    for c in computes:
        store.record(run_id, c, _reward(MATH, c), MATH.r0, "math")
        store.record(run_id, c, _reward(CODE, c), CODE.r0, "code")
        store.record(run_id, c, _total(c), TOTAL_R0)


def test_series_are_independent(make_store, run_id: str) -> None:
    store = make_store()
    _record_tasks(store, run_id, [1.0, 2.0, 4.0])
    store.record(run_id, 8.0, 0.7, None, "math")  # only math has a fourth evaluation
    math, code, total = (store.get(run_id, t) for t in ("math", "code", ""))
    assert math.points == tuple((c, _reward(MATH, c)) for c in (1.0, 2.0, 4.0)) + ((8.0, 0.7),)
    assert code.points == tuple((c, _reward(CODE, c)) for c in (1.0, 2.0, 4.0))
    assert total.points == tuple((c, _total(c)) for c in (1.0, 2.0, 4.0))
    assert (math.r0, code.r0, total.r0) == (MATH.r0, CODE.r0, TOTAL_R0)  # R0 per series
    assert (math.revision, code.revision, total.revision) == (4, 3, 3)
    assert (math.task, code.task, total.task) == ("math", "code", "")
    assert store.series(run_id) == ("", "code", "math")
    # The same compute may carry a different reward in another series, never in one.
    with pytest.raises(CurveInputError, match=r"^point.compute: run '.*' task 'code' already"):
        store.record(run_id, 1.0, 0.99, None, "code")
    with pytest.raises(CurveInputError, match=r"^r0: run '.*' task 'math' has r0=0.1; got 0.3"):
        store.record(run_id, 16.0, 0.7, 0.3, "math")
    # A fit is stored per series: setting the total's leaves the tasks' alone.
    fit = fit_sigmoid([1.0, 2.0, 4.0, 8.0], [0.1, 0.2, 0.3, 0.35], r0=0.1)
    assert store.set_fit(run_id, 3, fit) is True
    assert store.set_fit(run_id, 3, fit, "math") is False  # math is at revision 4
    assert store.get(run_id).fit is fit
    assert (store.get(run_id, "math").fit, store.get(run_id, "code").fit) == (None, None)


def test_a_run_of_task_series_only_has_no_total(make_store, run_id: str) -> None:
    store = make_store()
    store.record(run_id, 1.0, 0.3, None, "math")
    assert store.series(run_id) == ("math",)
    with pytest.raises(UnknownTaskError) as err:
        store.get(run_id)
    assert (err.value.run_id, err.value.task, err.value.known) == (run_id, "", ("math",))
    assert str(err.value) == f"task: run {run_id!r} has no series ''; its series: 'math'"


def test_unknown_and_bad_series_names(make_store, run_id: str) -> None:
    store = make_store()
    _record_tasks(store, run_id, [1.0])
    with pytest.raises(UnknownTaskError) as err:
        store.get(run_id, "bio")
    assert err.value.status == "NOT_FOUND"
    assert str(err.value) == (
        f"task: run {run_id!r} has no series 'bio'; its series: '' (the total), 'code', 'math'"
    )
    with pytest.raises(UnknownRunError) as missing:
        store.get("never-recorded", "math")
    assert str(missing.value) == "run_id: no run named 'never-recorded' (asked for task 'math')"
    with pytest.raises(UnknownRunError):
        store.series("never-recorded")
    for bad in ("Math", "-math", "a" * 33, "ma th", "math:x", "math\n"):
        with pytest.raises(CurveInputError) as refused:
            store.record(run_id, 2.0, 0.3, None, bad)
        assert str(refused.value) == BAD_TASK.format(TASK_NAME_PATTERN.pattern, bad)
        assert refused.value.field == "task"
        with pytest.raises(CurveInputError, match="^task: "):
            store.get(run_id, bad)
    assert store.series(run_id) == ("", "code", "math")  # nothing recorded


def test_trim_trims_every_series(make_store, run_id: str) -> None:
    store = make_store()
    _record_tasks(store, run_id, [1.0, 2.0, 4.0, 8.0])
    store.record(run_id, 0.5, 0.2, None, "late")  # a task with nothing above the bound
    late = store.get(run_id, "late")
    fit = fit_sigmoid([1.0, 2.0, 4.0, 8.0], [0.1, 0.2, 0.3, 0.35], r0=0.1)
    assert store.set_fit(run_id, late.revision, fit, "late") is True
    series, removed = store.trim(run_id, 2.0)
    assert removed == 2 * 3  # 4.0 and 8.0 of math, code and the total
    assert sorted(series) == ["", "code", "late", "math"]
    for task, truth in (("math", MATH), ("code", CODE)):
        snap = store.get(run_id, task)
        assert snap == series[task]
        assert snap.points == ((1.0, _reward(truth, 1.0)), (2.0, _reward(truth, 2.0)))
        assert (snap.r0, snap.revision, snap.fit) == (truth.r0, 5, None)
    assert store.get(run_id).points == ((1.0, _total(1.0)), (2.0, _total(2.0)))
    kept = store.get(run_id, "late")  # untouched: same revision, fit kept
    assert kept == series["late"] and (kept.revision, kept.fit) == (1, fit)
    assert store.trim(run_id, 2.0)[1] == 0  # nothing above any more


def test_the_66th_series_is_refused_and_changes_nothing(make_store, run_id: str) -> None:
    store = make_store()
    store.record(run_id, 1.0, 0.2, None)
    tasks = [f"task-{i:02d}" for i in range(MAX_TASKS)]
    for task in tasks:
        store.record(run_id, 1.0, 0.2, None, task)
    assert store.series(run_id) == ("", *tasks)  # 65 series: the total and 64 tasks
    with pytest.raises(CurveInputError) as err:
        store.record(run_id, 1.0, 0.2, None, "one-too-many")
    assert err.value.field == "task"
    assert str(err.value) == (
        f"task: run {run_id!r} already holds 64 task series, the most a run may hold "
        "(64 tasks and the total: 65 series); got new task 'one-too-many'"
    )
    assert store.series(run_id) == ("", *tasks)
    with pytest.raises(UnknownTaskError):
        store.get(run_id, "one-too-many")
    # The series the run holds still take points.
    assert store.record(run_id, 2.0, 0.3, None, tasks[-1]).points == ((1.0, 0.2), (2.0, 0.3))
    assert store.record(run_id, 2.0, 0.3, None).revision == 2


def test_max_runs_counts_runs_not_series(make_store, run_id: str) -> None:
    store = make_store(new_runs=1)
    store.record(run_id, 1.0, 0.2, None)
    store.record(run_id, 1.0, 0.3, None, "math")  # a new series of a held run: no new run
    with pytest.raises(StoreFullError):
        store.record(f"{run_id}-b", 1.0, 0.2, None, "math")
    with pytest.raises(UnknownRunError):
        store.get(f"{run_id}-b", "math")


def test_redis_keys_keep_the_total_layout(redis_url: str, run_id: str) -> None:
    """The total series sits where runs recorded before tasks have their points, so those
    load unchanged; task series sit under their own keys."""
    client = connect(redis_url)
    keys = RunKeys(run_id)
    # A run as the curve service wrote it before series had names.
    client.hset(keys.curve_points, mapping={repr(1.0): repr(0.2), repr(2.0): repr(0.3)})
    client.hset(keys.curve_meta, mapping={"r0": repr(0.1), "revision": 2})
    client.sadd(RUNS_KEY, run_id)
    store = RedisRunStore(client)
    old = store.get(run_id)
    assert (old.points, old.r0, old.revision, old.task) == (((1.0, 0.2), (2.0, 0.3)), 0.1, 2, "")
    assert store.series(run_id) == ("",)
    store.record(run_id, 1.0, 0.5, 0.4, "math")
    assert client.hgetall(run_key(run_id, "curve", "task", "math", "points")) == {
        repr(1.0).encode(): repr(0.5).encode()
    }
    assert client.smembers(run_key(run_id, "curve", "tasks")) == {b"math"}
    assert client.hgetall(keys.curve_points) == {b"1.0": b"0.2", b"2.0": b"0.3"}
    assert store.series(run_id) == ("", "math")
    assert store.get(run_id, "math").r0 == 0.4 and store.get(run_id).r0 == 0.1


# --- the RPCs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[curve_pb2_grpc.CurveServiceStub, CurveServicer, str]]:
    servicer = CurveServicer(metrics=CurveMetrics())
    server, port, _ = serve(port=0, servicer=servicer)
    address = f"127.0.0.1:{port}"
    with grpc_channel.channel(address) as ch:
        yield curve_pb2_grpc.CurveServiceStub(ch), servicer, address
    server.stop(None)


@pytest.fixture
def stub(service) -> curve_pb2_grpc.CurveServiceStub:
    return service[0]


def _record(stub, run_id: str, compute: float, reward: float, task: str = "", **kw):
    point = curve_pb2.CurvePoint(compute=compute, reward=reward)
    request = curve_pb2.RecordPointRequest(run_id=run_id, point=point, task=task, **kw)
    return stub.RecordPoint(request, timeout=TIMEOUT_S)


def _record_run(stub, run_id: str, compute=COMPUTE) -> None:
    """Each evaluation as the learner records it: one point per task, then the total."""
    for c in compute:
        _record(stub, run_id, c, _reward(MATH, c), "math", r0=MATH.r0)
        _record(stub, run_id, c, _reward(CODE, c), "code", r0=CODE.r0)
        _record(stub, run_id, c, _total(c), r0=TOTAL_R0)


def _get(stub, run_id: str, task: str = "") -> curve_pb2.GetRunResponse:
    return stub.GetRun(curve_pb2.GetRunRequest(run_id=run_id, task=task), timeout=TIMEOUT_S)


def _error(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=TIMEOUT_S)
    return err.value


def _gauge(servicer: CurveServicer, name: str, run_id: str, task: str) -> float | None:
    labels = {"run_id": run_id, "task": task}
    return servicer.metrics.registry.get_sample_value(name, labels)


def test_each_task_gets_its_own_fit(service, run_id: str) -> None:
    stub, servicer, _ = service
    _record_run(stub, run_id)
    for task, truth in (("math", MATH), ("code", CODE)):
        run = _get(stub, run_id, task)
        assert (run.run_id, run.task, list(run.tasks)) == (run_id, task, ["code", "math"])
        assert [(p.compute, p.reward) for p in run.points] == [
            (c, _reward(truth, c)) for c in COMPUTE
        ]
        assert abs(run.fit.params.a - truth.a) <= 0.01
        assert run.fit.params.b == pytest.approx(truth.b, rel=0.01)
        assert run.fit.params.r0 == truth.r0
        assert _gauge(servicer, "scalerl_curve_asymptote", run_id, task) == run.fit.params.a
        assert _gauge(servicer, "scalerl_curve_points", run_id, task) == len(COMPUTE)
    total = _get(stub, run_id)
    assert (total.task, list(total.tasks)) == ("", ["code", "math"])
    assert [(p.compute, p.reward) for p in total.points] == [(c, _total(c)) for c in COMPUTE]
    assert total.fit.params.r0 == TOTAL_R0
    assert _gauge(servicer, "scalerl_curve_points", run_id, "") == len(COMPUTE)


def test_a_single_task_run_lists_no_tasks(stub, run_id: str) -> None:
    for c in COMPUTE[:4]:
        _record(stub, run_id, c, _reward(MATH, c))
    run = _get(stub, run_id)
    assert (run.task, list(run.tasks), len(run.points)) == ("", [], 4)


def test_extrapolate_a_task_uses_its_fit(stub, run_id: str) -> None:
    _record_run(stub, run_id)
    request = curve_pb2.ExtrapolateRequest(run_id=run_id, task="code", compute=[1e4])
    far = stub.Extrapolate(request, timeout=TIMEOUT_S).predictions[0]
    assert abs(far.reward - CODE.a) <= 0.01  # at 5e4 x C_mid the curve is at its asymptote
    assert far.lower <= far.reward <= far.upper
    request.task = "math"
    assert abs(stub.Extrapolate(request, timeout=TIMEOUT_S).predictions[0].reward - MATH.a) <= 0.01


def test_fit_of_a_recorded_series_equals_the_fit_of_its_points(stub, run_id: str) -> None:
    _record_run(stub, run_id)
    points = [curve_pb2.CurvePoint(compute=c, reward=_reward(CODE, c)) for c in COMPUTE]
    method = curve_pb2.FitMethod(bootstrap_resamples=20, seed=3, power_law=True)
    options = dict(method=method, predict_compute=[2.0, 10.0], min_compute=0.015)
    by_run = stub.Fit(curve_pb2.FitRequest(run_id=run_id, task="code", **options))
    by_points = stub.Fit(curve_pb2.FitRequest(points=points, r0=CODE.r0, **options))
    assert by_run == by_points
    assert by_run.points_used == 9 and by_run.params.r0 == CODE.r0  # the recorded R0
    assert len(by_run.predictions) == 2 and by_run.intervals.resamples == 20
    # The request's r0 wins over the recorded one.
    by_run = stub.Fit(curve_pb2.FitRequest(run_id=run_id, task="code", r0=0.2))
    assert by_run == stub.Fit(curve_pb2.FitRequest(points=points, r0=0.2))
    assert by_run.params.r0 == 0.2
    # CompareRuns takes recorded series as well: math's A is the higher.
    compare = curve_pb2.CompareRunsRequest(
        runs=[
            curve_pb2.FitRequest(run_id=run_id, task="code"),
            curve_pb2.FitRequest(run_id=run_id, task="math"),
        ]
    )
    assert stub.CompareRuns(compare, timeout=TIMEOUT_S).best == 1


def test_fit_of_a_series_without_a_recorded_r0_uses_its_lowest_reward(stub, run_id) -> None:
    for c in COMPUTE:
        _record(stub, run_id, c, _reward(MATH, c), "math")
    points = [curve_pb2.CurvePoint(compute=c, reward=_reward(MATH, c)) for c in COMPUTE]
    by_run = stub.Fit(curve_pb2.FitRequest(run_id=run_id, task="math"), timeout=TIMEOUT_S)
    assert by_run == stub.Fit(curve_pb2.FitRequest(points=points), timeout=TIMEOUT_S)
    assert by_run.params.r0 == _reward(MATH, COMPUTE[0])


def test_fit_refuses_run_id_with_points_and_task_without_run_id(stub, run_id: str) -> None:
    _record_run(stub, run_id, COMPUTE[:4])
    point = curve_pb2.CurvePoint(compute=1.0, reward=0.2)
    err = _error(stub.Fit, curve_pb2.FitRequest(run_id=run_id, points=[point]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "points: must be empty with run_id (got 1 points)"
    err = _error(stub.Fit, curve_pb2.FitRequest(points=[point] * 4, task="math"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "task: names a series of a run: set it only with run_id, got 'math'"
    params = curve_pb2.CurveParams(a=0.7, b=2.0, c_mid=1.0, r0=0.1)
    err = _error(
        stub.Extrapolate, curve_pb2.ExtrapolateRequest(params=params, compute=[1.0], task="math")
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("task: names a series of a run")


def test_fit_of_a_short_series_fails_precondition(stub, run_id: str) -> None:
    _record_run(stub, run_id, COMPUTE[:3])
    err = _error(stub.Fit, curve_pb2.FitRequest(run_id=run_id, task="math"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        err.details() == f"run_id: run {run_id!r} task 'math' has 3 points; a fit needs at least 4"
    )


def test_unknown_series_are_not_found(stub, run_id: str) -> None:
    _record_run(stub, run_id, COMPUTE[:4])
    listing = (
        f"task: run {run_id!r} has no series 'bio'; its series: '' (the total), 'code', 'math'"
    )
    requests = [
        (stub.GetRun, curve_pb2.GetRunRequest(run_id=run_id, task="bio")),
        (stub.Fit, curve_pb2.FitRequest(run_id=run_id, task="bio")),
        (stub.Extrapolate, curve_pb2.ExtrapolateRequest(run_id=run_id, task="bio", compute=[1.0])),
    ]
    for call, request in requests:
        err = _error(call, request)
        assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, listing)
    err = _error(stub.GetRun, curve_pb2.GetRunRequest(run_id="never-recorded", task="math"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == "run_id: no run named 'never-recorded' (asked for task 'math')"
    err = _error(stub.Fit, curve_pb2.FitRequest(run_id="never-recorded"))
    assert (err.code(), err.details()) == (
        grpc.StatusCode.NOT_FOUND,
        "run_id: no run named 'never-recorded'",
    )


@pytest.mark.parametrize("bad", ["Math", "math/x", "_math", "m" * 33])
def test_bad_task_names_are_invalid_argument(stub, run_id: str, bad: str) -> None:
    _record_run(stub, run_id, COMPUTE[:1])
    point = curve_pb2.CurvePoint(compute=2.0, reward=0.2)
    requests = [
        (stub.RecordPoint, curve_pb2.RecordPointRequest(run_id=run_id, point=point, task=bad)),
        (stub.GetRun, curve_pb2.GetRunRequest(run_id=run_id, task=bad)),
        (stub.Fit, curve_pb2.FitRequest(run_id=run_id, task=bad)),
        (stub.Extrapolate, curve_pb2.ExtrapolateRequest(run_id=run_id, task=bad, compute=[1.0])),
    ]
    for call, request in requests:
        err = _error(call, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == BAD_TASK.format(TASK_NAME_PATTERN.pattern, bad)
    assert list(_get(stub, run_id).tasks) == ["code", "math"]  # nothing recorded


def test_trim_run_trims_every_series_and_refits_them(service, run_id: str) -> None:
    stub, servicer, _ = service
    _record_run(stub, run_id)
    reply = stub.TrimRun(
        curve_pb2.TrimRunRequest(run_id=run_id, max_compute=COMPUTE[5]), timeout=TIMEOUT_S
    )
    assert (reply.points_removed, reply.points) == (3 * 4, 6)
    total = _get(stub, run_id)
    assert reply.fit == total.fit and total.fit.params.r0 == TOTAL_R0  # the total's
    for task, truth in (("math", MATH), ("code", CODE)):
        run = _get(stub, run_id, task)
        assert [p.compute for p in run.points] == list(COMPUTE[:6])
        assert run.fit.points_used == 6 and abs(run.fit.params.a - truth.a) <= 0.01
        assert _gauge(servicer, "scalerl_curve_points", run_id, task) == 6
    few = stub.TrimRun(
        curve_pb2.TrimRunRequest(run_id=run_id, max_compute=COMPUTE[2]), timeout=TIMEOUT_S
    )
    assert (few.points_removed, few.points, few.HasField("fit")) == (3 * 3, 3, False)
    for task in ("math", "code", ""):
        assert _gauge(servicer, "scalerl_curve_points", run_id, task) == 3
        assert _gauge(servicer, "scalerl_curve_asymptote", run_id, task) is None


def test_trim_run_of_a_run_without_a_total(stub, run_id: str) -> None:
    for c in COMPUTE[:5]:
        _record(stub, run_id, c, _reward(MATH, c), "math", r0=MATH.r0)
    request = curve_pb2.TrimRunRequest(run_id=run_id, max_compute=COMPUTE[3])
    reply = stub.TrimRun(request, timeout=TIMEOUT_S)
    assert (reply.points_removed, reply.points, reply.HasField("fit")) == (1, 0, False)
    assert len(_get(stub, run_id, "math").points) == 4


def test_a_65th_task_series_is_invalid_argument() -> None:
    servicer = CurveServicer(store=MemoryRunStore(max_tasks=2), metrics=CurveMetrics())
    server, port, _ = serve(port=0, servicer=servicer)
    try:
        with grpc_channel.channel(f"127.0.0.1:{port}") as ch:
            stub = curve_pb2_grpc.CurveServiceStub(ch)
            for task in ("", "math", "code"):
                _record(stub, "full", 1.0, 0.2, task)
            err = _error(
                stub.RecordPoint,
                curve_pb2.RecordPointRequest(
                    run_id="full", point=curve_pb2.CurvePoint(compute=1.0, reward=0.2), task="bio"
                ),
            )
            tasks = list(_get(stub, "full").tasks)
    finally:
        server.stop(None)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("task: run 'full' already holds 2 task series")
    assert tasks == ["code", "math"]


# --- CurveClient ------------------------------------------------------------------------


@pytest.fixture
def client(service) -> Iterator[CurveClient]:
    with CurveClient(service[2], timeout_s=TIMEOUT_S, compute_unit="accelerator-hours") as c:
        yield c


def test_client_records_reads_and_fits_task_series(client: CurveClient, run_id: str) -> None:
    for c in COMPUTE:
        recorded = client.record_point(run_id, c, _reward(CODE, c), r0=CODE.r0, task="code")
        client.record_point(run_id, c, _reward(MATH, c), r0=MATH.r0, task="math")
        client.record_point(run_id, c, _total(c), TOTAL_R0)  # the total, as before tasks
    assert recorded.points == len(COMPUTE) and abs(recorded.fit.a - CODE.a) <= 0.01

    run = client.get_run(run_id, task="code")
    assert isinstance(run, RecordedRun)
    assert (run.run_id, run.task, run.tasks) == (run_id, "code", ("code", "math"))
    assert run.points == tuple((c, _reward(CODE, c)) for c in COMPUTE)
    assert run.fit.compute_unit == "accelerator-hours" and abs(run.fit.a - CODE.a) <= 0.01
    total = client.get_run(run_id)
    assert (total.task, total.points[0]) == ("", (COMPUTE[0], _total(COMPUTE[0])))

    fitted = client.fit_run(run_id, "math", bootstrap_resamples=20, seed=1, predict_compute=[5.0])
    explicit = FitSpec(
        compute=list(COMPUTE),
        reward=[_reward(MATH, c) for c in COMPUTE],
        r0=MATH.r0,
        bootstrap_resamples=20,
        seed=1,
        predict_compute=[5.0],
    )
    assert fitted == client.fit(explicit)
    assert abs(fitted.a - MATH.a) <= 0.01 and fitted.a_interval is not None


def test_client_errors_name_the_task(client: CurveClient, run_id: str) -> None:
    client.record_point(run_id, 1.0, 0.2, task="math")
    with pytest.raises(InvalidArgument) as err:
        client.record_point(run_id, 1.0, 0.2, task="Math")
    assert err.value.field == "task" and TASK_NAME_PATTERN.pattern in err.value.message
    with pytest.raises(NotFound, match=r"has no series 'code'; its series: 'math'$"):
        client.get_run(run_id, "code")
    with pytest.raises(NotFound, match=r"has no series ''; its series: 'math'$"):
        client.get_run(run_id)
    with pytest.raises(FailedPrecondition, match=r"task 'math' has 1 points"):
        client.fit_run(run_id, "math")
