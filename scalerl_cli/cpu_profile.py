"""How busy each process of a run was: CPU seconds (user + system, all its threads) read
from /proc/PID/stat while it runs, summed over its restarts, over the run's wall time.

The launcher samples once a second, so a process's last second before it exits may be
missed. A learner of several ranks runs under torchrun: its ranks are torchrun's children
and are not counted here (their busy seconds are in the compute counters). Elsewhere than
Linux there is no /proc and the profile is empty.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far, or None when it is gone (or
    there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces), proc(5): utime is the 14th
    # field of the line, stime the 15th.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


class CpuProfile:
    """CPU seconds per process name, kept across restarts (a new pid starts a new count
    that adds to the banked one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._banked: dict[str, float] = {}
        self._current: dict[str, tuple[int, float]] = {}  # name -> (pid, seconds)
        self._clock = clock
        # (time, all CPU seconds) of the latest samples: about 2 minutes at one a second.
        self._history: deque[tuple[float, float]] = deque(maxlen=120)

    def sample(self, processes: dict[str, int]) -> None:
        """Read the CPU seconds of each running process (name -> pid)."""
        for name, pid in processes.items():
            seconds = cpu_seconds(pid)
            if seconds is None:
                continue
            previous = self._current.get(name)
            if previous is not None and previous[0] != pid:  # restarted: bank the old one
                self._banked[name] = self._banked.get(name, 0.0) + previous[1]
            self._current[name] = (pid, seconds)
        self._history.append((self._clock(), sum(self.seconds().values())))

    def recent_busy_share(self, cores: int, window_s: float = 30.0) -> float | None:
        """The machine's busy share over the last `window_s` seconds of samples (all
        processes' CPU seconds over cores x wall seconds); None before two samples a
        second apart."""
        if not self._history:
            return None
        t1, s1 = self._history[-1]
        t0, s0 = next((t, s) for t, s in self._history if t >= t1 - window_s)
        if t1 - t0 < 1.0:
            return None
        return max(0.0, s1 - s0) / ((t1 - t0) * max(cores, 1))

    def seconds(self) -> dict[str, float]:
        """CPU seconds per process name, sorted by name."""
        names = sorted(set(self._banked) | set(self._current))
        return {n: self._banked.get(n, 0.0) + self._current.get(n, (0, 0.0))[1] for n in names}

    def summary(self, wall_s: float, cores: int) -> dict:
        """The report's per-process profile: each process's CPU seconds and busy share
        (CPU seconds over the run's wall seconds: 1.0 = one core all the time), and the
        machine's share used (all processes over cores x wall)."""
        seconds = self.seconds()
        wall = max(wall_s, 1e-9)
        return {
            "cores": cores,
            "processes": {
                n: {"cpu_seconds": round(s, 1), "busy_share": round(s / wall, 3)}
                for n, s in seconds.items()
            },
            "machine_busy_share": round(sum(seconds.values()) / (wall * max(cores, 1)), 3),
        }


class CpuProfileCollector:
    """The profile on the launcher's /metrics: `scalerl_process_cpu_seconds_total{process}`
    (user + system seconds, summed over restarts) and `scalerl_machine_cores`, so that
    sum(rate(scalerl_process_cpu_seconds_total[1m])) / scalerl_machine_cores is the
    machine's busy share and each process's rate its own."""

    def __init__(self, profile: CpuProfile, cores: int) -> None:
        self._profile = profile
        self._cores = cores

    def collect(self) -> Iterator[Metric]:
        cpu = CounterMetricFamily(
            "scalerl_process_cpu_seconds",
            "CPU seconds (user + system, every thread) of each process of the run.",
            labels=["process"],
        )
        for name, seconds in self._profile.seconds().items():
            cpu.add_metric([name], seconds)
        yield cpu
        yield GaugeMetricFamily(
            "scalerl_machine_cores", "CPU cores the run's processes share.", value=self._cores
        )
