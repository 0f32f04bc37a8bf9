"""Experiment trackers (`scalerl.tracking`): a run's steps, evaluations, refits with their
90% bands, config and report reach TensorBoard, MLflow and W&B (offline), each read back
with the tracker's own reader; a tracker that fails, or whose package is missing, is one
warning and the others go on.

The run is driven through the learner's own writers (`EvalReporter` with a real curve
service in this process, the step records the learner writes) and the launcher's
`track_report`, without training: seconds, not a run."""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from test_run_folder import EVAL, STEP  # complete StepRecord and EvalRecord fields

from curve_service.metrics import CurveMetrics
from curve_service.server import CurveServicer
from learner_service.evaluation.evaluate import EvalResult
from learner_service.evaluation.reporter import EvalReporter
from learner_service.evaluation.schedule import EvalJob
from learner_service.progress import RunProgress
from scalerl.config import load_config
from scalerl.rpc.clients.curve import CurveClient
from scalerl.run_folder import EvalRecord, StepRecord, read_records
from scalerl.tracking import CurveBand, TrackedRun, Trackers, curve_grid, fanout, open_trackers
from scalerl.tracking.held import HeldUntilCheckpoint
from scalerl.tracking.tensorboard_events import SECONDS_PER_UNIT, TensorBoardTracker
from scalerl_cli.report import track_report

pytestmark = pytest.mark.unit
RUN_ID = "tracked-run"
ALL = ["tensorboard", "wandb", "mlflow"]
# A rising held-out curve: (step, compute in accelerator-hours, run pass rate, math's).
EVALS = [
    (0, 0.0, 0.10, 0.20),
    (2, 0.01, 0.22, 0.30),
    (4, 0.02, 0.35, 0.42),
    (6, 0.03, 0.44, 0.50),
    (8, 0.04, 0.50, 0.55),
    (10, 0.05, 0.53, 0.58),
]
STEPS = 10


def _job(step: int, compute: float, run_rate: float, math_rate: float) -> EvalJob:
    math = EvalResult(math_rate, 0.0, 64, 10.0, 0.0, stderr=0.03)
    run = EvalResult(run_rate, 0.0625, 64, 12.0, 0.125, {"math": math}, 0.03)
    job = EvalJob(step=step, version=step, compute=compute, started=0.0, full=False)
    job.result, job.seconds = run, 4.5
    return job


def _step(step: int) -> StepRecord:
    loss, reward = -0.5 + 0.0625 * step, 0.125 + 0.03125 * step
    return StepRecord(**(STEP | {"step": step, "loss": loss, "mean_reward": reward}))


def _drive(run_dir: Path, trackers: Trackers, servicer: CurveServicer) -> list[StepRecord]:
    """A run's records, as the learner writes them: an evaluation every 2 steps (each
    refitting the run's and the task's curve on the service), a step record each step."""
    config = load_config("tiny", [f"run_id={RUN_ID}", f"tracking={ALL}"])
    trackers.log_config(config)
    reporter = EvalReporter(run_dir, RUN_ID, "in-process", trackers=trackers)
    reporter._client = lambda: CurveClient.in_process(servicer)  # no server, no port
    progress, steps = RunProgress(), []
    for step, compute, run_rate, math_rate in EVALS:
        while progress.step < step:
            progress.step += 1
            steps.append(_step(progress.step))
            trackers.log_step(steps[-1])
        reporter.record(_job(step, compute, run_rate, math_rate), progress)
    return steps


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> Iterator[tuple[Path, list[StepRecord], CurveServicer]]:
    """A run folder whose learner logged to all three trackers, then the launcher its
    report and final fit."""
    run_dir = tmp_path_factory.mktemp("run")
    servicer = CurveServicer(metrics=CurveMetrics())
    trackers = open_trackers(ALL, TrackedRun(run_dir / "tracking", RUN_ID))
    assert trackers.names == ALL
    steps = _drive(run_dir, trackers, servicer)
    trackers.checkpointed(STEPS)  # the learner's final checkpoint
    trackers.close()
    config = load_config("tiny", [f"run_id={RUN_ID}", f"tracking={ALL}"])
    fit = CurveClient.in_process(servicer).get_run(RUN_ID).fit
    band = CurveBand(step=10, task="", fit=fit, predictions=_band(servicer), label="final")
    report = {"final_step": 10, "pass_rate_final": 0.53, "fit": {"A": fit.a}, "ended": "max"}
    track_report(run_dir, config, report, band)
    yield run_dir, steps, servicer


