"""Multi-turn trajectories on the worker's engine, held by the actor like a request.

Each trajectory of a group runs `scalerl.agents.trajectory.run_trajectory` on a thread of
the actor's pool: a model turn is one engine request over the whole sequence so far, and
the environment's step (tool calls in the sandbox) runs on that thread too, so a slow tool
holds up its own trajectory only, never the engine's batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from rollout_service.engines.api import (
    ABORT,
    ABORTED,
    TRUNCATE,
    Completion,
    GenerationRequest,
    GenerationStream,
    RolloutEngine,
)
from scalerl.agents.chat import TurnTemplate
from scalerl.agents.environment import Environment
from scalerl.agents.trajectory import Trajectory, TurnLimits, run_trajectory

log = logging.getLogger(__name__)

# A turn's chunks come every decode step; this long without one, the turn has failed.
CHUNK_TIMEOUT_S = 300.0


class TrajectoryStream:
    """One trajectory in flight. request: the template of every turn's request (sampling
    settings and length control; its request id is the trajectory's, a turn's is
    `{id}-t{turn}`; its prompt and max_new_tokens are each turn's own). `finished` is set
    when it ended; `result()` is its `Trajectory`.

    `truncate()` ends it after the current turn, whose thinking is interrupted (Interrupt
    TRUNCATE of the trajectory); `cancel()` ends it now (ABORT)."""

    def __init__(
        self,
        engine: RolloutEngine,
        env: Environment,
        template: TurnTemplate,
        limits: TurnLimits,
        request: GenerationRequest,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.engine = engine
        self.request = request
        self.request_id = request.request_id
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self._turn: GenerationStream | None = None
        self._ending = ""  # "", "truncate" or "abort"
        self._future: Future[Trajectory] = pool.submit(self._run, env, template, limits)
        self._future.add_done_callback(lambda _: self.finished.set())

    def finished_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once the trajectory ended (at once if it has)."""
        self._future.add_done_callback(lambda _: callback())

    def result(self) -> Trajectory:
        """The finished trajectory (blocks until it ends; an engine failure ends it
        ABORTED with the turns so far, an environment that did not open gives one with
        no prompt, ABORTED, its `error` saying why)."""
        return self._future.result()

    def truncate(self) -> bool:
        """End after the current turn (its thinking interrupted); False if it had ended."""
        return self._end("truncate", TRUNCATE)

    def cancel(self) -> bool:
        """End now: the current turn is aborted; False if it had ended."""
        return self._end("abort", ABORT)

    def _end(self, how: str, mode: int) -> bool:
        if self.finished.is_set():
            return False
        with self._lock:
            self._ending = self._ending or how
            turn = self._turn
        if turn is not None:
            self.engine.interrupt(turn.request_id, mode)
        return True

    def _run(self, env: Environment, template: TurnTemplate, limits: TurnLimits) -> Trajectory:
        try:
            trajectory = run_trajectory(
                env,
                template,
                self._generate,
                limits,
                self.engine.max_seq_len,
                stop_after_turn=lambda: bool(self._ending),
            )
        except Exception as exc:  # the environment's opening failed: no prompt, no turn
            log.warning("trajectory %s: the environment did not open: %s", self.request_id, exc)
            return Trajectory([], finish_reason=ABORTED, error=f"environment: {exc}")
        if self._ending == "abort":  # cancelled: even a turn that ended first is cut short
            trajectory.finish_reason = ABORTED
        return trajectory

    def _generate(self, ids: Sequence[int], max_new_tokens: int, turn: int) -> Completion:
        request = replace(
            self.request,
            request_id=f"{self.request_id}-t{turn}",
            prompt_ids=tuple(ids),
            max_new_tokens=max_new_tokens,
            seed=None if self.request.seed is None else self.request.seed + turn,
            keep_cache=True,  # the next turn continues this sequence: prefill only its news
        )
        with self._lock:
            if self._ending == "abort":
                return Completion(request.request_id, len(ids), finish_reason=ABORTED)
            self._turn = stream = self.engine.submit(request)
            ending = self._ending
        if ending == "truncate":
            self.engine.interrupt(stream.request_id, TRUNCATE)
        return stream.result(timeout=CHUNK_TIMEOUT_S)


class TrajectoryTable:
    """The worker's trajectories in flight, by id, so the Interrupt RPC can end one:
    TRUNCATE ends it after its current turn (whose thinking is interrupted), ABORT ends
    it now. A turn's own id (`{id}-t{turn}`) is the engine's to interrupt: the turn alone.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, TrajectoryStream] = {}

    def add(self, stream: TrajectoryStream) -> None:
        with self._lock:
            self._streams[stream.request_id] = stream
        stream.finished_callback(lambda: self._remove(stream.request_id))

    def interrupt(self, trajectory_id: str, mode: int) -> bool | None:
        """End a trajectory (`mode` TRUNCATE or ABORT): True if it was running, False if it
        had just ended, None when no trajectory has that id."""
        with self._lock:
            stream = self._streams.get(trajectory_id)
        if stream is None:
            return None
        return stream.truncate() if mode == TRUNCATE else stream.cancel()

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)

    def _remove(self, trajectory_id: str) -> None:
        with self._lock:
            self._streams.pop(trajectory_id, None)
