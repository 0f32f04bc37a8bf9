"""Named crash points for fault tests: a process dies by SIGKILL (no cleanup, as when its
node is lost) at exactly the point a test names, so a crash "after the optimizer step,
before the acknowledgement" is reproducible instead of a race.

`SCALERL_CRASH_AT=learner.step.trained@3` kills the process the 3rd time it reaches that
point (`@1` when omitted). With `SCALERL_CRASH_MARKER=FILE` only the first process to get
there dies (it creates FILE first), so the restarted process carries on past the point.
Unset (the default), `crash_point` is one environment lookup.

A list crashes one job in turn: `learner.step.trained@7,checkpoint.written@1` kills the
first process at its 7th trained step, then the restarted one at its first checkpoint
(each `@N` counts within the process that reaches it). Crash i (from 1) creates FILE, or
FILE.i after the first, and the next entry is armed once it exists; without a marker only
the first entry is ever armed.

The points (where they sit is in each caller's code):
- learner.step.trained    after the optimizer step, before its groups are acknowledged
- learner.step.acked      after the acknowledgement, before the step's record is written
- checkpoint.written      the new checkpoint is complete in `checkpoint.tmp/`, not renamed
- checkpoint.swapped      the old checkpoint moved to `checkpoint.old/`, the new not in place
- weight_group.tensor     a broadcast receiver got one more tensor of a version (mid-broadcast)

Hang points are the same for a part that accepts and then never answers:
`SCALERL_HANG_AT=relay.serve@every:5` blocks the calling thread for HANG_S seconds every
5th time that point is reached (`@N`: the Nth time only). The points:
- relay.serve             a worker accepted a peer's FetchWeights, before its first chunk
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter

CRASH_AT_ENV = "SCALERL_CRASH_AT"
CRASH_MARKER_ENV = "SCALERL_CRASH_MARKER"
HANG_AT_ENV = "SCALERL_HANG_AT"
HANG_POINTS = frozenset({"relay.serve"})
HANG_S = 150.0  # longer than a whole weight fetch's deadline (120 s); then it goes on
_sleep = time.sleep  # what a hang blocks in (a test counts the calls instead)
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
    entries = target.split(",")
    crash = _crashes_before(len(entries))
    if crash == len(entries):
        return
    point, _, nth = entries[crash].partition("@")
    if point != name:
        return
    _reached[name] += 1
    if _reached[name] != int(nth or 1) or not _first_to_crash(crash):
        return
    log.error("crash point %s reached: SIGKILL", name)
    os.kill(os.getpid(), signal.SIGKILL)


def hang_point(name: str) -> None:
    """Block this thread for HANG_S seconds if `SCALERL_HANG_AT` names `name` and this is
    the stated time it is reached (`@N`, or every Nth time: `@every:N`; see the module
    docstring). Raises ValueError for a name outside `HANG_POINTS`."""
    if name not in HANG_POINTS:
        raise ValueError(f"hang point must be one of {sorted(HANG_POINTS)}, got {name!r}")
    point, _, when = os.environ.get(HANG_AT_ENV, "").partition("@")
    if point != name:
        return
    _reached[name] += 1
    every = when.startswith("every:")
    nth = int(when.removeprefix("every:") or 1)
    if (_reached[name] % nth == 0) if every else (_reached[name] == nth):
        log.error("hang point %s reached (time %d): blocking %.0f s", name, _reached[name], HANG_S)
        _sleep(HANG_S)


def _marker(crash: int) -> str | None:
    """The marker file of crash `crash` (from 0) of `SCALERL_CRASH_AT`'s list, if any."""
    marker = os.environ.get(CRASH_MARKER_ENV)
    if not marker:
        return None
    return marker if crash == 0 else f"{marker}.{crash + 1}"


def _crashes_before(entries: int) -> int:
    """How many of the list's crashes happened in earlier processes (their markers exist)."""
    crash = 0
    while crash < entries and (path := _marker(crash)) is not None and os.path.exists(path):
        crash += 1
    return crash


def _first_to_crash(crash: int) -> bool:
    """True unless the marker file names an earlier crash (it is created here, atomically)."""
    marker = _marker(crash)
    if marker is None:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
