"""Lending the learner's idle cores to generation (`learner.lend_idle: workers`).

On a machine that `scalerl run` splits between the learner and its rollout workers
(`scalerl.cores`), the learner's cores idle whenever it waits for groups or for an
evaluation: on 2 CPU cores about 40% of the learner's time. Intra-op threads do not use
them well (a second torch thread in the worker decodes the default job's 64 rows
1.05-1.1x faster), a second generator does (2x while it runs). So the launcher starts
*lender workers*, ordinary rollout workers pinned to the learner's cores, each behind a
gate the learner holds:

- the learner opens the gate when it starts to wait (`Lender.lend`) and closes it when
  it has work (`Lender.reclaim`); it then waits until every lender has left its engine
  step, which is at most one decode step, before it computes (bounded by `deadline_s`;
  an overrun is counted, never waited out);
- a lender's engine passes the gate before each step (`Borrower.enter`) and leaves it
  after (`Borrower.leave`); with the gate closed it blocks between steps, polling every
  BLOCKED_POLL_S, so its requests wait and its rows keep their KV cache;
- the whole lender process runs at SCHED_IDLE (`scalerl.cores.idle_priority_from_env`),
  so its other threads (weight fetches, verifiers, gRPC) and the one decode step after a
  reclaim yield the core to the learner's threads, its background publisher included.

Never more busy threads than cores: while lent the learner computes nothing; while
reclaimed no lender steps (`scalerl.cores.CorePlan.busy_threads`).

The gate is a small shared file (mmap) in the run folder: int64 words, word 0 the lend
sequence (odd: lent, even: reclaimed; the learner its only writer), word 1 + i lender
i's step mark (the sequence it entered a step under, or IDLE; lender i its only writer).
A lender that saw an old odd sequence may start one more step after a reclaim: the
learner's wait for IDLE marks covers it. Torch-free: the learner, the workers and the
launcher share it.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

GATE_ENV = "SCALERL_LEND_GATE"  # the gate file of the run (launcher -> learner, lenders)
SLOT_ENV = "SCALERL_LEND_SLOT"  # a lender's slot in it (launcher -> lender)
IDLE = -1  # a lender's mark outside an engine step
RECLAIM_POLL_S = 0.002  # how often a reclaiming learner looks at the lenders' marks
# How often a lender blocked at the closed gate looks at it: each look wakes a thread on
# the learner's core (at SCHED_IDLE, but still a switch), so rarely; a lend is seconds long.
BLOCKED_POLL_S = 0.01
RECLAIM_DEADLINE_S = 2.0  # a reclaim waits this long for the lenders' marks at most
_WORD = struct.Struct("<q")


def create_gate(path: Path, lenders: int) -> Path:
    """Write a fresh gate for `lenders` lenders at `path`: reclaimed, every mark IDLE
    (the launcher, before any of them starts). Raises ValueError for lenders < 1."""
    if lenders < 1:
        raise ValueError(f"lenders must be >= 1, got {lenders}")
    data = _WORD.pack(0) + _WORD.pack(IDLE) * lenders
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


class _Gate:
    """The shared words of a gate file (module doc)."""

    def __init__(self, path: Path) -> None:
        with open(path, "r+b") as handle:
            self._map = mmap.mmap(handle.fileno(), 0)
        self.slots = len(self._map) // _WORD.size - 1
        if self.slots < 1:
            raise ValueError(f"{path} is not a lending gate (too short)")

    def read(self, index: int) -> int:
        return _WORD.unpack_from(self._map, index * _WORD.size)[0]

    def write(self, index: int, value: int) -> None:
        _WORD.pack_into(self._map, index * _WORD.size, value)


@dataclass
class LendStats:
    """What the learner lent to its `lenders`: seconds (wall, gate open), reclaims, the
    longest reclaim (seconds from closing the gate to every lender idle) and reclaims that
    hit the deadline."""

    lenders: int = 0
    lent_seconds: float = 0.0
    reclaims: int = 0
    max_reclaim_s: float = 0.0
    overruns: int = 0
    reclaim_seconds: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        """The run report's `profile.lending`."""
        done = sorted(self.reclaim_seconds)
        p99 = done[min(len(done) - 1, int(0.99 * len(done)))] if done else 0.0
        return {
            "lenders": self.lenders,
            "lent_seconds": round(self.lent_seconds, 1),
            "reclaims": self.reclaims,
            "reclaim_p99_s": round(p99, 4),
            "reclaim_max_s": round(self.max_reclaim_s, 4),
            "reclaim_overruns": self.overruns,
        }


