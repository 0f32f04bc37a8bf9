"""TensorBoard: event files under the run folder's tracking/tensorboard/, written with
TensorBoard's own event writer (no torch, no TensorFlow).

Steps, evaluations and the fit's parameters are scalars of the run at the learner step
(train/..., eval/..., curve/...). Each refit's band is its own TensorBoard run,
tracking/tensorboard/fit/<step-NNNNNN | final>, with curve/predicted, curve/lower and
curve/upper over compute: the Scalars tab then draws one line per refit on one chart (how
the extrapolation moved as evaluations came) and the Custom Scalars tab each with its 90%
band (a margin chart). The evaluations themselves are the run tracking/tensorboard/held-out
on the same axis, curve/observed with its 90% interval (pass rate +- 1.645 standard
errors, curve/observed_lower and _upper), drawn on the same chart: what was measured beside
what each fit predicted. TensorBoard's steps are integers, so compute is the step in
accelerator-seconds (COMPUTE_UNIT x 3600). The config and the report are text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from scalerl.config import RunConfig, dump_config
from scalerl.run_folder import EvalRecord, StepRecord
from scalerl.tracking.api import (
    CurveBand,
    TrackedRun,
    eval_metrics,
    fit_metrics,
    report_metrics,
    report_step,
    step_metrics,
)

SECONDS_PER_UNIT = 3600.0  # COMPUTE_UNIT is accelerator-hours; the fits' steps are seconds
Z_90 = 1.645  # a two-sided 90% normal interval, the level of the fits' bands
HELD_OUT_RUN = "held-out"  # the run of the evaluations over compute
_FLUSH_S = 30  # a live run's events reach the files within this long


class TensorBoardTracker:
    """Event files of `run` under its folder's tensorboard/. Raises ImportError without
    the tensorboard package, OSError when the folder cannot be written."""

    FORGETS_ON_RESUME: ClassVar[bool] = True

    def __init__(self, run: TrackedRun) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2, summary_pb2
        self._writer_class = EventFileWriter
        self._folder = run.folder / "tensorboard"
        self._writer = EventFileWriter(str(self._folder), flush_secs=_FLUSH_S)
        self._held_out: Any = None  # the held-out run's writer, opened at the first evaluation
        self._stepped = False
        self._write_layout()

    def log_config(self, config: RunConfig) -> None:
        self._text("config", dump_config(config), 0)

    def log_step(self, record: StepRecord) -> None:
        if not self._stepped:
            self._purge_from(self._writer, record.step)
            self._stepped = True
        self._scalars(self._writer, step_metrics(record), record.step, record.time)

    def log_eval(self, record: EvalRecord) -> None:
        self._scalars(self._writer, eval_metrics(record), record.step, record.time)
        at = round(record.compute * SECONDS_PER_UNIT)
        if self._held_out is None:
            self._held_out = self._writer_class(
                str(self._folder / HELD_OUT_RUN), flush_secs=_FLUSH_S
            )
            self._purge_from(self._held_out, at)
        self._scalars(self._held_out, observed_metrics(record), at, record.time)

    def log_curve(self, band: CurveBand) -> None:
        self._scalars(self._writer, fit_metrics(band), band.step, time.time())
        if not band.predictions:
            return
        prefix = f"curve/{band.task}/" if band.task else "curve/"
        writer = self._writer_class(str(self._folder / "fit" / band.name))
        try:
            for p in band.predictions:
                values = {"predicted": p.reward, "lower": p.lower, "upper": p.upper}
                metrics = {f"{prefix}{k}": v for k, v in values.items()}
                self._scalars(writer, metrics, round(p.compute * SECONDS_PER_UNIT), time.time())
        finally:
            writer.close()

    def log_report(self, report: Mapping[str, Any]) -> None:
        step = report_step(report)
        self._text("report", json.dumps(report, indent=2), step)
        self._scalars(self._writer, report_metrics(report), step, time.time())
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
        if self._held_out is not None:
            self._held_out.close()

    def _purge_from(self, writer: Any, step: int) -> None:
        """A learner that resumed from a checkpoint logs its steps and evaluations again:
        TensorBoard forgets what an earlier process logged to this run from `step` on
        (a START session log; torch's purge_step)."""
        session = self._event.SessionLog(status=self._event.SessionLog.START)
        writer.add_event(self._event.Event(step=step, session_log=session))

    def _scalars(self, writer: Any, metrics: Mapping[str, float], step: int, at: float) -> None:
        """One event holding every metric at `step` (wall time `at`, Unix seconds)."""
        values = [self._summary.Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        summary = self._summary.Summary(value=values)
        writer.add_event(self._event.Event(wall_time=at, step=step, summary=summary))

    def _text(self, tag: str, text: str, step: int) -> None:
        """`text` as TensorBoard's text plugin shows it: Markdown, here a code block."""
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.text.metadata import create_summary_metadata

        block = "\n".join("    " + line for line in text.splitlines())
        tensor = tensor_pb2.TensorProto(
            dtype="DT_STRING",
            string_val=[block.encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(
                dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]
            ),
        )
        value = self._summary.Summary.Value(
            tag=tag, tensor=tensor, metadata=create_summary_metadata(tag, "")
        )
        event = self._event.Event(
            wall_time=time.time(), step=step, summary=self._summary.Summary(value=[value])
        )
        self._writer.add_event(event)

    def _write_layout(self) -> None:
        """The Custom Scalars tab's layout: the run's curve as a margin chart (predicted
        with its 90% band), one per fit run."""
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.custom_scalar import layout_pb2
        from tensorboard.plugins.custom_scalar.metadata import (
            CONFIG_SUMMARY_TAG,
            create_summary_metadata,
        )

        series = [
            layout_pb2.MarginChartContent.Series(
                value=f"curve/{value}", lower=f"curve/{lower}", upper=f"curve/{upper}"
            )
            for value, lower, upper in (
                ("predicted", "lower", "upper"),
                ("observed", "observed_lower", "observed_upper"),
            )
        ]
        chart = layout_pb2.Chart(
            title="held-out reward over compute (accelerator-seconds): each fit's prediction "
            "and the evaluations, 90% intervals",
            margin=layout_pb2.MarginChartContent(series=series),
        )
        layout = layout_pb2.Layout(category=[layout_pb2.Category(title="curve", chart=[chart])])
        tensor = tensor_pb2.TensorProto(
            dtype="DT_STRING",
            string_val=[layout.SerializeToString()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        )
        value = self._summary.Summary.Value(
            tag=CONFIG_SUMMARY_TAG, tensor=tensor, metadata=create_summary_metadata()
        )
        self._writer.add_event(self._event.Event(summary=self._summary.Summary(value=[value])))


def observed_metrics(record: EvalRecord) -> dict[str, float]:
    """An evaluation as a point of the held-out run: curve/observed (its pass rate) and its
    90% interval, pass rate +- Z_90 standard errors clipped to [0, 1] (the pass rate alone
    where no stderr was recorded); a task's under curve/<task>/."""
    prefix = f"curve/{record.task}/" if record.task else "curve/"
    half = Z_90 * (record.stderr or 0.0)
    values = {
        "observed": record.pass_rate,
        "observed_lower": max(0.0, record.pass_rate - half),
        "observed_upper": min(1.0, record.pass_rate + half),
    }
    return {f"{prefix}{k}": v for k, v in values.items()}
