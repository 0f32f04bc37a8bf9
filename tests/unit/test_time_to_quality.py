"""The time-to-quality ruler (`benchmarks/time_to_quality.py`): the first kept policy at
or above a target, with the interval from the one before; the newest published policy
kept by a hard link."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "time_to_quality.py"
_spec = importlib.util.spec_from_file_location("time_to_quality", _PATH)
assert _spec is not None and _spec.loader is not None
ttq = importlib.util.module_from_spec(_spec)
sys.modules["time_to_quality"] = ttq  # its dataclasses look their module up
_spec.loader.exec_module(ttq)


def points(*pairs: tuple[float, float]) -> list:
    return [ttq.Scored(seconds, rate, 0.03) for seconds, rate in pairs]


def test_the_first_policy_at_the_target_and_the_interval_before_it() -> None:
    curve = points((60, 0.2), (120, 0.55), (180, 0.52), (240, 0.61), (300, 0.7))
    assert ttq.crossing(curve, 0.5) == ttq.Crossing(0.5, 120, 60, 0.7)
    assert ttq.crossing(curve, 0.6) == ttq.Crossing(0.6, 240, 180, 0.7)  # not a dip's later
    assert ttq.crossing(curve, 0.7) == ttq.Crossing(0.7, 300, 240, 0.7)  # at: reached
    never = ttq.crossing(curve, 0.75)
    assert never.seconds is None and never.after is None and never.best == 0.7
    assert ttq._cell(never) == "not reached (best 0.700)"
    first = ttq.crossing(points((60, 0.8)), 0.5)
    assert (first.seconds, first.after) == (60, None) and ttq._cell(first) == "60 s (0-60)"


def test_the_newest_published_policy_is_kept_by_a_link(tmp_path: Path, monkeypatch) -> None:
    weights = tmp_path / "run" / "weights"
    weights.mkdir(parents=True)
    for version in (3, 12, 9):
        (weights / f"policy-v{version}.safetensors").write_bytes(bytes([version]))
    (weights / "policy-v13.tmp").write_bytes(b"x")  # being written: not a policy yet
    monkeypatch.setattr(ttq, "SNAPSHOT_EVERY_S", 0.05)
    stop = threading.Event()
    into = tmp_path / "snapshots"
    keeper = threading.Thread(target=ttq.keep_scalerl_policies, args=(tmp_path / "run", into, stop))
    keeper.start()
    try:
        while not list(into.glob("*.safetensors")):
            stop.wait(0.01)
    finally:
        stop.set()
        keeper.join(5)
    kept = sorted(into.glob("*.safetensors"))[0]
    assert kept.name.endswith("-v12.safetensors") and kept.read_bytes() == bytes([12])
    assert os.stat(kept).st_ino == os.stat(weights / "policy-v12.safetensors").st_ino
    pair = tmp_path / "out" / "a" / "scalerl"
    pair.mkdir(parents=True)
    os.replace(into, pair / "snapshots")
    (_, system, seconds, _path), *_ = ttq.kept_policies(tmp_path / "out")
    assert system == "scalerl" and seconds == pytest.approx(0, abs=1)


def test_every_other_policy_of_each_curve_is_scored_first() -> None:
    kept = [("a", "scalerl", float(t), Path(f"s{t}")) for t in (60, 120, 180, 240, 300)]
    kept += [("a", "trl", float(t), Path(f"t{t}")) for t in (70, 130, 190)]
    order = [(system, seconds) for _, system, seconds, _ in ttq.coarse_first(kept)]
    assert order == [
        ("scalerl", 60), ("scalerl", 180), ("scalerl", 300), ("trl", 70), ("trl", 190),
        ("scalerl", 120), ("scalerl", 240), ("trl", 130),
    ]  # fmt: skip
