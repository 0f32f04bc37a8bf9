"""The liveness file of learner ranks (scalerl.obs.liveness): each rank beats its own file,
the probe fails when any is stale or none exists."""

from __future__ import annotations

import os
import time

from scalerl.obs.liveness import main, stale, start_heartbeat


def test_each_rank_beats_and_the_probe_reads_them(tmp_path) -> None:
    base = str(tmp_path / "alive")
    assert main([base, "60"]) == 1  # nothing beats yet
    assert start_heartbeat({}) is None  # not configured: nothing
    for rank in ("0", "1"):
        start_heartbeat({"SCALERL_LIVENESS_FILE": base, "LOCAL_RANK": rank})
    assert main([base, "60"]) == 0
    old = time.time() - 300
    os.utime(f"{base}.1", (old, old))  # rank 1 froze 5 minutes ago
    assert stale(base, 60) == ["alive.1: 300s old"]
    assert main([base, "60"]) == 1
    assert main([base]) == 2
