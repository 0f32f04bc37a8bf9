"""The launcher's workers follow the run's target in Redis: `scalerl workers add` starts
the next rollout-<i> (before the learner in the children list), `remove` SIGTERMs the
newest, a worker that exits 0 by itself has left and is not replaced."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from scalerl.state.fleet_target import MAX_WORKERS, FleetTarget
from scalerl_cli import fleet as fleet_module
from scalerl_cli.fleet import LauncherFleet, workers_command


class FakeProc:
    def __init__(self) -> None:
        self.signals: list[int] = []

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


@pytest.fixture
def fleet(redis_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def start_child(name, module, args, log_dir, env=None):
        assert module == "rollout_service.main" and args[args.index("--worker-id") + 1] == name
        return SimpleNamespace(name=name, proc=FakeProc(), args=args)

    monkeypatch.setattr(fleet_module, "start_child", start_child)
    services: dict = {"redis": redis_url}
    return LauncherFleet(
        tmp_path / "config.yaml", redis_url, run_id, tmp_path / "logs", services,
        tmp_path / "services.json",
    )  # fmt: skip


def test_the_workers_follow_the_target(fleet: LauncherFleet, tmp_path: Path) -> None:
    children = [SimpleNamespace(name="curve"), *fleet.start(1), SimpleNamespace(name="learner")]
    assert [c.name for c in children] == ["curve", "rollout-0", "learner"]
    fleet.target.add(2)
    fleet.reconcile(children)
    assert [c.name for c in children] == ["curve", "rollout-0", "rollout-1", "rollout-2", "learner"]
    assert set(json.loads((tmp_path / "services.json").read_text())) >= {"rollout-2"}
    fleet.target.add(-1)
    fleet.reconcile(children)
    fleet.reconcile(children)  # asked once: not asked again, nobody else asked
    assert children[3].proc.signals == [signal.SIGTERM]
    assert children[1].proc.signals == children[2].proc.signals == []
    fleet.left(children.pop(3))  # it exited 0
    assert fleet.target.get() == 2 and fleet.leaving == set()
    fleet.left(children.pop(2))  # rollout-1 exited 0 by itself: not replaced
    fleet.reconcile(children)
    assert fleet.target.get() == 1 and [c.name for c in children] == [
        "curve",
        "rollout-0",
        "learner",
    ]


def test_the_target_stays_in_range(redis_client: redis.Redis, run_id: str) -> None:
    target = FleetTarget(redis_client, run_id)
    target.set(1)
    with pytest.raises(ValueError, match=r"workers: 1 launcher-managed, -2 would leave 0\.\.1024"):
        target.add(-2)
    assert target.get() == 1
    with pytest.raises(ValueError, match="workers must be an integer in 0..1024"):
        target.set(MAX_WORKERS + 1)


def test_the_workers_command(redis_url: str, run_id: str, tmp_path: Path, capsys) -> None:
    assert workers_command("add", tmp_path, 1) == 2
    assert "not a running run folder" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text(f"run_id: {run_id}\n")
    (tmp_path / "services.json").write_text(json.dumps({"redis": redis_url}))
    FleetTarget(redis.Redis.from_url(redis_url), run_id).set(1)
    assert workers_command("add", tmp_path, 2) == 0
    assert capsys.readouterr().out.strip() == "launcher-managed rollout workers: 3"
    assert workers_command("remove", tmp_path, 5) == 2
    assert "would leave" in capsys.readouterr().err
    assert workers_command("remove", tmp_path, 0) == 2


def test_a_redis_outage_changes_no_worker(fleet: LauncherFleet) -> None:
    """Redis being restarted by the launcher: reconcile leaves the workers as they are, and
    a worker that leaves meanwhile lowers the target once Redis answers (not replaced)."""
    children = [*fleet.start(2), SimpleNamespace(name="learner")]

    def down(*args, **kwargs):
        raise redis.ConnectionError("Error 111 connecting. Connection refused.")

    with pytest.MonkeyPatch.context() as outage:
        outage.setattr(fleet.target, "_client", SimpleNamespace(get=down))
        outage.setattr(fleet.target, "_add", down)
        fleet.reconcile(children)
        fleet.left(children.pop(1))  # rollout-1 exited 0 by itself during the outage
        fleet.reconcile(children)
        assert [c.name for c in children] == ["rollout-0", "learner"]
        assert children[0].proc.signals == [] and fleet.unrecorded_leaves == 1
    fleet.reconcile(children)
    assert fleet.target.get() == 1 and fleet.unrecorded_leaves == 0
    assert [c.name for c in children] == ["rollout-0", "learner"]
