"""Torch inference engine: continuous batching over one slot KV cache.

One background thread owns the model and runs a loop of *steps*. Each step:

1. swaps in staged weights, if any (the decode-step boundary: in-flight sequences keep
   their KV cache, as in PipelineRL's in-flight weight update);
2. applies interrupts (ABORT, TRUNCATE) that arrived since the last step;
3. admits waiting requests into free slots and prefills them in ONE forward over a
   right-padded batch of their distinct prompts (G requests with the same prompt share a
   row; its KV is copied into the others' slots). Admission is in arrival order and stops
   before the distinct prompts, padded to the longest, would pass `max_prefill_tokens`
   (the first is always admitted), which bounds the prefill's memory;
4. forces the interrupt phrase for requests that asked for it (thinking budget reached,
   or a TRUNCATE), all of them in one batched extend;
5. feeds last step's sampled tokens to the model as one batch (one position per slot),
   then samples one token for every running request and emits it.

Every emitted token carries the policy version of the weights that computed the logits
it came from. Because step 1 precedes the forward of step 5, every token sampled after a
swap carries the new version.

Sampling (per request, with the request's own `torch.Generator`, so a request's samples
do not depend on its batch-mates): temperature T > 0 samples from softmax(logits / T),
restricted to the top-p nucleus and renormalised (Holtzman et al. 2020, Sec. 3.1), by
inverse-CDF with one uniform draw per token. The reported log-prob is that of the token
under this exact distribution. T = 0 is greedy: the token is the argmax and its
reported log-prob is log softmax(logits) at the argmax, i.e. under the untempered
distribution (the greedy "distribution" is a point mass whose log-prob, 0, says nothing).

Interruption-based length control (ScaleRL, Khatri et al. 2025, Sec. 3.1): after
`thinking_budget` sampled tokens without a stop token, the interrupt phrase (and the
end-of-thinking marker, when the model has one) is forced (forced=True, log-prob under the
plain untempered softmax), then at most `answer_budget` more tokens are sampled. A model
that samples its end-of-thinking marker (`think_end_ids`) before the budget has ended its
thinking by itself: it is never interrupted, and a later TRUNCATE only starts the answer
budget.
"""

from __future__ import annotations

import logging
import math
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as load_safetensors_file

from rollout_service.engines.torch.llama import SlotLlama
from scalerl.v1 import rollout_pb2

log = logging.getLogger(__name__)

STOP = rollout_pb2.FINISH_REASON_STOP
LENGTH = rollout_pb2.FINISH_REASON_LENGTH
INTERRUPTED = rollout_pb2.FINISH_REASON_INTERRUPTED
ABORTED = rollout_pb2.FINISH_REASON_ABORTED
TRUNCATE = rollout_pb2.INTERRUPT_MODE_TRUNCATE
ABORT = rollout_pb2.INTERRUPT_MODE_ABORT
MAX_TEMPERATURE = 5.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class EngineError(RuntimeError):
    """The engine failed while serving a request (the stream raises it)."""


class DuplicateRequestError(ValueError):
    """A request with the same request_id is still running or waiting."""


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
    forced (empty = no marker, the budget alone decides).
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


def closes_thinking(sampled: Sequence[int], think_end_ids: Sequence[int]) -> bool:
    """True when the sampled tokens end with the end-of-thinking marker (never without
    one). Called after every sampled token, so the marker is seen when it completes."""
    n = len(think_end_ids)
    return n > 0 and len(sampled) >= n and tuple(sampled[-n:]) == tuple(think_end_ids)


