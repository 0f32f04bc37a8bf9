"""Children of the launcher: started with no Python code between fork and exec (a
`preexec_fn` beside gRPC's threads aborted about one start in seventy), in a process group
of their own, and gone when the launcher is SIGKILLed (`scalerl_cli.orphan_guard`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scalerl.rpc.server import make_server
from scalerl_cli.orphan_guard import PARENT_GONE
from scalerl_cli.processes import spawn_tied

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")


def _gone(pid: int) -> bool:
    """True when `pid` has exited (a zombie nobody reaped counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_child_runs_its_command_under_its_own_pid_and_process_group(tmp_path):
    proc = spawn_tied(
        [sys.executable, "-c", "import os; print(os.getpid(), os.getpgrp())"],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.split() == [str(proc.pid), str(proc.pid)]  # exec'd in place, group leader


IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
)


@pytest.mark.parametrize("command", ["import time; time.sleep(120)", IGNORES_SIGTERM])
def test_a_child_dies_with_its_sigkilled_parent(tmp_path, command: str):
    """Even one that would not stop on SIGTERM (a worker draining towards a Redis that
    died with the launcher retried for minutes): the tie is SIGKILL."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from scalerl_cli.processes import spawn_tied;"
            f"p = spawn_tied([sys.executable, '-c', {command!r}]);"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)",
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        child = int(pid_file.read_text())
        time.sleep(0.5)  # the child has exec'd its command (the tie is made before)
        assert not _gone(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _gone(child):
            assert time.monotonic() < deadline, "the child outlived its SIGKILLed parent"
            time.sleep(0.05)
    finally:
        parent.kill()


def test_the_guard_does_not_start_a_command_whose_parent_is_gone(tmp_path):
    marker = tmp_path / "ran"
    done = subprocess.run(  # pid 1 is not the guard's parent: as if the launcher had died
        [sys.executable, "-m", "scalerl_cli.orphan_guard", "1", "touch", str(marker)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == PARENT_GONE and "parent 1 is gone" in done.stderr
    assert not marker.exists()


def test_children_start_every_time_beside_busy_grpc_threads():
    """150 starts while 4 threads call a gRPC server, as the launcher's restarts run beside
    its progress and curve clients; with a `preexec_fn` about 1 in 70 died by SIGABRT."""
    server, port, _ = make_server([], 0, "127.0.0.1")
    stop = threading.Event()

    def call() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

    threads = [threading.Thread(target=call, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    failed = []
    try:
        for i in range(150):
            proc = spawn_tied(
                [sys.executable, "-S", "-c", "print('ok')"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            out, _ = proc.communicate(timeout=30)
            if proc.returncode != 0 or out.strip() != b"ok":
                failed.append((i, proc.returncode, out[-200:]))
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        server.stop(grace=0)
    assert failed == []


def test_a_stop_that_overruns_its_deadline_ends_the_process(tmp_path):
    """A worker told to stop whose drain hangs (its Redis gone) exits at its deadline."""
    script = (
        "import time; from scalerl.entrypoint import stop_on_signals;"
        "stop = stop_on_signals(deadline_s=1.0); print('ready', flush=True);"
        "stop.wait(60); time.sleep(60)"  # the drain that never ends
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert 1.0 <= time.monotonic() - started < 15
        assert "still stopping 1 s after the signal: exiting now" in proc.stderr.read()
    finally:
        proc.kill()


def test_a_second_interrupt_during_the_orderly_stop_kills_every_child(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C, then Ctrl-C again while the learner still finishes (its grace is minutes):
    every child is killed at once and the launcher says so in one line, no traceback."""
    from scalerl_cli import launcher
    from scalerl_cli.processes import Child

    children = [
        Child(name, subprocess.Popen(["sleep", "60"]), tmp_path / f"{name}.log")
        for name in ("curve", "rollout-0", "learner")
    ]

    def interrupted_again(_children, grace_s=15.0):
        raise KeyboardInterrupt  # the second signal lands inside the learner's grace

    monkeypatch.setattr(launcher, "stop_children", interrupted_again)
    started = time.monotonic()
    launcher._stop_or_kill(children)
    assert time.monotonic() - started < 10
    assert [c.proc.returncode for c in children] == [-signal.SIGKILL] * 3
    assert "interrupted again: killing every process" in capsys.readouterr().err