def _band(servicer: CurveServicer, task: str = "") -> tuple:
    """The service's band of the series now (its last refit), over the grid the learner
    logs: first evaluation to 4x the last one."""
    grid = curve_grid(EVALS[0][1], EVALS[-1][1])
    return CurveClient.in_process(servicer).extrapolate(RUN_ID, grid, task=task)


def _evals(run_dir: Path, task: str = "") -> list[EvalRecord]:
    return [r for r in read_records(run_dir, EvalRecord) if r.task == task]


# --- TensorBoard --------------------------------------------------------------------------


def _events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_holds_the_steps_evaluations_fits_and_bands(tracked) -> None:
    run_dir, steps, servicer = tracked
    events = _events(run_dir / "tracking" / "tensorboard")
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [s.step for s in steps] == list(range(1, STEPS + 1))
    assert [e.value for e in loss] == pytest.approx([s.loss for s in steps])
    for task, tag in (("", "eval/pass_rate"), ("math", "eval/math/pass_rate")):
        evals, logged = _evals(run_dir, task), events.Scalars(tag)
        assert [e.step for e in logged] == [r.step for r in evals] == [s for s, *_ in EVALS]
        assert [e.value for e in logged] == pytest.approx([r.pass_rate for r in evals])
    fit = CurveClient.in_process(servicer).get_run(RUN_ID).fit
    a = events.Scalars("curve/A")  # a refit from the 4th evaluation on, then the final fit
    assert [e.step for e in a] == [6, 8, 10, 10] and a[-1].value == pytest.approx(fit.a)
    assert "config" in events.Tags()["tensors"] and "report" in events.Tags()["tensors"]
    assert events.Scalars("report/pass_rate_final")[0].value == pytest.approx(0.53)
    # The last refit's band: its own run, over compute in accelerator-seconds.
    band = _band(servicer)
    last = _events(run_dir / "tracking" / "tensorboard" / "fit" / "step-000010")
    for tag, field in (("predicted", "reward"), ("lower", "lower"), ("upper", "upper")):
        points = last.Scalars(f"curve/{tag}")
        assert [e.step for e in points] == [round(p.compute * SECONDS_PER_UNIT) for p in band]
        assert [e.value for e in points] == pytest.approx([getattr(p, field) for p in band])
    assert band[-1].lower < band[-1].reward < band[-1].upper  # a real band, not a line
    # The evaluations on the same axis, with their 90% intervals (+-1.645 x 0.03).
    held_out = _events(run_dir / "tracking" / "tensorboard" / "held-out")
    for task, prefix in (("", "curve/"), ("math", "curve/math/")):
        evals = _evals(run_dir, task)
        observed = held_out.Scalars(f"{prefix}observed")
        assert [e.step for e in observed] == [round(c * 3600) for _, c, *_ in EVALS]
        assert [e.value for e in observed] == pytest.approx([r.pass_rate for r in evals])
        lower = [e.value for e in held_out.Scalars(f"{prefix}observed_lower")]
        assert lower == pytest.approx([r.pass_rate - 0.04935 for r in evals])
    upper = [e.value for e in held_out.Scalars("curve/observed_upper")]
    assert upper == pytest.approx([rate + 0.04935 for _, _, rate, _ in EVALS])
    assert sorted(p.name for p in (run_dir / "tracking/tensorboard/fit").iterdir()) == [
        "final",
        "step-000006",
        "step-000008",
        "step-000010",
    ]


def test_a_resumed_learner_replaces_what_tensorboard_held_past_its_checkpoint(tmp_path) -> None:
    """A learner that crashed at step 6 resumes from its step-4 checkpoint and logs steps 5
    and 6 and the step-4 evaluation again: each is held once, with the later value."""

    def process(steps, evals, offset: float) -> None:
        tracker = TensorBoardTracker(TrackedRun(tmp_path / "tracking", RUN_ID))
        for step in steps:
            tracker.log_step(StepRecord(**(STEP | {"step": step, "loss": step + offset})))
        for step in evals:
            fields = {"step": step, "compute": step / 3600, "pass_rate": step / 10 + offset}
            tracker.log_eval(EvalRecord(**(EVAL | fields | {"task": ""})))
        tracker.close()

    process(range(1, 7), (0, 2, 4), 0.0)
    process((5, 6), (4,), 0.5)  # the resumed learner: steps 5-6 and evaluation 4 again
    loss = _events(tmp_path / "tracking" / "tensorboard").Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5.5), (6, 6.5)]
    held_out = _events(tmp_path / "tracking" / "tensorboard" / "held-out")
    observed = held_out.Scalars("curve/observed")  # at compute-seconds 0, 2 and 4
    assert [e.step for e in observed] == [0, 2, 4]
    assert [e.value for e in observed] == pytest.approx([0.0, 0.2, 0.9])


