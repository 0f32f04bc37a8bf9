"""Worker processes for checks that may hang or blow up: `math` and `python:` verifiers.

A check runs in a worker process (started with "spawn": the caller may be a threaded gRPC
process, where fork is unsafe) under a memory limit; past its time limit the worker is
killed and replaced (pebble's ProcessPool), so a pathological expression costs one worker,
never a thread of the caller. Pools are shared per (workers, memory limit) within a process.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import resource
import threading
from collections.abc import Callable
from typing import Any

from scalerl.verifiers.base import VerifierTimeout

DEFAULT_WORKERS = 2
DEFAULT_MEMORY_BYTES = 2 << 30

_shared: dict[tuple[int, int], WorkerPool] = {}
_shared_lock = threading.Lock()


def _init_worker(memory_bytes: int) -> None:
    """In each worker: cap its address space, so a huge expression raises MemoryError
    instead of taking the host's memory; silence math-verify's "timeout disabled" warning
    (the pool enforces the time limit)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    logging.getLogger("math_verify").setLevel(logging.ERROR)


class WorkerPool:
    """A bounded pool of worker processes running module-level functions with a timeout.

    workers: processes (1..64); memory_bytes: address-space limit of each (64 MiB..1 TiB).
    Raises ValueError for a bound out of range, or when pebble (the `verifiers` extra) is
    missing at the first call.
    """

    def __init__(
        self, workers: int = DEFAULT_WORKERS, memory_bytes: int = DEFAULT_MEMORY_BYTES
    ) -> None:
        if not 1 <= workers <= 64:
            raise ValueError(f"workers must be in [1, 64], got {workers}")
        if not 64 << 20 <= memory_bytes <= 1 << 40:
            raise ValueError(f"memory_bytes must be in [64 MiB, 1 TiB], got {memory_bytes}")
        self.workers, self.memory_bytes = workers, memory_bytes
        self._pool = None
        self._lock = threading.Lock()

    @classmethod
    def shared(
        cls, workers: int = DEFAULT_WORKERS, memory_bytes: int = DEFAULT_MEMORY_BYTES
    ) -> WorkerPool:
        """The process-wide pool of these bounds (started on its first call, closed at exit)."""
        with _shared_lock:
            key = (workers, memory_bytes)
            if key not in _shared:
                _shared[key] = cls(workers, memory_bytes)
            return _shared[key]

    def call(self, function: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """`function(*args)` in a worker; its result, or its exception re-raised here.

        Raises VerifierTimeout when it runs past `timeout_s` seconds (counted from its start
        in a worker, not from the queue), RuntimeError when the worker died (crash, kill).
        """
        from pebble import ProcessExpired

        future = self._started().schedule(function, args=args, timeout=timeout_s)
        try:
            return future.result()
        except TimeoutError:
            raise VerifierTimeout(f"timed out after {timeout_s:g} s") from None
        except ProcessExpired as exc:
            raise RuntimeError(f"verifier worker died (exit code {exc.exitcode})") from None

    def close(self) -> None:
        """Stop the workers (a later call starts new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()

    def _started(self):
        with self._lock:
            if self._pool is None:
                try:
                    from pebble import ProcessPool
                except ImportError:
                    raise ValueError(
                        "verifier worker processes need pebble: pip install 'scalerl[verifiers]'"
                    ) from None
                self._pool = ProcessPool(
                    max_workers=self.workers,
                    initializer=_init_worker,
                    initargs=(self.memory_bytes,),
                    context=multiprocessing.get_context("spawn"),
                )
            return self._pool


@atexit.register
def _close_shared() -> None:
    for pool in list(_shared.values()):
        pool.close()