class Lender:
    """The learner's side of a gate: `lent()` around every wait.

    on_reclaim: called with each reclaim's (seconds lent, seconds the reclaim waited),
    for metrics. deadline_s: the longest a
    reclaim waits for the lenders (a lender that hangs inside a step does not hold the
    learner; its core is shared for that long at most, the lender at SCHED_IDLE)."""

    def __init__(
        self,
        path: Path,
        on_reclaim: Callable[[float, float], None] | None = None,
        deadline_s: float = RECLAIM_DEADLINE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._gate = _Gate(Path(path))
        self._on_reclaim = on_reclaim
        self._deadline_s = deadline_s
        self._clock = clock
        self._lent_at: float | None = None
        self.stats = LendStats(lenders=self._gate.slots)
        # A learner started again takes its cores back from a gate its predecessor left open.
        if self.is_lent:
            self._gate.write(0, self._gate.read(0) + 1)

    @property
    def is_lent(self) -> bool:
        """The gate is open (the lend sequence is odd)."""
        return self._gate.read(0) % 2 == 1

    def lend(self) -> None:
        """Open the gate (a no-op when open)."""
        if not self.is_lent:
            self._gate.write(0, self._gate.read(0) + 1)
            self._lent_at = self._clock()

    def reclaim(self) -> float:
        """Close the gate and wait until no lender is inside a step (at most deadline_s);
        returns the seconds waited (0 when the gate was closed). An overrun is counted
        in `stats` and the learner goes on."""
        if not self.is_lent:
            return 0.0
        start = self._clock()
        self._gate.write(0, self._gate.read(0) + 1)
        lent_s = start - self._lent_at if self._lent_at is not None else 0.0
        self.stats.lent_seconds += lent_s
        self._lent_at = None
        while not self._all_idle():
            if self._clock() - start >= self._deadline_s:
                self.stats.overruns += 1
                break
            time.sleep(RECLAIM_POLL_S)
        waited = self._clock() - start
        self.stats.reclaims += 1
        self.stats.reclaim_seconds.append(waited)
        self.stats.max_reclaim_s = max(self.stats.max_reclaim_s, waited)
        if self._on_reclaim is not None:
            self._on_reclaim(lent_s, waited)
        return waited

    @contextmanager
    def lent(self) -> Iterator[None]:
        """Lend for the block (a wait), take the cores back at its end, however it ends."""
        self.lend()
        try:
            yield
        finally:
            self.reclaim()

    def _all_idle(self) -> bool:
        return all(self._gate.read(1 + i) == IDLE for i in range(self._gate.slots))


class Borrower:
    """A lender worker's side of a gate: its engine's loop calls `enter` before each step
    and `leave` after it."""

    def __init__(self, path: Path, slot: int) -> None:
        self._gate = _Gate(Path(path))
        if not 0 <= slot < self._gate.slots:
            raise ValueError(f"slot must be in [0, {self._gate.slots}), got {slot}")
        self._index = 1 + slot
        self._gate.write(self._index, IDLE)
        self._stepping = threading.Event()  # inside a step, for the busy accounting

    @property
    def lent(self) -> bool:
        """The learner lends its cores now."""
        return self._gate.read(0) % 2 == 1

    @property
    def stepping(self) -> bool:
        """The engine is inside a step it entered through the gate."""
        return self._stepping.is_set()

    def enter(self, stopping: Callable[[], bool]) -> bool:
        """Block until the gate is open, then mark this lender inside a step; False (and
        no mark) when `stopping()` turned true while blocked."""
        while True:
            seq = self._gate.read(0)
            if seq % 2 == 1:
                self._gate.write(self._index, seq)
                if self._gate.read(0) == seq:  # not reclaimed meanwhile
                    self._stepping.set()
                    return True
                self._gate.write(self._index, IDLE)
            if stopping():
                return False
            time.sleep(BLOCKED_POLL_S)

    def leave(self) -> None:
        """Mark this lender outside a step."""
        self._stepping.clear()
        self._gate.write(self._index, IDLE)


def check_lendable(lend_idle: str, device: str) -> None:
    """Raises ValueError naming `learner.lend_idle` when `workers` is asked of a learner
    on `device` other than the CPU: its cores, not its GPU, are what lenders borrow (on a
    GPU node the trainer's device would need an engine of its own beside training)."""
    if lend_idle == "workers" and device != "cpu":
        raise ValueError(
            f"learner.lend_idle: workers lends CPU cores; the learner computes on {device} "
            "(set lend_idle off)"
        )


def lender_from_env(
    environ: dict[str, str] | None = None,
    on_reclaim: Callable[[float, float], None] | None = None,
) -> Lender | None:
    """The learner's Lender when the launcher gave it a gate (`GATE_ENV`), else None."""
    path = (os.environ if environ is None else environ).get(GATE_ENV, "")
    return Lender(Path(path), on_reclaim) if path else None


def borrower_from_env(environ: dict[str, str] | None = None) -> Borrower | None:
    """A lender worker's Borrower when the launcher gave it a gate and a slot, else None.
    Raises ValueError for a malformed slot."""
    env = os.environ if environ is None else environ
    path, slot = env.get(GATE_ENV, ""), env.get(SLOT_ENV, "")
    if not path or not slot:
        return None
    try:
        index = int(slot)
    except ValueError:
        raise ValueError(f"{SLOT_ENV} must be an integer, got {slot!r}") from None
    return Borrower(Path(path), index)
