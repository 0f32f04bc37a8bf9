"""Named crash points for fault tests: a process dies by SIGKILL (no cleanup, as when its
node is lost) at exactly the point a test names, so a crash "after the optimizer step,
before the acknowledgement" is reproducible instead of a race.

`SCALERL_CRASH_AT=learner.step.trained@3` kills the process the 3rd time it reaches that
point (`@1` when omitted). With `SCALERL_CRASH_MARKER=FILE` only the first process to get
there dies (it creates FILE first), so the restarted process carries on past the point.
Unset (the default), `crash_point` is one environment lookup.

The points (where they sit is in each caller's code):
- learner.step.trained    after the optimizer step, before its groups are acknowledged
- learner.step.acked      after the acknowledgement, before the step's record is written
- checkpoint.written      the new checkpoint is complete in `checkpoint.tmp/`, not renamed
- checkpoint.swapped      the old checkpoint moved to `checkpoint.old/`, the new not in place
- weight_group.tensor     a broadcast receiver got one more tensor of a version (mid-broadcast)
"""

from __future__ import annotations

import logging
import os
import signal
from collections import Counter

CRASH_AT_ENV = "SCALERL_CRASH_AT"
CRASH_MARKER_ENV = "SCALERL_CRASH_MARKER"
POINTS = frozenset(
    {
        "learner.step.trained",
        "learner.step.acked",
        "checkpoint.written",
        "checkpoint.swapped",
        "weight_group.tensor",
    }
)

log = logging.getLogger(__name__)
_reached: Counter[str] = Counter()


def crash_point(name: str) -> None:
    """SIGKILL this process if `SCALERL_CRASH_AT` names `name` and this is the stated
    time it is reached (see the module docstring). Raises ValueError for a name outside
    `POINTS` (a typo in a test would otherwise never crash)."""
    if name not in POINTS:
        raise ValueError(f"crash point must be one of {sorted(POINTS)}, got {name!r}")
    target = os.environ.get(CRASH_AT_ENV)
    if not target:
        return
    point, _, nth = target.partition("@")
    if point != name:
        return
    _reached[name] += 1
    if _reached[name] != int(nth or 1) or not _first_to_crash():
        return
    log.error("crash point %s reached: SIGKILL", name)
    os.kill(os.getpid(), signal.SIGKILL)


def _first_to_crash() -> bool:
    """True unless the marker file names an earlier crash (it is created here, atomically)."""
    marker = os.environ.get(CRASH_MARKER_ENV)
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
