"""The rollout engine contract: what the gRPC servicer, the actor loop, the weight receiver
and the worker rely on, whichever engine (torch, vLLM, SGLang) serves. Torch-free.

Every engine, checked by the engine contract suite (tests/contract/engine_contract.py):

- takes a `GenerationRequest` in `submit` and streams `Chunk`s of parallel lists (token,
  log-prob, policy version, forced flag) into the request's `GenerationStream`; the last
  chunk carries the finish reason (STOP, LENGTH, INTERRUPTED, ABORTED);
- reports for every sampled token its log-prob under the distribution actually sampled
  from: softmax(logits / T) restricted to the top-p nucleus and renormalised (Holtzman et
  al. 2020, Sec. 3.1); for T = 0 (greedy) log softmax of the untempered logits;
- stamps every token with the policy version of the weights that computed its logits;
- applies interruption-based length control (ScaleRL, Khatri et al. 2025, Sec. 3.1; the
  decisions are `rollout_service.engines.length_control`): after `thinking_budget` sampled
  tokens without a stop token, or on a TRUNCATE, the interrupt phrase is forced
  (forced=True, log-prob under the plain untempered softmax), then at most
  `answer_budget` more tokens are sampled; a model that samples its end-of-thinking
  marker first is never interrupted;
- ends a request ABORTED on an ABORT (or when the engine stops);
- swaps in new weights while requests run (PipelineRL-style in-flight update: running
  requests keep their KV cache and later tokens carry the new version); a weight update
  that fails validation changes nothing.

Errors are `scalerl.rpc.errors.ServiceError`s, so the one gRPC error interceptor maps them
without the servicer catching anything: a bad request field is `InvalidArgument`, a
request id still running `DuplicateRequestError` (ALREADY_EXISTS), a call on a stopping
engine `EngineStopped` (UNAVAILABLE) and a failure of the engine `EngineError` (INTERNAL).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Protocol, cast, runtime_checkable

from scalerl.rpc.errors import AlreadyExists, InvalidArgument, ServiceError, Unavailable
from scalerl.v1 import rollout_pb2
from scalerl.weights.sink import WeightSink

STOP = rollout_pb2.FINISH_REASON_STOP
LENGTH = rollout_pb2.FINISH_REASON_LENGTH
INTERRUPTED = rollout_pb2.FINISH_REASON_INTERRUPTED
ABORTED = rollout_pb2.FINISH_REASON_ABORTED
TRUNCATE = rollout_pb2.INTERRUPT_MODE_TRUNCATE
ABORT = rollout_pb2.INTERRUPT_MODE_ABORT
MAX_TEMPERATURE = 5.0


class EngineError(ServiceError, RuntimeError):
    """The engine failed while serving a request or applying weights (INTERNAL)."""


class DuplicateRequestError(AlreadyExists):
    """A request with the same request_id is still running or waiting."""


class EngineStopped(Unavailable):
    """The engine is stopping or stopped: it takes no more requests or weights."""

    def __init__(self, message: str = "the engine is stopped") -> None:
        super().__init__(message)


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to generate.

    temperature: 0 (greedy) .. 5; top_p in (0, 1]; seed: the request's own generator seed
    (None = random); max_new_tokens: upper bound on completion tokens, forced included;
    thinking_budget: sampled tokens before the interrupt phrase is forced (0 = off);
    answer_budget: sampled tokens allowed after the phrase (0 = bounded by max_new_tokens
    only); interrupt_ids: the tokens forced at the interrupt (the phrase, then the
    end-of-thinking marker when the model has one); think_end_ids: the end-of-thinking
    marker: once the model samples it, its thinking is over and the phrase is never
    forced (empty = no marker, the budget alone decides). adapter: a LoRA adapter the
    engine serves by that name ("" = the run's policy: its adapter in a LoRA run).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    thinking_budget: int = 0
    answer_budget: int = 0
    interrupt_ids: tuple[int, ...] = ()
    think_end_ids: tuple[int, ...] = ()
    keep_cache: bool = False
    adapter: str = ""


@dataclass
class Chunk:
    """Tokens emitted together, as parallel lists; finish_reason is set on the last chunk
    only (0 = FINISH_REASON_UNSPECIFIED otherwise). routed_experts: on the last chunk of
    an MoE model's request, where the engine records them (None otherwise): the experts
    every token the engine fed (the prompt's first to the last fed) was routed to."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    forced: list[bool]
    finish_reason: int = 0
    routed_experts: rollout_pb2.RoutedExperts | None = None

    @classmethod
    def empty(cls) -> Chunk:
        """A chunk without tokens (the last one of a request that ends between tokens)."""
        return cls([], [], [], [])


@dataclass
class Completion:
    """All chunks of one request joined."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)
    finish_reason: int = 0
    routed_experts: rollout_pb2.RoutedExperts | None = None


class GenerationStream:
    """Caller's handle on a submitted request: iterate it for `Chunk`s (the last one has a
    finish_reason), or call `result()` for the joined `Completion`. engine: the engine the
    request was submitted to (`cancel` interrupts it there)."""

    def __init__(self, engine: RolloutEngine, request: GenerationRequest) -> None:
        self._engine = engine
        self.request_id = request.request_id
        self.prompt_tokens = len(request.prompt_ids)
        self._queue: queue.Queue[Chunk | BaseException] = queue.Queue()
        self.finished = threading.Event()

    def next_chunk(self, timeout: float | None = None) -> Chunk:
        """The next chunk. Raises TimeoutError after `timeout` seconds without one,
        EngineError if the engine failed on this request, StopIteration when done."""
        if self.finished.is_set() and self._queue.empty():
            raise StopIteration
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty as exc:
            raise TimeoutError(f"no chunk for {self.request_id!r} in {timeout}s") from exc
        return self._checked(item)

    def poll(self) -> list[Chunk]:
        """Chunks available now, without waiting (empty when none). Raises EngineError if
        the engine failed on this request."""
        ready: list[Chunk] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return ready
            ready.append(self._checked(item))

    def chunks(self, timeout: float | None = None) -> Iterator[Chunk]:
        """Chunks until (and including) the last; `timeout` bounds the wait for each."""
        while True:
            try:
                chunk = self.next_chunk(timeout)
            except StopIteration:
                return
            yield chunk
            if chunk.finish_reason:
                return

    def __iter__(self) -> Iterator[Chunk]:
        return self.chunks()

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the request ends; `timeout` bounds each chunk's wait (seconds)."""
        done = Completion(self.request_id, self.prompt_tokens)
        for chunk in self.chunks(timeout):
            done.token_ids += chunk.token_ids
            done.logprobs += chunk.logprobs
            done.versions += chunk.versions
            done.forced += chunk.forced
            done.finish_reason = chunk.finish_reason or done.finish_reason
            done.routed_experts = chunk.routed_experts or done.routed_experts
        return done

    def cancel(self) -> bool:
        """Abort the request (ABORTED); False if it had already ended."""
        return self._engine.interrupt(self.request_id, ABORT)

    def truncate(self) -> bool:
        """Interrupt the request's thinking (TRUNCATE: the phrase is forced, then its
        answer); False if it had already ended."""
        return self._engine.interrupt(self.request_id, TRUNCATE)

    def put(self, item: Chunk | BaseException) -> None:
        """Engine side: deliver a chunk, or the exception the request failed with (the
        caller's next read raises EngineError from it). A finish reason or an exception
        ends the stream."""
        self._queue.put(item)
        if isinstance(item, BaseException) or item.finish_reason:
            self.finished.set()

    def _checked(self, item: Chunk | BaseException) -> Chunk:
        if isinstance(item, BaseException):
            raise EngineError(f"request {self.request_id!r} failed: {item}") from item
        return item


