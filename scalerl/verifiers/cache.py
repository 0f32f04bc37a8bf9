"""`VerdictCache`: verdicts of a check that calls a service (a judge, a reward model), kept by
what determines them, so a group's repeated completions and a completion scored again cost
one call, and concurrent calls for the same key share it."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from scalerl.verifiers.base import Verdict


def cache_key(*parts: Any) -> str:
    """A key of JSON-able `parts` (sha256 of their JSON)."""
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


class VerdictCache:
    """A bounded LRU of verdicts by key, where a key being computed is shared: the first
    caller computes it, concurrent callers wait for its result. Only scored verdicts are
    kept (an unscored one is computed again next time)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._done: OrderedDict[str, Verdict] = OrderedDict()
        self._running: dict[str, Future[Verdict]] = {}
        self._lock = threading.Lock()

    def get_or_compute(self, key: str, compute: Callable[[], Verdict]) -> tuple[Verdict, bool]:
        """(the verdict of `key`, whether it came from the cache or a concurrent call);
        `compute()` runs at most once per key at a time. Its exception is re-raised to
        every waiter."""
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key], True
            running = self._running.get(key)
            mine: Future[Verdict] = Future()
            if running is None:
                self._running[key] = mine
        if running is not None:
            return running.result(), True
        try:
            verdict = compute()
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._running.pop(key, None)
        mine.set_result(verdict)
        if self.size and not verdict.unscored:
            with self._lock:
                self._done[key] = verdict
                while len(self._done) > self.size:
                    self._done.popitem(last=False)
        return verdict, False
