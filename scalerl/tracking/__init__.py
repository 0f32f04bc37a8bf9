"""Experiment trackers (`tracking: [tensorboard, wandb, mlflow]` in the config): a run's
steps, evaluations, curve fits with their bands, config and report, logged to the trackers
a team already uses, each under the run folder's `tracking/` and none over a network.

`api` holds what every tracker takes (the `Tracker` protocol, `TrackedRun`, `CurveBand`,
the metric names); `fanout` builds the configured trackers (`open_trackers`, the one place
that maps a name to its class) behind `Trackers`, which drops a failing tracker with one
warning; `held` keeps the learner's records from a tracker that cannot forget until a
checkpoint covers them (a resumed learner takes the steps past it again); one module per
tracker: `tensorboard_events`, `mlflow_files`, `wandb_offline`,
each importing its library only when built. Torch-free.
"""

from scalerl.tracking.api import CurveBand, TrackedRun, Tracker, curve_grid
from scalerl.tracking.fanout import Trackers, open_trackers

__all__ = ["CurveBand", "TrackedRun", "Tracker", "Trackers", "curve_grid", "open_trackers"]