@runtime_checkable
class RolloutEngine(WeightSink, Protocol):
    """What the gRPC servicer, the actor loop and the worker use; the weight transports
    use its `WeightSink` part (policy_version, base_version, stage_weights,
    stage_weights_from_file, stage_adapter).

    name: "torch", "vllm" or "sglang" (reported by GetStatus). max_batch: concurrent
    sequences; max_seq_len: prompt + completion tokens per request; vocab_size: for input
    validation.
    """

    name: str
    max_batch: int
    max_seq_len: int
    vocab_size: int

    @property
    def active_requests(self) -> int:
        """Requests submitted and not yet finished."""
        ...

    @property
    def tokens_generated(self) -> int:
        """Completion tokens emitted since start, forced tokens included."""
        ...

    def start(self) -> None:
        """Start serving (idempotent)."""
        ...

    def stop(self, timeout: float = 10.0) -> None:
        """Stop; running requests end ABORTED, pending weight updates fail."""
        ...

    def submit(self, request: GenerationRequest) -> GenerationStream:
        """Queue a request; returns its stream at once. Raises InvalidArgument naming the
        bad field (`validate_request`), DuplicateRequestError, EngineStopped."""
        ...

    def interrupt(self, request_id: str, mode: int) -> bool:
        """TRUNCATE or ABORT a request; False when it is not running. Raises
        InvalidArgument for another mode."""
        ...