@dataclass
class Chunk:
    """Tokens emitted together, as parallel lists; finish_reason is set on the last chunk
    only (0 = FINISH_REASON_UNSPECIFIED otherwise)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    forced: list[bool]
    finish_reason: int = 0


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


class GenerationStream:
    """Caller's handle on a submitted request: iterate it for `Chunk`s (the last one has a
    finish_reason), or call `result()` for the joined `Completion`."""

    def __init__(self, engine: TorchEngine, request: GenerationRequest) -> None:
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
        if isinstance(item, BaseException):
            raise EngineError(f"request {self.request_id!r} failed: {item}") from item
        return item

    def poll(self) -> list[Chunk]:
        """Chunks available now, without waiting (empty when none). Raises EngineError if
        the engine failed on this request."""
        ready = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return ready
            if isinstance(item, BaseException):
                raise EngineError(f"request {self.request_id!r} failed: {item}") from item
            ready.append(item)

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
        return done

    def cancel(self) -> bool:
        """Abort the request (ABORTED); False if it had already ended."""
        return self._engine.interrupt(self.request_id, ABORT)

    def _put(self, item: Chunk | BaseException) -> None:
        self._queue.put(item)
        if isinstance(item, BaseException) or item.finish_reason:
            self.finished.set()


@dataclass(eq=False)  # identity semantics: found in and removed from queues by identity
class _Seq:
    """Engine-thread state of one request."""

    request: GenerationRequest
    stream: GenerationStream
    generator: torch.Generator | None
    submitted_s: float
    slot: int = -1
    length: int = 0  # tokens in the KV cache
    next_logits: torch.Tensor | None = None  # [vocab] fp32: distribution of the next token
    logits_version: int = 0
    unfed: int | None = None  # sampled token not yet in the KV cache
    sampled: int = 0  # sampled (non-forced) tokens so far
    generated: int = 0  # all completion tokens so far, forced included
    forced_at: int | None = None  # `sampled` when the phrase was forced
    want_force: str | None = None  # reason to force the phrase at the next step
    first_token: bool = False
    thought_closed: bool = False  # the model sampled its end-of-thinking marker
    tail: list[int] = field(default_factory=list)  # last sampled tokens (marker check)


@dataclass(eq=False)
class _Staged:
    staged: object
    version: int
    future: Future


class EngineBookkeeping:
    """What every engine counts the same way: the serving policy version, the live
    requests, the tokens emitted, and their Prometheus metrics. Subclasses set `_version`,
    `_lock` (a threading.Lock), `_live` (request_id -> state), `_tokens` and `_metrics`
    (a `RolloutMetrics` or None)."""

    _version: int
    _lock: threading.Lock
    _live: dict
    _tokens: int
    _metrics: object | None

    @property
    def policy_version(self) -> int:
        """Version of the weights now serving."""
        return self._version

    @property
    def active_requests(self) -> int:
        """Requests submitted and not yet finished."""
        with self._lock:
            return len(self._live)

    @property
    def tokens_generated(self) -> int:
        """Completion tokens emitted since start, forced tokens included."""
        return self._tokens

    def _count_interrupt(self, reason: str | None) -> None:
        if self._metrics is not None and reason is not None:
            self._metrics.interruptions.labels(reason=reason).inc()

    def _set_active_gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.active_requests.set(len(self._live))


class TorchEngine(EngineBookkeeping):
    """Continuous-batching generation over an HF Llama with a slot KV cache.

    model: an HF LlamaForCausalLM; the engine takes ownership (it is cast in place to
    `dtype` and its parameters are overwritten by weight updates). stop_token_ids: token
    ids that end a sequence when sampled. max_batch: KV-cache slots (concurrent sequences;
    others wait). max_seq_len: prompt + completion tokens per slot. dtype: "float32" or
    "bfloat16" body (the head is always fp32). metrics: an optional
    `rollout_service.metrics.RolloutMetrics`. autostart=False leaves the loop thread off
    so tests can drive `step()` by hand. max_prefill_tokens: token budget of one step's
    batched prefill, counted as distinct prompts x the longest of them (padding included);
    a single longer prompt is still admitted, alone. Raises ValueError for an unknown
    dtype, max_batch < 1, max_seq_len < 2 or max_prefill_tokens < 1.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        stop_token_ids: Iterable[int],
        max_batch: int = 64,
        max_seq_len: int = 512,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        policy_version: int = 0,
        metrics: object | None = None,
        autostart: bool = True,
        max_prefill_tokens: int = 2048,
    ) -> None:
        torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if torch_dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if max_batch < 1 or max_seq_len < 2:
            raise ValueError(
                f"max_batch must be >= 1 and max_seq_len >= 2, got {max_batch}, {max_seq_len}"
            )
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.llama = SlotLlama(model, max_batch, max_seq_len, torch_dtype, device)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.vocab_size = self.llama.vocab_size
        self.dtype = torch_dtype
        self._version = policy_version
        self._metrics = metrics
        self._tokens = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[_Seq] = deque()
        self._live: dict[str, _Seq] = {}
        self._controls: list[tuple[str, int]] = []
        self._staged: list[_Staged] = []
        self._active: dict[int, _Seq] = {}  # slot -> seq (engine thread only)
        self._free = list(range(max_batch - 1, -1, -1))
        self._stopping = False
        self._thread: threading.Thread | None = None
        if metrics is not None:
            metrics.policy_version.set(policy_version)
        if autostart:
            self.start()

    # ----- public API (any thread) -------------------------------------------------------

    def start(self) -> None:
        """Start the background loop (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; running and waiting requests end ABORTED, pending weight
        updates fail with EngineError."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._shutdown()

    def submit(self, request: GenerationRequest) -> GenerationStream:
        """Queue a request; returns its stream at once. Raises ValueError naming the bad
        field (ids outside the vocabulary, temperature outside [0, 5], top_p outside (0, 1],
        prompt + max_new_tokens > max_seq_len), DuplicateRequestError (a ValueError) for a
        request_id already running, and RuntimeError once the engine is stopping."""
        self._validate(request)
        stream = GenerationStream(self, request)
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        generator = None
        if request.temperature > 0:
            generator = torch.Generator().manual_seed(seed)
        seq = _Seq(request, stream, generator, time.monotonic())
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine is stopped")
            if request.request_id in self._live:
                raise DuplicateRequestError(f"request_id {request.request_id!r} is already running")
            self._live[request.request_id] = seq
            self._waiting.append(seq)
            self._set_active_gauge()
            self._wake.notify_all()
        return stream

    def interrupt(self, request_id: str, mode: int) -> bool:
        """TRUNCATE: force the interrupt phrase at the next step and start the answer budget
        (a no-op if the phrase was already forced). ABORT: end the request (ABORTED).
        Returns False when no running or waiting request has that id. Raises ValueError
        for another mode."""
        if mode not in (TRUNCATE, ABORT):
            raise ValueError(f"mode must be INTERRUPT_MODE_TRUNCATE or _ABORT, got {mode}")
        with self._wake:
            if request_id not in self._live:
                return False
            self._controls.append((request_id, mode))
            self._wake.notify_all()
        return True

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> Future:
        """Validate a full state dict and stage it; the loop copies it into the model at the
        next decode-step boundary. Returns a Future whose result is `version` once the new
        weights serve. Raises ValueError naming the first bad tensor (unknown, missing,
        wrong shape, non-float, non-finite); nothing changes then. Several updates staged
        before a boundary are applied in order at that boundary."""
        staged = self.llama.prepare_weights(state_dict)
        future: Future = Future()
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine is stopped")
            self._staged.append(_Staged(staged, int(version), future))
            self._wake.notify_all()
        return future

    def stage_weights_from_file(self, path: str, version: int) -> Future:
        """Stage the weights of one safetensors file with HF parameter names (what the
        learner publishes for the `uri` transport): read it, then as `stage_weights`.
        Raises ValueError for an unreadable or invalid file or a bad tensor; nothing
        changes then."""
        try:
            state_dict = load_safetensors_file(path)
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"payload: {path} is not a readable safetensors file: {exc}") from exc
        return self.stage_weights(state_dict, version)

    # ----- loop (engine thread) ----------------------------------------------------------

    def step(self) -> bool:
        """Run one loop iteration (see the module docstring). Returns False when there was
        nothing to do. Called by the loop thread; tests with autostart=False call it."""
        with self._lock:
            staged, self._staged = self._staged, []
            controls, self._controls = self._controls, []
        self._apply_weights(staged)
        for request_id, mode in controls:
            self._control(request_id, mode)
        with self._lock:  # after the controls, so an aborted waiting request is gone
            admitted = self._take_waiting()
        busy = bool(staged or controls or admitted or self._active)
        self._admit(admitted)
        forcing = [seq for seq in self._active.values() if seq.want_force]
        if forcing:
            self._force_phrases(forcing)
        if self._active:
            self._decode()
        return busy

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._has_work()):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:  # keep serving others: fail only the running requests
                log.exception("engine step failed; failing %d requests", len(self._active))
                for seq in list(self._active.values()):
                    self._fail(seq, exc)

    def _has_work(self) -> bool:
        return bool(self._active or self._waiting or self._controls or self._staged)

    def _take_waiting(self) -> list[_Seq]:
        """Requests to admit this step, in arrival order (caller holds the lock): one per
        free slot while the distinct prompts padded to the longest fit max_prefill_tokens.
        Stops at the first prompt that does not fit, so none is overtaken indefinitely."""
        taken: list[_Seq] = []
        distinct: set[tuple[int, ...]] = set()
        longest = 0
        while self._waiting and len(taken) < len(self._free):
            prompt = self._waiting[0].request.prompt_ids
            if prompt not in distinct:
                width = max(longest, len(prompt))
                if distinct and (len(distinct) + 1) * width > self.max_prefill_tokens:
                    break
                distinct.add(prompt)
                longest = width
            taken.append(self._waiting.popleft())
        return taken

    def _apply_weights(self, staged: list[_Staged]) -> None:
        for index, item in enumerate(staged):
            if not item.future.set_running_or_notify_cancel():
                continue  # the caller gave up waiting; never apply a cancelled update
            start = time.monotonic()
            try:
                self.llama.load_weights(item.staged)
            except Exception as exc:  # validated already; only a device fault lands here
                item.future.set_exception(exc)
                for later in staged[index + 1 :]:
                    if later.future.set_running_or_notify_cancel():
                        later.future.set_exception(exc)
                raise
            self._version = item.version
            item.future.set_result(item.version)
            log.info(
                "policy version %d now serving (swap %.3fs, %d running)",
                item.version,
                time.monotonic() - start,
                len(self._active),
            )
            if self._metrics is not None:
                self._metrics.policy_version.set(item.version)

    def _control(self, request_id: str, mode: int) -> None:
        seq = self._live.get(request_id)
        if seq is None or seq.stream.finished.is_set():
            return
        if mode == ABORT:
            self._count_interrupt("abort")
            if seq.slot < 0:  # still waiting for a slot
                with self._lock:
                    if seq in self._waiting:
                        self._waiting.remove(seq)
            self._finish(seq, Chunk([], [], [], []), ABORTED)
        elif seq.forced_at is None and seq.want_force is None:
            if seq.thought_closed:  # already answering: no phrase, the answer budget starts
                seq.forced_at = seq.sampled
            else:
                seq.want_force = "truncate"

    def _admit(self, seqs: list[_Seq]) -> None:
        """Prefill new requests: one batched forward over their distinct prompts, then the
        KV of each prompt is copied into the slots of the other requests sharing it."""
        for seq in seqs:  # all active first, so a failing prefill fails all of them
            seq.slot = self._free.pop()
            self._active[seq.slot] = seq
        first: dict[tuple[int, ...], _Seq] = {}
        for seq in seqs:
            first.setdefault(seq.request.prompt_ids, seq)
        sources = list(first.values())
        if sources:
            logits = self.llama.extend_batch(
                [seq.slot for seq in sources],
                [0] * len(sources),
                [seq.request.prompt_ids for seq in sources],
            )
            for seq, row in zip(sources, logits, strict=True):
                seq.next_logits = row
        for seq in seqs:
            prompt = seq.request.prompt_ids
            seq.length = len(prompt)
            seq.logits_version = self._version
            source = first[prompt]
            if source is not seq:
                self.llama.cache.copy_prefix(source.slot, seq.slot, len(prompt))
                seq.next_logits = source.next_logits

    def _force_phrases(self, seqs: list[_Seq]) -> None:
        """Append each request's interrupt phrase (as much as its max_new_tokens leaves room
        for), all rows in one batched extend; forced tokens get the plain (untempered)
        log-prob. The batch holds at most max_batch rows of 1 + len(phrase) tokens."""
        phrases = []
        for seq in seqs:
            reason, seq.want_force = seq.want_force, None
            seq.forced_at = seq.sampled
            self._count_interrupt(reason)
            request = seq.request
            phrases.append(list(request.interrupt_ids[: request.max_new_tokens - seq.generated]))
        rows = [(seq, phrase) for seq, phrase in zip(seqs, phrases, strict=True) if phrase]
        outputs = []
        if rows:
            outputs = self.llama.extend_batch(
                [seq.slot for seq, _ in rows],
                [seq.length for seq, _ in rows],
                [([seq.unfed] if seq.unfed is not None else []) + phrase for seq, phrase in rows],
                all_logits=True,
            )
        chunks: dict[int, Chunk] = {}  # by id(seq)
        for (seq, phrase), out in zip(rows, outputs, strict=True):
            chunks[id(seq)] = self._forced_chunk(seq, phrase, out)
        for seq in seqs:
            chunk = chunks.get(id(seq), Chunk([], [], [], []))
            if seq.generated >= seq.request.max_new_tokens:
                self._finish(seq, chunk, LENGTH)
            else:
                self._emit(seq, chunk)

    def _forced_chunk(self, seq: _Seq, phrase: list[int], out: torch.Tensor) -> Chunk:
        """Update `seq` after its phrase went into the cache; out [len(chunk), vocab] fp32
        are the logits of the extended chunk ([unfed] + phrase, or phrase alone)."""
        if seq.unfed is None:  # the first phrase token is predicted by the pending logits
            out = torch.cat([seq.next_logits[None], out])
        logp = torch.log_softmax(out[: len(phrase)], dim=-1)
        picked = logp.gather(1, torch.tensor(phrase)[:, None].to(logp.device))[:, 0]
        seq.length += len(phrase) + (0 if seq.unfed is None else 1)
        seq.unfed = None
        seq.next_logits = out[-1]
        seq.logits_version = self._version
        seq.generated += len(phrase)
        return Chunk(phrase, picked.tolist(), [self._version] * len(phrase), [True] * len(phrase))

    def _decode(self) -> None:
        """Feed last step's tokens as one batch, then sample one token per request."""
        feed = [seq for seq in self._active.values() if seq.unfed is not None]
        if feed:
            logits = self.llama.decode(
                torch.tensor([seq.slot for seq in feed]),
                torch.tensor([seq.length for seq in feed]),
                torch.tensor([seq.unfed for seq in feed]),
            )
            for row, seq in enumerate(feed):
                seq.next_logits = logits[row]
                seq.logits_version = self._version
                seq.length += 1
                seq.unfed = None
        seqs = list(self._active.values())
        tokens, logprobs = sample(
            torch.stack([seq.next_logits for seq in seqs]),
            [seq.request.temperature for seq in seqs],
            [seq.request.top_p for seq in seqs],
            [seq.generator for seq in seqs],
        )
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True):
            self._after_sample(seq, token, logprob)

    def _after_sample(self, seq: _Seq, token: int, logprob: float) -> None:
        """Emit a sampled token and decide whether the request ends or must be forced."""
        request = seq.request
        seq.sampled += 1
        seq.generated += 1
        seq.unfed = token
        chunk = Chunk([token], [logprob], [seq.logits_version], [False])
        marker = request.think_end_ids
        if marker and seq.forced_at is None and not seq.thought_closed:
            seq.tail = (seq.tail + [token])[-len(marker) :]
            seq.thought_closed = closes_thinking(seq.tail, marker)
        if token in self.stop_token_ids:
            self._finish(seq, chunk, STOP if seq.forced_at is None else INTERRUPTED)
        elif seq.generated >= request.max_new_tokens:
            self._finish(seq, chunk, LENGTH)
        elif seq.forced_at is not None and 0 < request.answer_budget <= seq.sampled - seq.forced_at:
            self._finish(seq, chunk, LENGTH)
        else:
            due = 0 < request.thinking_budget <= seq.sampled
            if seq.forced_at is None and due and not seq.thought_closed:
                seq.want_force = "thinking_budget"
            self._emit(seq, chunk)

    def _emit(self, seq: _Seq, chunk: Chunk) -> None:
        count = len(chunk.token_ids)
        self._tokens += count
        if self._metrics is not None and count:
            self._metrics.tokens_generated.inc(count)
            if not seq.first_token:
                self._metrics.time_to_first_token.observe(time.monotonic() - seq.submitted_s)
        seq.first_token = seq.first_token or count > 0
        seq.stream._put(chunk)

    def _finish(self, seq: _Seq, chunk: Chunk, reason: int) -> None:
        chunk.finish_reason = reason
        if seq.slot >= 0:
            del self._active[seq.slot]
            self._free.append(seq.slot)
        with self._lock:
            self._live.pop(seq.request.request_id, None)
            self._set_active_gauge()
        if self._metrics is not None:
            self._metrics.requests_finished.labels(
                finish_reason=rollout_pb2.FinishReason.Name(reason)
            ).inc()
        self._emit(seq, chunk)

    def _fail(self, seq: _Seq, exc: BaseException) -> None:
        if seq.slot >= 0 and self._active.get(seq.slot) is seq:
            del self._active[seq.slot]
            self._free.append(seq.slot)
        with self._lock:
            self._live.pop(seq.request.request_id, None)
            self._set_active_gauge()
        seq.stream._put(exc)

    def _shutdown(self) -> None:
        """End everything left after the loop stopped (caller's thread)."""
        with self._lock:
            staged, self._staged = self._staged, []
            waiting, self._waiting = list(self._waiting), deque()
        for item in staged:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(EngineError("the engine stopped before the swap"))
        for seq in list(self._active.values()) + waiting:
            self._finish(seq, Chunk([], [], [], []), ABORTED)

    def _validate(self, request: GenerationRequest) -> None:
        validate_request(request, self.vocab_size, self.max_seq_len)


