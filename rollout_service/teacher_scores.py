"""A rollout worker's side of on-policy distillation: `TeacherScores` has each finished
group's sampled tokens scored by one of the run's teacher workers (`rollout_service.
teacher`), off the actor's thread, within a deadline; `TeacherUnavailable` when none did.
Torch-free: the actor imports it."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from scalerl.rpc.clients.teacher import TeacherClient
from scalerl.rpc.errors import InvalidArgument, ServiceError


class TeacherUnavailable(Exception):
    """No teacher scored a group within its deadline (or one refused it): the group is
    dead-lettered (teacher_unavailable), never trained on without its scores."""


class TeacherScores:
    """A worker's side of distillation: each finished group's sequences scored by one of
    the run's teacher workers (the teachers' registry, round robin), off the actor's
    thread. A teacher that is down, busy or slow is left for the next one, with back-off,
    until `deadline_s` after the group was submitted; a request a teacher refuses
    (INVALID_ARGUMENT: a sequence past its max_seq_len) is not retried."""

    def __init__(self, registry: Any, deadline_s: float, threads: int = 4) -> None:
        self.registry, self.deadline_s = registry, deadline_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="teacher")
        self._turn = 0
        self.tokens = 0  # read by the teachers' forward passes, for compute accounting

    def submit(self, sequences: list[tuple[list[int], list[int]]]) -> Future[list[list[float]]]:
        """A Future of the per-token scores of `sequences` (an empty completion's: []);
        its result raises TeacherUnavailable."""
        return self._pool.submit(self.score, sequences)

    def score(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Raises TeacherUnavailable (the class doc)."""
        asked = [i for i, (_, completion) in enumerate(sequences) if completion]
        if not asked:
            return [[] for _ in sequences]
        deadline = time.monotonic() + self.deadline_s
        pause, last = 0.1, "no teacher is registered"
        while True:
            teachers = sorted(self.registry.workers().values())
            if teachers:
                address = teachers[self._turn % len(teachers)]
                self._turn += 1
                left = deadline - time.monotonic()
                try:
                    with TeacherClient(address, max(left, 0.001)) as client:
                        scores, tokens = client.score([sequences[i] for i in asked])
                except InvalidArgument as exc:
                    raise TeacherUnavailable(f"the teacher at {address} refused: {exc}") from None
                except (ServiceError, RuntimeError) as exc:
                    last = f"{address}: {exc}"
                else:
                    self.tokens += tokens
                    out: list[list[float]] = [[] for _ in sequences]
                    for i, score in zip(asked, scores, strict=True):
                        out[i] = score
                    return out
            if time.monotonic() + pause > deadline:
                raise TeacherUnavailable(
                    f"no teacher scored the group within {self.deadline_s:g} s: {last}"
                )
            time.sleep(pause)
            pause = min(2 * pause, 5.0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