def finish_reason_enum(value: int) -> rollout_pb2.FinishReason:
    """A chunk's `finish_reason` as the proto enum it is one of. Raises ValueError for a
    value outside `FinishReason`."""
    rollout_pb2.FinishReason.Name(value)  # raises ValueError for an unknown value
    return cast(rollout_pb2.FinishReason, value)


def check_interrupt_mode(mode: int) -> None:
    """Raise InvalidArgument("mode", ...) unless `mode` is TRUNCATE or ABORT."""
    if mode not in (TRUNCATE, ABORT):
        raise InvalidArgument("mode", f"must be INTERRUPT_MODE_TRUNCATE or _ABORT, got {mode}")


def validate_request(
    request: GenerationRequest,
    vocab_size: int,
    max_seq_len: int,
    adapters: Collection[str] = (),
) -> None:
    """The request checks every engine makes in `submit` (same messages for all).
    adapters: the names of the adapters the engine serves beside the policy.

    Raises:
        InvalidArgument: naming the bad field: empty prompt, token ids outside
            0..vocab_size - 1, temperature outside [0, 5], top_p outside (0, 1],
            max_new_tokens < 1, prompt + max_new_tokens > max_seq_len, negative budgets,
            an adapter not among `adapters`.
    """
    if request.adapter and request.adapter not in adapters:
        raise InvalidArgument(
            "adapter",
            f"no adapter {request.adapter!r} is served here (served: "
            f"{', '.join(sorted(adapters)) or 'none'})",
        )
    ids = list(request.prompt_ids)
    if not ids:
        raise InvalidArgument("prompt_ids", "must hold at least one token")
    named = (
        ("prompt_ids", ids),
        ("interrupt_ids", request.interrupt_ids),
        ("think_end_ids", request.think_end_ids),
    )
    for name, values in named:
        bad = [t for t in values if not 0 <= int(t) < vocab_size]
        if bad:
            raise InvalidArgument(name, f"token id {bad[0]} outside 0..{vocab_size - 1}")
    temperature = request.temperature
    if math.isnan(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        allowed = f"must lie in [0, {MAX_TEMPERATURE}], got {temperature}"
        raise InvalidArgument("temperature", allowed)
    if not 0.0 < request.top_p <= 1.0:
        raise InvalidArgument("top_p", f"must lie in (0, 1], got {request.top_p}")
    if request.max_new_tokens < 1:
        raise InvalidArgument("max_new_tokens", f"must be >= 1, got {request.max_new_tokens}")
    if len(ids) + request.max_new_tokens > max_seq_len:
        raise InvalidArgument(
            "max_new_tokens",
            f"prompt ({len(ids)} tokens) + max_new_tokens ({request.max_new_tokens}) "
            f"must be <= max_seq_len {max_seq_len}",
        )
    for name in ("thinking_budget", "answer_budget"):
        if getattr(request, name) < 0:
            raise InvalidArgument(name, f"must be >= 0, got {getattr(request, name)}")