def validate_request(request: GenerationRequest, vocab_size: int, max_seq_len: int) -> None:
    """The request checks every engine makes in `submit` (same messages for all).

    Raises:
        ValueError: naming the bad field: empty prompt, token ids outside
            0..vocab_size - 1, temperature outside [0, 5], top_p outside (0, 1],
            max_new_tokens < 1, prompt + max_new_tokens > max_seq_len, negative budgets.
    """
    ids = list(request.prompt_ids)
    if not ids:
        raise ValueError("prompt_ids must hold at least one token")
    named = (
        ("prompt_ids", ids),
        ("interrupt_ids", request.interrupt_ids),
        ("think_end_ids", request.think_end_ids),
    )
    for name, values in named:
        bad = [t for t in values if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} outside 0..{vocab_size - 1}")
    if not 0.0 <= request.temperature <= MAX_TEMPERATURE or math.isnan(request.temperature):
        raise ValueError(
            f"temperature must lie in [0, {MAX_TEMPERATURE}], got {request.temperature}"
        )
    if not 0.0 < request.top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {request.top_p}")
    if request.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    if len(ids) + request.max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({request.max_new_tokens}) "
            f"must be <= max_seq_len {max_seq_len}"
        )
    if request.thinking_budget < 0 or request.answer_budget < 0:
        raise ValueError("thinking_budget and answer_budget must be >= 0")


