"""The sandbox service of the chaos soak's code task (`benchmarks/chaos.py --sandbox`):
started by the soak as its Deployment would run it (restarted within a second when it
dies), the code task that sends the run's programs to it, and the "at capacity" fault.

- `kill:sandbox`: SIGKILL of the service; the soak starts it again on the same port.
- `busy:sandbox`: for BUSY_S seconds the soak keeps every slot and every place in the
  service's queue taken with programs that sleep, so the run's own programs are refused
  (RESOURCE_EXHAUSTED) and must be retried, or their groups dead-lettered: never scored 0.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from soak import REPO_ROOT

from scalerl.ports import free_port
from scalerl.rpc.errors import ServiceError
from scalerl.sandbox.client import SandboxClient

CONCURRENCY = 2  # the service's slots; its queue holds 4 x as many
BUSY_S = 30.0
SLEEPER = "import time\ntime.sleep(4)\n"


def code_task_file(folder: Path) -> Path:
    """40 prompts "a+b=?" in the tiny model's characters whose tests call the program's
    f: the tiny model never writes one, so every program runs and fails its tests (a
    reward of 0 from a program that ran, not from a sandbox that did not)."""
    path = folder / "chaos-code.jsonl"
    rows = [
        {"id": f"c{a}-{b}", "prompt": f"{a}+{b}=?", "tests": [f"assert f({a}) == {a + b}"]}
        for a in range(8)
        for b in range(5)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_overrides(folder: Path, port: int) -> list[str]:
    """The `--set` overrides of a run with the additions and the code task on the service."""
    tasks = (
        "[{name: add, large_max: 9, heldout_size: 30, weight: 3},"
        f" {{name: code, source: file, path: '{code_task_file(folder)}', prompt_field: prompt,"
        " answer_field: tests, id_field: id, verifier: code, heldout_size: 8, weight: 1}]"
    )
    return [f"task={tasks}", f"verifier.code.service=127.0.0.1:{port}"]


class SandboxService:
    """`python -m sandbox_service.main` on a fixed port, kept up by a thread of the soak
    (`restarts` counts its starts after the first). Its output goes to `log_path`."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.restarts = 0
        self.log = log_path.open("ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep_up, name="sandbox-keeper", daemon=True)

    def start(self) -> None:
        """Start it and its keeper; returns once it accepts connections (30 s at most)."""
        self._launch()
        self._keeper.start()

    def processes(self) -> dict[str, psutil.Process]:
        """{"sandbox": its process} while it runs, else {}."""
        if self.proc is None or self.proc.poll() is not None:
            return {}
        try:
            return {"sandbox": psutil.Process(self.proc.pid)}
        except psutil.NoSuchProcess:
            return {}

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def fill(self, seconds: float = BUSY_S) -> dict[str, int]:
        """Keep every slot and queue place taken for `seconds`: the requests it made and
        how many of them the service refused (so that the service's own count of refusals
        at its end, less these, is the run's)."""
        until = time.monotonic() + seconds
        counts = {"requests": 0, "refused": 0}
        lock = threading.Lock()

        def occupy() -> None:
            with SandboxClient(f"127.0.0.1:{self.port}") as client:
                while time.monotonic() < until:
                    try:
                        client.execute(SLEEPER, "stdio", [""], 5.0)
                        refused = 0
                    except ServiceError:
                        refused = 1
                        time.sleep(0.2)  # refused (full) or down: take the place again
                    with lock:
                        counts["requests"] += 1
                        counts["refused"] += refused

        threads = [threading.Thread(target=occupy, daemon=True) for _ in range(6 * CONCURRENCY)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 60)
        return counts

    def _launch(self) -> None:
        command = [sys.executable, "-m", "sandbox_service.main", "--port", str(self.port)]
        command += ["--concurrency", str(CONCURRENCY)]
        self.proc = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)

    def _keep_up(self) -> None:
        while not self._stop.wait(1.0):
            if self.proc is not None and self.proc.poll() is not None:
                self.restarts += 1
                self._launch()
