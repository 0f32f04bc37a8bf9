"""`VerifierPool`: score completions off the caller's thread, so verification does not
block generation. The checks themselves run where their verifier puts them (worker
processes for `math` and `python:`, a sandbox subprocess for `code`); the pool's threads
wait for them, and its bound on pending work gives back-pressure instead of a growing queue.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from scalerl.verifiers.base import Verdict, Verifier


class VerifierPool:
    """Asynchronous scoring with one verifier.

    threads: checks in flight at once (1..256); max_pending: submitted and not finished
    (>= threads), past which `submit` waits. Futures never raise: `Verifier.score` turns
    every failure into a counted reward of 0. Raises ValueError for a bound out of range.
    """

    def __init__(self, verifier: Verifier, threads: int = 4, max_pending: int = 256) -> None:
        if not 1 <= threads <= 256:
            raise ValueError(f"threads must be in [1, 256], got {threads}")
        if max_pending < threads:
            raise ValueError(f"max_pending must be >= threads ({threads}), got {max_pending}")
        self.verifier = verifier
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"verify-{verifier.name}")
        self._slots = threading.BoundedSemaphore(max_pending)

    def submit(self, completion: str, answer: Any, prompt: str = "") -> Future[Verdict]:
        """Schedule one completion (`prompt`: the text it answers, for a judge); blocks
        while `max_pending` are unfinished."""
        self._slots.acquire()
        try:
            future = self._executor.submit(self.verifier.score, completion, answer, prompt)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def score_many(self, items: Iterable[tuple[str, Any]]) -> list[Verdict]:
        """Verdicts of (completion, answer) pairs, in order."""
        futures = [self.submit(completion, answer) for completion, answer in items]
        return [future.result() for future in futures]

    def close(self) -> None:
        """Wait for the pending checks, then stop the threads."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