def sample(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ps: list[float],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits [N, vocab] fp32; per-row temperature (0 = greedy),
    top_p and generator (None for greedy rows). Returns tokens [N] long and their fp32
    log-probs [N] under the distribution sampled from (see the module docstring).

    Each non-greedy row draws exactly one uniform u from its own generator and takes the
    first token whose cumulative probability reaches u (inverse-CDF sampling), so a row's
    draw does not depend on the other rows.
    """
    rows = logits.shape[0]
    temps = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)
    greedy = temps == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    top_p = torch.tensor(top_ps, dtype=torch.float32, device=logits.device)
    nucleus = ~greedy & (top_p < 1.0)
    if bool(nucleus.any()):
        logp = torch.where(nucleus[:, None], top_p_renormalise(logp, top_p), logp)
    uniforms = torch.tensor(
        [float(torch.rand((), generator=g)) if g is not None else 0.0 for g in generators],
        dtype=torch.float32,
        device=logits.device,
    )
    cdf = logp.exp().cumsum(dim=-1)
    # u * total guards against a cdf ending slightly below 1; the floor keeps u = 0 from
    # picking a leading zero-probability token.
    target = (uniforms * cdf[:, -1]).clamp_min(torch.finfo(torch.float32).tiny)
    drawn = torch.searchsorted(cdf, target[:, None])[:, 0].clamp_max(logits.shape[1] - 1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn) if bool(greedy.any()) else drawn
    picked = logp[torch.arange(rows, device=logits.device), tokens]
    return tokens, picked


def top_p_renormalise(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter (Holtzman et al. 2020, Sec. 3.1): keep the smallest set of most likely
    tokens whose mass reaches top_p [N], renormalise. logp [N, vocab] -> [N, vocab], with
    -inf outside the nucleus."""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep_sorted = mass_before < top_p[:, None]  # the most likely token is always kept
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    kept = logp.masked_fill(~keep, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)
