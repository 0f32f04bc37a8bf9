"""The launcher's watch loop ends, without a restart, when the learner gives up: a learner
that waited `learner.batch_timeout_s` without data would only wait again after a
restart. A learner that crashes is restarted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scalerl.ports import free_port
from scalerl.run_folder import GAVE_UP_EXIT
from scalerl_cli.launcher import _watch
from scalerl_cli.processes import Child
from scalerl_cli.supervisor import Supervisor


def _child(tmp_path: Path, code: int) -> Child:
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])
    proc.wait()
    return Child("learner", proc, tmp_path / "learner.log")


def test_a_learner_that_gave_up_is_not_restarted(tmp_path: Path) -> None:
    restarted: list[str] = []

    def restart(child: Child) -> Child:
        restarted.append(child.name)
        return _child(tmp_path, 0)

    children = [_child(tmp_path, GAVE_UP_EXIT)]
    _watch(children, f"127.0.0.1:{free_port()}", Supervisor(restart=restart))
    assert restarted == [] and children[0].poll() == GAVE_UP_EXIT


def test_a_learner_that_crashed_is_restarted(tmp_path: Path) -> None:
    restarted: list[str] = []

    def restart(child: Child) -> Child:
        restarted.append(child.name)
        return _child(tmp_path, 0)  # the restarted learner finishes the run

    children = [_child(tmp_path, 1)]
    _watch(children, f"127.0.0.1:{free_port()}", Supervisor(restart=restart))
    assert restarted == ["learner"] and children[0].poll() == 0
