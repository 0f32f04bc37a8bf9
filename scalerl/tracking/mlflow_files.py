"""MLflow: a file store under the run folder's tracking/mlflow/ (a `file:` URI; no server,
nothing sent), written with MLflow's own client.

One MLflow run per scalerl run, found by its tag `scalerl.run_id`: a restarted learner
and the launcher's report go on in it (the file store takes writes from one process after
another; the launcher writes once the learner has ended), so the report's numbers and
report.json sit on the run's own page. Steps, evaluations and fits are metrics at the
learner step; the config is parameters and config.yaml; each refit's band is a table
artifact, curve/<step-NNNNNN | final>.json (columns compute, predicted, lower, upper): an
MLflow metric's x-axis is an integer step, so a curve over compute is a table there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from scalerl.compute import COMPUTE_UNIT
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

EXPERIMENT = "scalerl"
RUN_TAG = "scalerl.run_id"
_METRICS_PER_CALL = 1000  # MLflow's log_batch limits
_PARAMS_PER_CALL = 100
_PARAM_VALUE_CHARS = 6000


class MlflowTracker:
    """The MLflow run of `run` in the file store under its folder's mlflow/. Raises
    ImportError without mlflow (mlflow-skinny), MlflowException or OSError when the store
    cannot be opened."""

    FORGETS_ON_RESUME: ClassVar[bool] = False

    def __init__(self, run: TrackedRun) -> None:
        # MLflow 3 keeps the file store in maintenance mode and refuses it unless asked:
        # it is what needs no server and no database here. Its usage telemetry would
        # reach a network: off.
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        folder = (run.folder / "mlflow").resolve()
        self._client = client = MlflowClient(tracking_uri=folder.as_uri())
        experiment = client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (
            experiment.experiment_id if experiment else client.create_experiment(EXPERIMENT)
        )
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run.run_id}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {RUN_TAG: run.run_id}
            self.run_id = client.create_run(
                experiment_id, run_name=run.run_id, tags=tags
            ).info.run_id

    def log_config(self, config: RunConfig) -> None:
        """The config's fields as parameters (section.field), those the run does not hold
        yet: a parameter cannot change in MLflow, and a resumed run may have new limits
        (config.yaml, rewritten, holds them)."""
        held = self._client.get_run(self.run_id).data.params
        flat = _flat(config.model_dump(mode="json"))
        params = [self._param(k, v[:_PARAM_VALUE_CHARS]) for k, v in flat.items() if k not in held]
        for i in range(0, len(params), _PARAMS_PER_CALL):
            self._client.log_batch(self.run_id, params=params[i : i + _PARAMS_PER_CALL])
        self._client.log_text(self.run_id, dump_config(config), "config.yaml")

    def log_step(self, record: StepRecord) -> None:
        self._metrics(step_metrics(record), record.step, record.time)

    def log_eval(self, record: EvalRecord) -> None:
        self._metrics(eval_metrics(record), record.step, record.time)

    def log_curve(self, band: CurveBand) -> None:
        self._metrics(fit_metrics(band), band.step, time.time())
        if band.predictions:
            table = {
                "compute_unit": COMPUTE_UNIT,
                "columns": ["compute", "predicted", "lower", "upper"],
                "data": [[p.compute, p.reward, p.lower, p.upper] for p in band.predictions],
            }
            folder = f"curve/{band.task}" if band.task else "curve"
            self._client.log_dict(self.run_id, table, f"{folder}/{band.name}.json")

    def log_report(self, report: Mapping[str, Any]) -> None:
        self._metrics(report_metrics(report), report_step(report), time.time())
        self._client.log_dict(self.run_id, dict(report), "report.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)

    def _metrics(self, metrics: Mapping[str, float], step: int, at: float) -> None:
        """Every metric at `step`, stamped `at` (Unix seconds)."""
        stamp = int(at * 1000)
        rows = [self._metric(k, v, stamp, step) for k, v in metrics.items()]
        for i in range(0, len(rows), _METRICS_PER_CALL):
            self._client.log_batch(self.run_id, metrics=rows[i : i + _METRICS_PER_CALL])


def _flat(data: Mapping[str, Any] | list[Any], prefix: str = "") -> dict[str, str]:
    """Nested config values as {"section.field": "value"} (list items by index)."""
    out: dict[str, str] = {}
    items = data.items() if isinstance(data, Mapping) else enumerate(data)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (Mapping, list)) and value:
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = str(value)
    return out
