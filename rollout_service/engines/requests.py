"""The request table every engine holds (composed, not inherited): the live requests by id,
how their chunks reach the caller (emit / finish / fail), and what every engine counts the
same way, with its Prometheus metrics (`rollout_service.metrics.RolloutMetrics`): tokens
emitted, time to first token, interruptions, finished requests by reason, active requests
and the policy version now serving (also the `v=` of the process's log lines).

Each engine keeps its own per-request state (slots, HTTP calls, vLLM phases) in a
subclass of `LiveRequest`; the table only needs the fields below. All methods are
thread-safe.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rollout_service.engines.api import (
    Chunk,
    DuplicateRequestError,
    EngineStopped,
    GenerationRequest,
    GenerationStream,
)
from rollout_service.metrics import RolloutMetrics
from scalerl.obs.logging import set_policy_version
from scalerl.rpc.errors import InvalidArgument
from scalerl.v1 import rollout_pb2


@dataclass(eq=False)  # identity semantics: engines find and remove entries by identity
class LiveRequest:
    """One submitted request as the table sees it. done: it finished or failed (nothing
    more reaches its stream)."""

    request: GenerationRequest
    stream: GenerationStream
    submitted_s: float = field(default_factory=time.monotonic)
    first_token: bool = False
    done: bool = False


Entry = TypeVar("Entry", bound=LiveRequest)


class RequestTable(Generic[Entry]):
    """Live requests by id and the engine's counters. metrics: a `RolloutMetrics` or None;
    policy_version: the version serving at start."""

    def __init__(self, metrics: RolloutMetrics | None = None, policy_version: int = 0) -> None:
        self._metrics = metrics
        self._lock = threading.Lock()
        self._live: dict[str, Entry] = {}
        self._closed = False
        self._tokens = 0
        self._version = policy_version
        self._newest_accepted = policy_version  # serving or staged, whichever is newer
        self.serve(policy_version)

    # ----- counters --------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Version of the weights now serving."""
        return self._version

    @property
    def tokens_generated(self) -> int:
        """Completion tokens emitted since start, forced tokens included."""
        return self._tokens

    def __len__(self) -> int:
        """Requests submitted and not yet finished."""
        with self._lock:
            return len(self._live)

    def serve(self, version: int) -> None:
        """Record that the weights of `version` now serve (metric and log context)."""
        self._version = version
        set_policy_version(version)
        if self._metrics is not None:
            self._metrics.policy_version.set(version)

    def accept_version(self, version: int) -> None:
        """Admit a weight update labelled `version` (call it after the tensors passed
        validation, before staging): versions never go backwards, so an update older than
        the one serving or already staged is refused with InvalidArgument("version", ...)
        and nothing changes. The same version again (a re-push) is accepted."""
        with self._lock:
            newest = max(self._version, self._newest_accepted)
            if version < newest:
                raise InvalidArgument(
                    "version",
                    f"{version} is older than version {newest} already serving or staged; "
                    f"a weight update must be >= {newest}",
                )
            self._newest_accepted = version

    def count_interrupt(self, reason: str) -> None:
        """Count an interruption: "thinking_budget" or "truncate" (the phrase is forced)
        or "abort"."""
        if self._metrics is not None:
            self._metrics.interruptions.labels(reason=reason).inc()

    # ----- membership ------------------------------------------------------------------

    def add(self, entry: Entry) -> None:
        """Register a submitted request. Raises DuplicateRequestError when its id is still
        live, EngineStopped once the table is closed."""
        request_id = entry.request.request_id
        with self._lock:
            if self._closed:
                raise EngineStopped()
            if request_id in self._live:
                raise DuplicateRequestError(f"request_id {request_id!r} is already running")
            self._live[request_id] = entry
            self._set_active_gauge()

    def get(self, request_id: str) -> Entry | None:
        """The live entry of `request_id`, or None when none is running or waiting."""
        with self._lock:
            return self._live.get(request_id)

    def entries(self) -> list[Entry]:
        """The live entries now, in submission order."""
        with self._lock:
            return list(self._live.values())

    def close(self) -> list[Entry]:
        """Refuse further requests (`add` raises EngineStopped); returns the live ones."""
        with self._lock:
            self._closed = True
            return list(self._live.values())

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        return self._closed

    # ----- delivery --------------------------------------------------------------------

    def emit(self, entry: Entry, chunk: Chunk) -> None:
        """Deliver a chunk of a running request (dropped once it is done)."""
        with self._lock:
            if entry.done:
                return
        self._deliver(entry, chunk)

    def finish(self, entry: Entry, chunk: Chunk, reason: int) -> bool:
        """Deliver the last chunk with finish `reason` and forget the request. Returns
        False (and delivers nothing) when it had already ended."""
        if not self._end(entry):
            return False
        chunk.finish_reason = reason
        if self._metrics is not None:
            name = rollout_pb2.FinishReason.Name(reason)
            self._metrics.requests_finished.labels(finish_reason=name).inc()
        self._deliver(entry, chunk)
        return True

    def fail(self, entry: Entry, exc: BaseException) -> bool:
        """End the request with `exc` (its stream raises EngineError from it). Returns
        False when it had already ended."""
        if not self._end(entry):
            return False
        entry.stream.put(exc)
        return True

    def _end(self, entry: Entry) -> bool:
        with self._lock:
            if entry.done:
                return False
            entry.done = True
            if self._live.get(entry.request.request_id) is entry:
                del self._live[entry.request.request_id]
            self._set_active_gauge()
            return True

    def _deliver(self, entry: Entry, chunk: Chunk) -> None:
        count = len(chunk.token_ids)
        with self._lock:
            self._tokens += count
        if self._metrics is not None and count:
            self._metrics.tokens_generated.inc(count)
            if not entry.first_token:
                self._metrics.time_to_first_token.observe(time.monotonic() - entry.submitted_s)
        entry.first_token = entry.first_token or count > 0
        entry.stream.put(chunk)

    def _set_active_gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.active_requests.set(len(self._live))
