"""gRPC `scalerl.v1.RewardService`: each Score call is checked, queued, and scored in a
batch with the calls queued beside it (`Batcher`): one forward pass of at most
`max_batch` items, started when the batch is full or `wait_s` after its first item came.
A full queue answers RESOURCE_EXHAUSTED (the caller retries with back-off), never a wait
without bound; a call whose deadline passes while it waits is answered DEADLINE_EXCEEDED
by gRPC and its items are scored anyway (nothing else is lost)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from scalerl.rpc.errors import InvalidArgument, ResourceExhausted
from scalerl.rpc.security import Security
from scalerl.rpc.server import make_server
from scalerl.rpc.services import REWARD
from scalerl.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)
MAX_ITEMS = 256
MAX_TEXT_BYTES = 4 << 20


class Scorer(Protocol):
    """What the servicer scores with (`reward_service.scorer.RewardScorer`)."""

    name: str

    def score(self, items: list[tuple[str, str]]) -> tuple[list[float], list[bool]]: ...


@dataclass
class _Call:
    items: list[tuple[str, str]]
    done: Future[tuple[list[float], int]]  # (scores, items cut to the model's max length)


class Batcher:
    """Scores queued calls in batches on one thread (module doc). max_batch: items per
    forward pass (1..4096); wait_s: how long a batch waits to fill (0..1 s); queue: items
    waiting at most (>= max_batch). Counters: `items`, `batches`, `refused`.

    Raises ValueError for a bound out of range."""

    def __init__(
        self, scorer: Scorer, max_batch: int = 32, wait_s: float = 0.005, queue: int = 4096
    ) -> None:
        if not (1 <= max_batch <= 4096 and 0 <= wait_s <= 1 and queue >= max_batch):
            raise ValueError(
                f"max_batch must be in [1, 4096], wait_s in [0, 1] and queue >= max_batch, "
                f"got {max_batch}, {wait_s}, {queue}"
            )
        self.scorer, self.max_batch, self.wait_s, self.queue = scorer, max_batch, wait_s, queue
        self.items = self.batches = self.refused = 0
        self._calls: list[_Call] = []
        self._waiting = 0
        self._ready = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="reward-batcher", daemon=True)
        self._thread.start()

    def submit(self, items: list[tuple[str, str]]) -> Future[tuple[list[float], int]]:
        """Queue one call's items; its future gives (scores, truncated). Raises
        ResourceExhausted when the queue cannot take them."""
        call = _Call(items, Future())
        with self._ready:
            if self._waiting + len(items) > self.queue:
                self.refused += 1
                raise ResourceExhausted(f"{self._waiting} items queued: try again")
            self._calls.append(call)
            self._waiting += len(items)
            self._ready.notify()
        return call.done

    def stop(self) -> None:
        """Score what is queued, then end the thread."""
        with self._ready:
            self._stopped = True
            self._ready.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._score(batch)

    def _next_batch(self) -> list[_Call] | None:
        """Whole calls of at most max_batch items (a larger call alone), once full or
        wait_s after the first arrived; None once stopped with nothing queued."""
        with self._ready:
            while not self._calls:
                if self._stopped:
                    return None
                self._ready.wait()
            filled_by = time.monotonic() + self.wait_s
            while self._waiting < self.max_batch and not self._stopped:
                left = filled_by - time.monotonic()
                if left <= 0:
                    break
                self._ready.wait(left)
            batch: list[_Call] = []
            count = 0
            while self._calls and (
                not batch or count + len(self._calls[0].items) <= self.max_batch
            ):
                call = self._calls.pop(0)  # whole calls: a call's items share one pass
                batch.append(call)
                count += len(call.items)
            self._waiting -= count
            return batch

    def _score(self, batch: list[_Call]) -> None:
        items = [item for call in batch for item in call.items]
        try:
            scores, truncated = self.scorer.score(items)
        except Exception as exc:  # noqa: BLE001 - every waiting call learns why
            log.exception("reward model failed on a batch of %d items", len(items))
            for call in batch:
                call.done.set_exception(exc)
            return
        self.items += len(items)
        self.batches += 1
        start = 0
        for call in batch:
            end = start + len(call.items)
            call.done.set_result((scores[start:end], sum(truncated[start:end])))
            start = end


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Score through a `Batcher`; INVALID_ARGUMENT naming the field for no items, too many
    or too much text."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher

    def Score(self, request: reward_pb2.ScoreRequest, context: Any) -> reward_pb2.ScoreResponse:
        items = [(item.prompt, item.completion) for item in request.items]
        if not items:
            raise InvalidArgument("items", "at least one item is required")
        if len(items) > MAX_ITEMS:
            raise InvalidArgument("items", f"at most {MAX_ITEMS}, got {len(items)}")
        if sum(len(p.encode()) + len(c.encode()) for p, c in items) > MAX_TEXT_BYTES:
            raise InvalidArgument("items", f"at most {MAX_TEXT_BYTES} bytes of text together")
        done = self.batcher.submit(items)
        remaining = context.time_remaining() if context is not None else None
        try:
            scores, truncated = done.result(timeout=remaining)
        except TimeoutError:  # the caller has gone: gRPC already told it so
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "not scored within the deadline")
        return reward_pb2.ScoreResponse(
            scores=scores, model=self.batcher.scorer.name, truncated=truncated
        )


def serve(
    servicer: RewardServicer,
    port: int = 0,
    host: str = "127.0.0.1",
    security: Security | None = None,
    threads: int = 64,
) -> tuple[grpc.Server, int]:
    """Start the service of `servicer` on host:port (0 = a free port); `threads`: calls
    waiting on their batch at once. Returns (server, bound port); raises RuntimeError when
    the port cannot be bound."""
    registration = (REWARD.add_to_server, servicer, REWARD.name)
    server, bound, _ = make_server(
        [registration], port=port, host=host, max_workers=threads + 4, security=security
    )
    return server, bound