# --- MLflow -------------------------------------------------------------------------------


def _mlflow(run_dir: Path):
    from mlflow.tracking import MlflowClient

    # MLflow 3 opens a file store only when asked (`scalerl.tracking.mlflow_files`).
    with mock.patch.dict(os.environ, {"MLFLOW_ALLOW_FILE_STORE": "true"}):
        client = MlflowClient(tracking_uri=(run_dir / "tracking" / "mlflow").resolve().as_uri())
        experiment = client.get_experiment_by_name("scalerl")
        runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the launcher's report went on in the learner's run
    return client, runs[0]


def test_mlflow_holds_the_steps_evaluations_fits_and_bands(tracked, tmp_path) -> None:
    run_dir, steps, servicer = tracked
    client, run = _mlflow(run_dir)
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.data.tags["scalerl.run_id"] == RUN_ID
    loss = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in loss] == [(s.step, s.loss) for s in steps]
    for task, key in (("", "eval/pass_rate"), ("math", "eval/math/pass_rate")):
        history = client.get_metric_history(run_id, key)
        assert [(m.step, m.value) for m in history] == [
            (r.step, r.pass_rate) for r in _evals(run_dir, task)
        ]
    band = _band(servicer)
    far = client.get_metric_history(run_id, "curve/upper_far")
    assert [m.step for m in far] == [6, 8, 10, 10]  # the learner's refits, the final fit
    assert far[-2].value == band[-1].upper
    table = json.loads(
        Path(client.download_artifacts(run_id, "curve/step-000010.json", str(tmp_path))).read_text()
    )
    assert table["columns"] == ["compute", "predicted", "lower", "upper"]
    assert table["data"] == [[p.compute, p.reward, p.lower, p.upper] for p in band]
    assert run.data.params["learner.max_steps"] == "40"  # the tiny config's
    assert run.data.metrics["report/pass_rate_final"] == 0.53


def test_mlflow_holds_one_timeline_across_a_crash_and_resume(tmp_path) -> None:
    """A learner checkpoints at step 4, takes steps 5 and 6 and crashes; the resumed one
    takes 5 and 6 again with other values. MLflow cannot forget a point, so it got only
    what a checkpoint covered: each step once, the resumed learner's 5 and 6, as
    metrics.jsonl keeps them. The evaluation of step 4, ended after step 5, went at once."""
    run = TrackedRun(tmp_path / "tracking", RUN_ID)

    def step(trackers: Trackers, n: int, offset: float) -> None:
        trackers.log_step(StepRecord(**(STEP | {"step": n, "loss": n + offset})))

    def evaluation(trackers: Trackers, n: int) -> None:
        fields = {"step": n, "compute": n / 3600, "pass_rate": n / 10, "task": ""}
        trackers.log_eval(EvalRecord(**(EVAL | fields)))

    crashed = open_trackers(["mlflow"], run)
    for n in range(1, 5):
        step(crashed, n, 0.0)
    evaluation(crashed, 0)
    crashed.checkpointed(4)
    step(crashed, 5, 0.0)
    evaluation(crashed, 4)  # started at step 4, ended after step 5
    step(crashed, 6, 0.0)
    crashed.close()  # the crash: steps 5 and 6 were never covered
    resumed = open_trackers(["mlflow"], run)
    resumed.checkpointed(4)  # resumed from the checkpoint at step 4
    step(resumed, 5, 0.5)
    step(resumed, 6, 0.5)
    resumed.checkpointed(6)  # its final checkpoint
    resumed.close()
    client, mlflow_run = _mlflow(tmp_path)
    loss = client.get_metric_history(mlflow_run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in loss] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5.5), (6, 6.5)]
    evals = client.get_metric_history(mlflow_run.info.run_id, "eval/pass_rate")
    assert [(m.step, m.value) for m in evals] == [(0, 0.0), (4, 0.4)]


