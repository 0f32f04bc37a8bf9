"""SGLang engine: the rollout engine contract over an SGLang server's native HTTP API.

The server (managed: `server.launch_sglang_server`; or external, at `base_url`) does the
batching, the KV cache and the sampling; this adapter turns each `GenerationRequest` into
one or two streamed `/generate` calls (`client.SGLangClient`, which lists the HTTP shapes)
and keeps the contract of `rollout_service.engines.api`; weight updates are
`weights.WeightUpdates`. SGLang is protocol-tested only,
against a stand-in server that speaks those shapes, until it is checked on a GPU.

Log-probs of the distribution actually sampled from. SGLang's sampler (`layers/sampler.py`)
reports for T > 0 log softmax(logits / T) of the sampled token, taken before top-p (and
before top-k/min-p, which this adapter disables), and for T = 0 (greedy, argmax) the
untempered log softmax: for top_p = 1 that is exactly our contract. For top_p < 1 the
adapter sets `return_sampling_mask`, whose `meta_info.output_token_sampling_logprobs`
are the sampled tokens' log-probs renormalised over the sampling support (the top-p
nucleus, Holtzman et al. 2020, Sec. 3.1), and fails the request (EngineError) on a server
that does not return them rather than report log-probs of another distribution. The
server must not run with `SGLANG_RETURN_ORIGINAL_LOGPROB` (untempered log-probs). The LM
head runs in fp32 with `--enable-fp32-lm-head`, which `launch_sglang_server` passes.

Per-token policy version. A weight update is pause (in place) -> update from disk with
`weight_version` = str(version) -> continue -> flush the prefix cache (best effort).
SGLang's docs and `PauseGenerationReqInput` say a flush fails while requests are paused in
place, and the scheduler asserts on a failed flush after an update, so the update is sent
with `flush_cache` = false (in-flight requests keep their KV cache, the PipelineRL in-flight
update), `/flush_cache` is tried after continue and a 400 (busy) is ignored, and every
request carries `cache_salt` = the policy version at submission, so a new request never
reuses prompt KV computed by older weights. The version of each token is read from the
server's `weight_versions` spans, which the scheduler records at the update: exact. A
server without spans gives `weight_version` per event (stamped when the event is built), or
nothing; then the adapter's own version at receipt is used, which can mislabel the few
tokens in flight across an update. A version label that is not an integer (SGLang's
"default" before the first update) means the version the engine was constructed with.

LoRA (`max_lora_rank`, `rollout_service.engines.sglang.adapters`): every adapter version
is loaded through `/load_lora_adapter` under a name of its own, and each `/generate`
call carries the name of the adapter serving when it starts (`lora_path`); SGLang keeps
a request on that adapter to its end, so the call's tokens carry that adapter's version,
never a newer label. A LoRA base reloads as full weights do and its adapter becomes the
policy's; a retired version is unloaded once no call of this engine holds it.

Interruption-based length control (ScaleRL, Khatri et al. 2025, Sec. 3.1; the budget
decisions are `rollout_service.engines.length_control`): the first call generates at most
`thinking_budget` tokens; if it ends by length before max_new_tokens, or is aborted by a
TRUNCATE, a second call with input_ids = prompt + completion so far + interrupt phrase
generates at most `answer_budget` tokens. The phrase tokens are emitted forced=True with
the second call's `input_token_logprobs` (the plain log-softmax unless the server scales
prompt log-probs by temperature; forced tokens are masked out of the loss). Finish
reasons: stop -> STOP (INTERRUPTED after the phrase), length -> LENGTH (answer budget or
max_new_tokens), abort -> ABORTED.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rollout_service.engines.adapters import ServedAdapter
from rollout_service.engines.api import (
    ABORT,
    ABORTED,
    LENGTH,
    TRUNCATE,
    Chunk,
    EngineError,
    EngineStopped,
    GenerationRequest,
    GenerationStream,
    check_interrupt_mode,
    validate_request,
)
from rollout_service.engines.length_control import LengthBudget
from rollout_service.engines.requests import LiveRequest, RequestTable
from rollout_service.engines.sglang.adapters import sglang_adapters
from rollout_service.engines.sglang.client import SGLangClient, finish_type, tail
from rollout_service.engines.sglang.weights import WeightUpdates
from rollout_service.metrics import RolloutMetrics
from scalerl.obs.logging import request_context
from scalerl.policy.architectures import CheckpointNames
from scalerl.rpc.errors import InvalidArgument

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job(LiveRequest):
    """Adapter-side state of one request (rid, control, abort_resent and the budget's
    `force` are under the engine lock)."""

    rid: str = ""  # rid of the /generate call now running ("" between calls)
    control: int | None = None  # TRUNCATE or ABORT asked by interrupt()
    abort_resent: bool = False
    budget: LengthBudget = field(init=False)
    tokens: list[int] = field(default_factory=list)  # completion so far, forced included
    meta: dict = field(default_factory=dict)  # meta_info of the latest event
    served: ServedAdapter | None = None  # the adapter of the call now running

    def __post_init__(self) -> None:
        self.budget = LengthBudget(self.request)


class SGLangEngine:
    """Rollout engine backed by an SGLang server at `base_url` (e.g. "http://127.0.0.1:30000").

    stop_token_ids: ids that end a sequence (sent as `stop_token_ids`; the model's own EOS
    ids stop it too). max_seq_len: prompt + completion tokens per request. vocab_size:
    for input validation. max_batch: requests streamed at once (others wait). policy_version:
    version of the weights the server starts with. metrics: an optional `RolloutMetrics`.
    request_timeout_s: seconds without a byte before an HTTP call fails. weight_shapes: HF
    parameter name -> shape of the served model, to reject a mismatched weights file before
    the server sees it (SGLang keeps tensors a file lacks); None = learned from the first
    accepted update. staging_dir: where weight files are staged for the server (must be
    visible to it; None = the temp directory). api_key: the server's (`--api-key`), sent
    with every call ("" = none). max_lora_rank: serve LoRA adapters up to this rank (the
    server runs with `sglang.adapters.server_args`; None: none). checkpoint_names: the
    learner's names -> the checkpoint's, which the server loads (None: the same; see
    `weights.WeightUpdates`). Raises ValueError for max_batch < 1, max_seq_len < 2 or
    vocab_size < 1.
    """

    name = "sglang"

    def __init__(
        self,
        base_url: str,
        *,
        stop_token_ids: Iterable[int],
        max_seq_len: int,
        vocab_size: int,
        max_batch: int = 64,
        policy_version: int = 0,
        metrics: RolloutMetrics | None = None,
        request_timeout_s: float = 600.0,
        weight_shapes: Mapping[str, Sequence[int]] | None = None,
        staging_dir: str | None = None,
        api_key: str = "",
        max_lora_rank: int | None = None,
        checkpoint_names: CheckpointNames | None = None,
    ) -> None:
        if max_batch < 1 or max_seq_len < 2 or vocab_size < 1:
            raise ValueError(
                "max_batch, max_seq_len and vocab_size must be >= 1, 2, 1, got "
                f"{max_batch}, {max_seq_len}, {vocab_size}"
            )
        self._client = SGLangClient(base_url, request_timeout_s, api_key)
        self.base_url = self._client.base_url
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.max_batch = max_batch
        self._initial_version = policy_version
        self._requests: RequestTable[_Job] = RequestTable(metrics, policy_version)
        self._adapters = None
        if max_lora_rank:
            shapes = {k: tuple(v) for k, v in weight_shapes.items()} if weight_shapes else None
            self._adapters = sglang_adapters(self._client, shapes, max_lora_rank, staging_dir)
        self._weights = WeightUpdates(
            self._client,
            self._requests,
            weight_shapes,
            staging_dir,
            self._adapters,
            checkpoint_names,
        )
        self._lock = threading.Lock()
        self._running = 0  # request workers inside _run
        self._idle = threading.Condition(self._lock)
        self._pool: ThreadPoolExecutor | None = None
        self.start()

    # ----- public API (any thread) -------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Version of the weights now serving."""
        return self._requests.policy_version

    @property
    def base_version(self) -> int | None:
        """The version of the LoRA base serving, None when none was loaded."""
        return self._adapters.base_version if self._adapters is not None else None

    @property
    def active_requests(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._requests)

    @property
    def tokens_generated(self) -> int:
        """Completion tokens emitted since start, forced tokens included."""
        return self._requests.tokens_generated

    def start(self) -> None:
        """Create the request and weight-update workers (idempotent)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_batch, thread_name_prefix="sglang-req")
        self._weights.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request on the server and end it ABORTED; pending weight updates
        fail. Waits up to `timeout` seconds for the workers."""
        for job in self._requests.close():
            self._requests.finish(job, Chunk.empty(), ABORTED)
            self._abort_on_server(job)
        self._weights.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._running and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))

    def submit(self, request: GenerationRequest) -> GenerationStream:
        """Queue a request; returns its stream at once. Raises InvalidArgument naming the
        bad field (`validate_request`; think_end_ids are not supported yet),
        DuplicateRequestError for a request_id still running, EngineStopped once the
        engine is stopping."""
        names = self._adapters.names() if self._adapters is not None else ()
        validate_request(request, self.vocab_size, self.max_seq_len, names)
        if request.think_end_ids:
            raise InvalidArgument(
                "think_end_ids",
                "the SGLang adapter does not detect an end-of-thinking marker yet; leave "
                "rollout.think_end empty with rollout.engine=sglang",
            )
        pool = self._pool
        if pool is None:
            raise EngineStopped("the engine is not started")
        stream = GenerationStream(self, request)
        job = _Job(request, stream)
        self._requests.add(job)
        try:
            pool.submit(self._run, job)
        except RuntimeError as exc:  # the pool shut down since: stop() ended the job
            raise EngineStopped() from exc
        return stream

    def interrupt(self, request_id: str, mode: int) -> bool:
        """TRUNCATE: abort the thinking call on the server and force the interrupt phrase
        (a no-op once forced). ABORT: end the request ABORTED. Returns False when no running
        or waiting request has that id. Raises InvalidArgument for another mode."""
        check_interrupt_mode(mode)
        job = self._requests.get(request_id)
        if job is None:
            return False
        with self._lock:
            if mode == TRUNCATE and (job.budget.answering or job.control is not None):
                return True
            job.control = mode
        self._requests.count_interrupt("abort" if mode == ABORT else "truncate")
        self._abort_on_server(job)
        return True

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> Future:
        """Validate a full state dict (HF names) or a LoRA payload and load it on the
        server (`WeightUpdates.stage_state_dict`). Raises InvalidArgument naming the first
        bad tensor or field (nothing changes then), EngineStopped once stopping."""
        return self._weights.stage_state_dict(state_dict, version)

    def stage_adapter(self, name: str, state_dict: dict[str, torch.Tensor], version: int) -> Future:
        """Serve the adapter tensors of `state_dict` as adapter `name` beside the policy
        once the server has loaded it (`WeightUpdates.stage_adapter`): requests naming it
        get it, their tokens its `version`. Raises InvalidArgument naming the field:
        "adapter" without LoRA (no `max_lora_rank`) or for an empty name, "state_dict"
        for a bad tensor, "version" for one older than that adapter's."""
        return self._weights.stage_adapter(name, state_dict, version)

    def stage_weights_from_file(self, path: str, version: int) -> Future:
        """Load the learner's safetensors file (or a directory of them) on the server
        (`WeightUpdates.stage_file`); the Future resolves to `version` once the new weights
        serve, or fails (EngineError) with the old weights still serving. Raises
        InvalidArgument for a missing or corrupt file or mismatched tensors."""
        return self._weights.stage_file(path, version)

    # ----- requests (request workers) ----------------------------------------------------

    def _run(self, job: _Job) -> None:
        with self._idle:
            self._running += 1
        try:
            with request_context(job.request.request_id):
                self._generate(job)
        except Exception as exc:
            if self._requests.closed or job.control == ABORT:
                self._requests.finish(job, Chunk.empty(), ABORTED)
            else:
                log.warning("request %s failed: %s", job.request.request_id, exc)
                self._requests.fail(job, exc)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def _generate(self, job: _Job) -> None:
        """Thinking call, then (budget reached or TRUNCATE) the forced phrase and answer."""
        request, budget = job.request, job.budget
        if job.control == ABORT:
            self._requests.finish(job, Chunk.empty(), ABORTED)
            return
        if job.control != TRUNCATE:
            body = self._body(job, list(request.prompt_ids), budget.sample_limit(), request.seed)
            for chunk, finish in self._call(job, body):
                if finish is None:
                    self._requests.emit(job, chunk)
                elif finish == "stop":
                    self._requests.finish(job, chunk, budget.stop_reason())
                    return
                elif finish == "length" and budget.length_reason():
                    self._requests.finish(job, chunk, LENGTH)
                    return
                elif finish == "length" or (finish == "abort" and job.control == TRUNCATE):
                    self._requests.emit(job, chunk)
                    if finish == "length":  # a TRUNCATE was counted by interrupt()
                        self._requests.count_interrupt("thinking_budget")
                else:  # aborted by ABORT, or by the server
                    self._requests.finish(job, chunk, ABORTED)
                    return
        self._answer(job)

    def _answer(self, job: _Job) -> None:
        """Force the phrase (as much as max_new_tokens leaves room for), then sample at most
        answer_budget tokens (0 = up to max_new_tokens)."""
        request, budget = job.request, job.budget
        with self._lock:
            phrase = list(budget.force())
        no_room = bool(budget.length_reason())
        context = list(request.prompt_ids) + job.tokens
        seed = None if request.seed is None else request.seed + 1
        body = self._body(
            job, context + phrase, budget.sample_limit(), seed, max(0, len(context) - 1)
        )
        first = True
        for chunk, finish in self._call(job, body):
            if first:
                first = False
                forced = self._forced_chunk(job, phrase)
                if no_room:
                    self._requests.finish(job, forced, LENGTH)
                    return
                if forced.token_ids:
                    self._requests.emit(job, forced)
            if finish is None:
                self._requests.emit(job, chunk)
            elif finish == "stop":
                self._requests.finish(job, chunk, budget.stop_reason())
                return
            elif finish == "length":
                self._requests.finish(job, chunk, LENGTH)
                return
            else:
                self._requests.finish(job, chunk, ABORTED)
                return

    def _forced_chunk(self, job: _Job, phrase: list[int]) -> Chunk:
        meta = job.meta
        entries = meta.get("input_token_logprobs") or []
        forced = entries[len(entries) - len(phrase) :] if phrase else []
        if [int(e[1]) for e in forced] != phrase or any(e[0] is None for e in forced):
            raise EngineError("server returned no input_token_logprobs for the interrupt phrase")
        version = self._version_at(job, meta, 0)
        job.tokens += phrase
        return Chunk(
            phrase, [float(e[0]) for e in forced], [version] * len(phrase), [True] * len(phrase)
        )

    def _body(
        self,
        job: _Job,
        input_ids: list[int],
        max_new_tokens: int,
        seed: int | None,
        logprob_start_len: int | None = None,
    ) -> dict:
        request = job.request
        params: dict[str, object] = {
            "max_new_tokens": max_new_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "stop_token_ids": sorted(self.stop_token_ids),
        }
        if seed is not None:
            params["sampling_seed"] = seed
        suffix = "answer" if job.budget.answering else "think"
        body: dict[str, object] = {
            "rid": f"{request.request_id}:{suffix}:{time.monotonic_ns()}",
            "input_ids": input_ids,
            "sampling_params": params,
            "stream": True,
            "return_logprob": True,
            "logprob_start_len": -1 if logprob_start_len is None else logprob_start_len,
            "cache_salt": f"policy-{self.policy_version}",
        }
        if _needs_sampling_logprobs(request):
            body["return_sampling_mask"] = True
        return body

    def _call(self, job: _Job, body: dict) -> Iterator[tuple[Chunk, str | None]]:
        """Stream one /generate call, on the adapter serving now (held to its end);
        yields (chunk of new tokens, finish type or None)."""
        with self._lock:
            job.rid = str(body["rid"])
            job.abort_resent = False
        job.served = self._adapters.acquire(job.request.adapter) if self._adapters else None
        if job.served is not None:  # its KV is the adapter's: never reused across adapters
            body["lora_path"] = job.served.handle
            body["cache_salt"] = f"{body['cache_salt']}-{job.served.handle}"
        emitted = 0
        finish = None
        try:
            for event in self._client.generate(body):
                meta = event.get("meta_info") or {}
                job.meta = meta
                chunk = self._new_tokens(job, meta, emitted)
                emitted += len(chunk.token_ids)
                job.tokens += chunk.token_ids
                for token in chunk.token_ids:
                    job.budget.count_sampled(token)
                finish = finish_type(meta)
                self._resend_abort(job)
                yield chunk, finish
                if finish is not None:
                    return
        finally:
            with self._lock:
                job.rid = ""
            if self._adapters is not None:
                self._adapters.release(job.served)
        if finish is None:
            raise EngineError("the /generate stream ended without a finish_reason")

    def _new_tokens(self, job: _Job, meta: dict, emitted: int) -> Chunk:
        """The tokens after the first `emitted` of this call, whether the server streams
        meta_info cumulatively (SGLang's default) or incrementally."""
        total = int(meta.get("completion_tokens", 0))
        count = total - emitted
        name = "output_token_logprobs"
        entries = tail(meta.get(name) or [], total, count, name)
        ids = [int(e[1]) for e in entries]
        if _needs_sampling_logprobs(job.request):
            values = meta.get("output_token_sampling_logprobs")
            if values is None:
                raise EngineError(
                    "server returned no output_token_sampling_logprobs; top_p < 1 needs "
                    "an SGLang with return_sampling_mask"
                )
            logprobs = [float(v) for v in tail(values, total, count, "sampling logprobs")]
        else:
            logprobs = [float(e[0]) for e in entries]
        versions = [self._version_at(job, meta, emitted + i) for i in range(count)]
        return Chunk(ids, logprobs, versions, [False] * count)

    def _version_at(self, job: _Job, meta: dict, position: int) -> int:
        """Policy version of the weights that computed output `position` of the call now
        running: its adapter's, or the base's (see module doc)."""
        if job.served is not None:
            return job.served.version
        for span in meta.get("weight_versions") or ():
            if int(span["start"]) <= position < int(span["end"]):
                return self._parse_version(span["version"])
        if "weight_version" in meta:
            return self._parse_version(meta["weight_version"])
        return self.policy_version

    def _parse_version(self, label: object) -> int:
        try:
            return int(str(label))
        except ValueError:
            return self._initial_version

    def _resend_abort(self, job: _Job) -> None:
        """An abort sent before the server registered the rid is ignored by SGLang; once
        an event proves the rid is known, send a pending abort once more."""
        with self._lock:
            truncating = job.control == TRUNCATE and not job.budget.answering
            pending = job.control == ABORT or truncating
            resend = pending and not job.abort_resent and bool(job.rid)
            job.abort_resent = job.abort_resent or resend
        if resend:
            self._abort_on_server(job)

    def _abort_on_server(self, job: _Job) -> None:
        with self._lock:
            rid = job.rid
        if not rid:
            return  # between calls: the worker checks job.control before the next one
        try:
            self._client.post("/abort_request", {"rid": rid}, expect_json=False)
        except EngineError as exc:
            log.warning("abort of %s failed: %s", rid, exc)


def _needs_sampling_logprobs(request: GenerationRequest) -> bool:
    return request.temperature > 0 and request.top_p < 1.0
