"""A liveness file per process, for Kubernetes exec probes where a process serves no gRPC
health (the follower ranks of a learner on several nodes, and rank 0 before its server is
up): a daemon thread rewrites `{SCALERL_LIVENESS_FILE}.{LOCAL_RANK}` every BEAT_S seconds,
and the probe (`python -m scalerl.obs.liveness BASE MAX_AGE_S`) fails when any rank's file
is older than MAX_AGE_S or none exists. A frozen or stopped process stops beating; a
collective that hangs is ended by the ranks' command timeout
(`learner_service.train.ranks`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

LIVENESS_ENV = "SCALERL_LIVENESS_FILE"
BEAT_S = 10.0


def start_heartbeat(environ: dict[str, str] | None = None) -> Path | None:
    """Start beating when SCALERL_LIVENESS_FILE is set; returns this process's file."""
    environ = dict(os.environ) if environ is None else environ
    base = environ.get(LIVENESS_ENV, "")
    if not base:
        return None
    path = Path(f"{base}.{environ.get('LOCAL_RANK', '0')}")
    path.touch()

    def beat() -> None:
        while True:
            time.sleep(BEAT_S)
            path.touch()

    threading.Thread(target=beat, name="liveness", daemon=True).start()
    return path


def stale(base: str, max_age_s: float, now: float | None = None) -> list[str]:
    """What is wrong with the files of `base`: each rank's file older than max_age_s, or
    that there is none. [] = alive."""
    now = time.time() if now is None else now
    files = sorted(Path(base).parent.glob(Path(base).name + ".*"))
    if not files:
        return [f"no {base}.* file"]
    return [
        f"{f.name}: {now - f.stat().st_mtime:.0f}s old"
        for f in files
        if now - f.stat().st_mtime > max_age_s
    ]


def main(argv: list[str] | None = None) -> int:
    """The probe: exit 0 when alive, 1 (with what is stale) otherwise, 2 on bad usage."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m scalerl.obs.liveness BASE MAX_AGE_S", file=sys.stderr)
        return 2
    problems = stale(args[0], float(args[1]))
    if problems:
        print("; ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