class _Recording:
    """A tracker that records its calls: (method, step)."""

    FORGETS_ON_RESUME = False

    def __init__(self, fail_at: int = -1) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail_at = fail_at

    def log_step(self, record: StepRecord) -> None:
        if record.step == self.fail_at:
            raise OSError(28, "No space left on device")
        self.calls.append(("step", record.step))

    def log_curve(self, band: CurveBand) -> None:
        self.calls.append(("curve", band.step))

    def close(self) -> None:
        self.calls.append(("close", -1))


def test_held_records_go_in_order_once_a_checkpoint_covers_them() -> None:
    tracker = _Recording()
    held = HeldUntilCheckpoint(tracker)
    fit = CurveBand(step=2, task="", fit=None)  # type: ignore[arg-type]
    for n in (1, 2):
        held.log_step(StepRecord(**(STEP | {"step": n})))
    held.log_curve(fit)
    held.log_step(StepRecord(**(STEP | {"step": 3})))
    assert tracker.calls == [] and held.held == 4
    held.checkpointed(2)  # covers steps 1, 2 and the fit of step 2; step 3 waits
    assert tracker.calls == [("step", 1), ("step", 2), ("curve", 2)] and held.held == 1
    held.log_curve(fit)  # a record of a covered step goes at once
    assert tracker.calls[-1] == ("curve", 2) and held.held == 1
    held.close()  # step 3 was never covered: dropped, not sent
    assert tracker.calls[-2:] == [("curve", 2), ("close", -1)] and held.held == 0


def test_an_evaluation_held_behind_later_steps_goes_with_its_checkpoint() -> None:
    """The evaluation of step 5 is logged after steps 6 and 7 (it ran meanwhile); a
    checkpoint at step 6 covers it and step 6, not step 7."""
    tracker = _Recording()
    held = HeldUntilCheckpoint(tracker)
    for n in (5, 6, 7):
        held.log_step(StepRecord(**(STEP | {"step": n})))
    held.log_curve(CurveBand(step=5, task="", fit=None))  # type: ignore[arg-type]
    held.checkpointed(6)
    assert tracker.calls == [("step", 5), ("step", 6), ("curve", 5)] and held.held == 1


def test_a_held_record_the_tracker_refuses_stays_held_and_the_tracker_is_dropped(caplog):
    """The fan-out drops a tracker that raises while a checkpoint's records are sent; the
    ones after the failing record were not sent."""
    tracker = _Recording(fail_at=2)
    trackers = Trackers({"recording": HeldUntilCheckpoint(tracker)})
    for n in (1, 2, 3):
        trackers.log_step(StepRecord(**(STEP | {"step": n})))
    with caplog.at_level(logging.WARNING):
        trackers.checkpointed(3)
    assert tracker.calls[:1] == [("step", 1)] and ("step", 3) not in tracker.calls
    assert trackers.names == []
    assert "tracker recording failed in checkpointed (OSError: " in caplog.text


# --- W&B (offline) ------------------------------------------------------------------------

_BLOCK, _HEADER = 32768, 7  # the .wandb file's framing: LevelDB log blocks and record headers


