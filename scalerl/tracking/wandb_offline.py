"""Weights & Biases, offline: runs under the run folder's tracking/wandb/offline-run-*/
(`wandb sync` uploads them later), written with wandb's own SDK; nothing leaves the
machine.

Steps, evaluations and fits are logged with their own step metrics (train/step,
eval/step, curve/step): an evaluation finishes after the steps taken meanwhile, and W&B
drops a row logged at a step below its last one. Each refit's band is a line chart of
predicted, lower and upper over compute (a float x-axis W&B charts draw directly), whose
slider steps through the refits. The config is the run's config.

The launcher's report is a run of its own in the run's group (id <run's id>-report, job
type "report"): an offline run cannot be resumed, and two offline files of one id would
overwrite each other's history when synced.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from scalerl.compute import COMPUTE_UNIT
from scalerl.config import RunConfig
from scalerl.run_folder import EvalRecord, StepRecord
from scalerl.tracking.api import (
    CurveBand,
    TrackedRun,
    eval_metrics,
    fit_metrics,
    report_metrics,
    step_metrics,
)

PROJECT = "scalerl"
_SECTIONS = ("train", "eval", "curve")  # each with its own step metric, <section>/step


class WandbTracker:
    """An offline W&B run of `run` under its folder's wandb/. Raises ImportError without
    wandb, or wandb's error when the run cannot start."""

    FORGETS_ON_RESUME: ClassVar[bool] = False

    def __init__(self, run: TrackedRun) -> None:
        folder = run.folder.resolve()
        folder.mkdir(parents=True, exist_ok=True)
        # Nothing reaches a network (no error reports) and nothing lands outside the run
        # folder (wandb's caches and staged tables default to the home directory).
        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_ERROR_REPORTING"] = "false"
        os.environ.setdefault("WANDB_CACHE_DIR", str(folder / "wandb-cache"))
        os.environ.setdefault("WANDB_DATA_DIR", str(folder / "wandb-data"))
        import wandb

        self._wandb = wandb
        settings = wandb.Settings(
            mode="offline",
            console="off",
            save_code=False,
            disable_git=True,
            silent=True,
            x_disable_stats=True,  # no sampling thread competing with training
            x_save_requirements=False,
        )
        run_id = wandb_run_id(folder, run.run_id)
        report = run.part == "report"
        self._run = wandb.init(
            project=PROJECT,
            id=f"{run_id}-report" if report else run_id,
            name=f"{run.run_id} report" if report else run.run_id,
            group=run.run_id,
            job_type="report" if report else "train",
            dir=str(folder),
            settings=settings,
        )
        for section in _SECTIONS:
            self._run.define_metric(f"{section}/step")
            self._run.define_metric(f"{section}/*", step_metric=f"{section}/step")

    def log_config(self, config: RunConfig) -> None:
        run_config: Any = self._run.config  # wandb leaves its update untyped
        run_config.update(config.model_dump(mode="json"), allow_val_change=True)

    def log_step(self, record: StepRecord) -> None:
        self._run.log(step_metrics(record) | {"train/step": record.step})

    def log_eval(self, record: EvalRecord) -> None:
        self._run.log(eval_metrics(record) | {"eval/step": record.step})

    def log_curve(self, band: CurveBand) -> None:
        row: dict[str, Any] = fit_metrics(band) | {"curve/step": band.step}
        if band.predictions:
            prefix = f"curve/{band.task}/" if band.task else "curve/"
            row[f"{prefix}band"] = self._wandb.plot.line_series(
                xs=[p.compute for p in band.predictions],
                ys=[
                    [p.reward for p in band.predictions],
                    [p.lower for p in band.predictions],
                    [p.upper for p in band.predictions],
                ],
                keys=["predicted", "lower", "upper"],
                title=f"fit {band.name}: held-out reward, 90% band",
                xname=f"compute ({COMPUTE_UNIT})",
            )
        self._run.log(row)

    def log_report(self, report: Mapping[str, Any]) -> None:
        self._run.summary.update(report_metrics(report) | {"report": dict(report)})

    def close(self) -> None:
        self._run.finish()


def wandb_run_id(folder: Path, run_id: str) -> str:
    """The W&B id of the run whose tracking folder is `folder`: the config's run id (in
    W&B's characters) and a random suffix, kept in `folder`/wandb-run-id so that a
    restarted learner and the launcher name the same run, and two run folders of one
    run_id ("run", the default) are two W&B runs."""
    path = folder / "wandb-run-id"
    if path.exists():
        return path.read_text().strip()
    chosen = f"{re.sub(r'[^A-Za-z0-9_-]', '-', run_id)}-{secrets.token_hex(4)}"
    path.write_text(chosen + "\n")
    return chosen