def _wandb_records(path: Path) -> Iterator:
    """The `wandb_internal_pb2.Record`s of an offline run's .wandb file. wandb 0.31 reads
    it in its Go core only (the Python `DataStore` is gone), so its LevelDB-log framing is
    undone here: a 7-byte file header (":W&B", magic, version), then in 32 KiB blocks
    records of crc32c (4), length (2), type (1: full, 2: first, 3: middle, 4: last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, parts = _HEADER, b""
    while position + _HEADER <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        chunk = data[position + _HEADER : position + _HEADER + length]
        position += _HEADER + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def _wandb_run(run_dir: Path, report: bool = False) -> dict:
    """An offline run's history rows, summary and config as W&B recorded them."""
    runs = sorted((run_dir / "tracking" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # the learner's run and the launcher's report run
    (path,) = [p for f in runs for p in f.glob("*.wandb") if p.stem.endswith("-report") == report]
    out: dict = {"history": [], "summary": {}, "config": {}, "folder": path.parent}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "summary":
            for item in record.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            for item in updates:
                out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def test_wandb_holds_the_steps_evaluations_fits_and_bands(tracked) -> None:
    run_dir, steps, servicer = tracked
    run = _wandb_run(run_dir)
    rows = run["history"]
    train = [(r["train/step"], r["train/loss"]) for r in rows if "train/loss" in r]
    assert train == [(s.step, s.loss) for s in steps]
    for task, key in (("", "eval/pass_rate"), ("math", "eval/math/pass_rate")):
        logged = [(r["eval/step"], r[key]) for r in rows if key in r]
        assert logged == [(r.step, r.pass_rate) for r in _evals(run_dir, task)]
    assert run["config"]["learner"]["max_steps"] == 40
    # The last refit's band: the line chart's table (x = compute; one line each).
    last = [r for r in rows if "curve/band/path" in r or "curve/band_table/path" in r][-1]
    assert last["curve/step"] == 10
    table_path = last.get("curve/band_table/path") or last["curve/band/path"]
    table = json.loads((run["folder"] / "files" / table_path).read_text())
    lines = {}
    for row in table["data"]:
        values = dict(zip(table["columns"], row, strict=True))
        lines.setdefault(values["lineKey"], []).append((values["step"], values["lineVal"]))
    band = _band(servicer)
    assert lines["predicted"] == [(p.compute, p.reward) for p in band]
    assert lines["upper"] == [(p.compute, p.upper) for p in band]
    report = _wandb_run(run_dir, report=True)
    assert report["summary"]["report/pass_rate_final"] == 0.53


def test_the_learner_and_the_launcher_name_one_wandb_run_and_its_report(tracked) -> None:
    run_dir = tracked[0]
    kept = (run_dir / "tracking" / "wandb-run-id").read_text().strip()
    assert kept.startswith(f"{RUN_ID}-")
    files = sorted(p.name for p in (run_dir / "tracking" / "wandb").glob("offline-run-*/*.wandb"))
    assert files == [f"run-{kept}-report.wandb", f"run-{kept}.wandb"]


# --- failures -----------------------------------------------------------------------------


class _Raising:
    """A tracker whose every call raises (a full disk, a broken library)."""

    calls: list[str] = []

    def __init__(self, run: TrackedRun) -> None:
        pass

    def __getattr__(self, name: str):
        def fail(*args, **kwargs):
            type(self).calls.append(name)
            raise OSError(28, "No space left on device")

        return fail


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_tracker_that_raises_is_one_warning_and_the_others_go_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(fanout.TRACKERS, "wandb", _Raising)
    caplog.set_level(logging.WARNING)
    trackers = open_trackers(ALL, TrackedRun(tmp_path / "tracking", RUN_ID))
    steps = _drive(tmp_path, trackers, CurveServicer(metrics=CurveMetrics()))
    trackers.close()
    assert _Raising.calls == ["log_config", "close"]  # its first call, then only closed
    (warning,) = _warnings(caplog)
    assert warning.startswith("tracker wandb failed in log_config (OSError: ")
    assert "dropped, the run goes on without it" in warning
    assert trackers.names == []
    events = _events(tmp_path / "tracking" / "tensorboard")
    assert len(events.Scalars("train/loss")) == len(steps) == STEPS


def test_a_missing_package_is_one_warning_at_start(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow...` raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    monkeypatch.setitem(sys.modules, "mlflow.entities", None)
    caplog.set_level(logging.WARNING)
    trackers = open_trackers(["tensorboard", "mlflow"], TrackedRun(tmp_path / "tracking", RUN_ID))
    (warning,) = _warnings(caplog)
    assert warning.startswith("tracker mlflow not started (ModuleNotFoundError: import of")
    assert warning.endswith("; pip install 'scalerl[tracking]'): the run goes on without it")
    assert trackers.names == ["tensorboard"]
    steps = _drive(tmp_path, trackers, CurveServicer(metrics=CurveMetrics()))
    trackers.close()
    assert len(_warnings(caplog)) == 1
    loss = _events(tmp_path / "tracking" / "tensorboard").Scalars("train/loss")
    assert [e.value for e in loss] == pytest.approx([s.loss for s in steps])
    assert not (tmp_path / "tracking" / "mlflow").exists()


def test_the_curve_grid_runs_from_the_first_evaluation_to_4x_the_last() -> None:
    grid = curve_grid(0.0, 0.05)
    assert len(grid) == 9 and grid[0] == 1e-9 and grid[-1] == pytest.approx(0.2)
    assert grid == sorted(grid)
    assert curve_grid(0.01, 0.01, points=3) == pytest.approx([0.01, 0.025, 0.04])
