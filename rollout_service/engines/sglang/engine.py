"""SGLang engine: the rollout engine contract over an SGLang server's native HTTP API.

The server (managed: `launch_sglang_server`; or external, at `base_url`) does the batching,
the KV cache and the sampling; this adapter turns each `GenerationRequest` into one or two
streamed `/generate` calls and keeps the contract of
`rollout_service.engines.torch.engine` (read its module docstring). SGLang is
protocol-tested only, against a stand-in server that speaks the shapes below, until it
is checked on a GPU.

HTTP calls (shapes from SGLang's `entrypoints/http_server.py` and `managers/io_struct.py`):

- `POST /generate` with `GenerateReqInput` fields `rid`, `input_ids` (token ids; never
  `text`), `sampling_params` {`max_new_tokens`, `temperature`, `top_p`, `top_k` = -1,
  `min_p` = 0, the three penalties neutral, `stop_token_ids`, `sampling_seed` when the
  request has a seed}, `stream` = true, `return_logprob` = true, `logprob_start_len`,
  `cache_salt`, and `return_sampling_mask` (see log-probs). Every sampling field is sent,
  because the server's defaults come from the model's `generation_config.json`. The reply
  is server-sent events `data: {json}` ending with `data: [DONE]`; each event carries the
  cumulative `output_ids` and `meta_info` {`id`, `finish_reason` (null, or {type: stop |
  length | abort, ...}), `prompt_tokens`, `completion_tokens`, `output_token_logprobs` as
  [logprob, token_id, text] triples, `input_token_logprobs` likewise, `weight_version`,
  and in current SGLang `weight_versions`: spans {version, start, end} over output
  positions}. An error inside the stream is a `data: {"error": {"message": ...}}` event.
- `POST /abort_request` {`rid`}: the stream ends with finish_reason {type: abort}.
- `POST /pause_generation` {`mode`: "in_place"}: the scheduler stops stepping and keeps
  the running requests and their KV cache; `POST /continue_generation` {} resumes them.
- `POST /update_weights_from_disk` {`model_path` (a directory of *.safetensors),
  `weight_version`, `flush_cache` = false, `abort_all_requests` = false} returns
  {`success`, `message`, `num_paused_requests`}, HTTP 400 when success is false; SGLang
  reloads the old weights when a load fails.
- `POST /flush_cache`: 200, or 400 while requests are running or paused in place.
- `GET /health`: 200 once the server serves.

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

Interruption-based length control (ScaleRL, Khatri et al. 2025, Sec. 3.1), as in the torch
engine: the first call generates at most `thinking_budget` tokens; if it ends by length
before max_new_tokens, or is aborted by a TRUNCATE, a second call with input_ids = prompt
+ completion so far + interrupt phrase generates at most `answer_budget` tokens. The
phrase tokens are emitted forced=True with the second call's `input_token_logprobs` (the
plain log-softmax unless the server scales prompt log-probs by temperature; forced tokens
are masked out of the loss). Finish reasons: stop -> STOP (INTERRUPTED after the phrase),
length -> LENGTH (answer budget or max_new_tokens), abort -> ABORTED.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch

from rollout_service.engines.torch.engine import (
    ABORT,
    ABORTED,
    INTERRUPTED,
    LENGTH,
    STOP,
    TRUNCATE,
    Chunk,
    DuplicateRequestError,
    EngineBookkeeping,
    EngineError,
    GenerationRequest,
    GenerationStream,
    validate_request,
)
from scalerl.v1 import rollout_pb2

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
WEIGHTS_FILE = "model.safetensors"


@dataclass(eq=False)
class _Job:
    """Adapter-side state of one request (fields under the engine lock where shared)."""

    request: GenerationRequest
    stream: GenerationStream
    submitted_s: float
    rid: str = ""  # rid of the /generate call now running ("" between calls)
    response: requests.Response | None = None
    control: int | None = None  # TRUNCATE or ABORT asked by interrupt()
    abort_resent: bool = False
    forced: bool = False  # the interrupt phrase was forced (answer phase)
    done: bool = False
    tokens: list[int] = field(default_factory=list)  # completion so far, forced included
    meta: dict = field(default_factory=dict)  # meta_info of the latest event
    first_token: bool = False


class SGLangEngine(EngineBookkeeping):
    """Rollout engine backed by an SGLang server at `base_url` (e.g. "http://127.0.0.1:30000").

    stop_token_ids: ids that end a sequence (sent as `stop_token_ids`; the model's own EOS
    ids stop it too). max_seq_len: prompt + completion tokens per request. vocab_size:
    for input validation. max_batch: requests streamed at once (others wait). policy_version:
    version of the weights the server starts with. metrics: an optional
    `rollout_service.metrics.RolloutMetrics`. request_timeout_s: seconds without a byte
    before an HTTP call fails. weight_shapes: HF parameter name -> shape of the served model,
    to reject a mismatched weights file before the server sees it (SGLang keeps tensors a
    file lacks); None = learned from the first accepted update. staging_dir: where weight
    files are staged for the server (must be visible to it; None = the temp directory).
    Raises ValueError for max_batch < 1, max_seq_len < 2 or vocab_size < 1.
    """

    def __init__(
        self,
        base_url: str,
        *,
        stop_token_ids: Iterable[int],
        max_seq_len: int,
        vocab_size: int,
        max_batch: int = 64,
        policy_version: int = 0,
        metrics: object | None = None,
        request_timeout_s: float = 600.0,
        weight_shapes: Mapping[str, Sequence[int]] | None = None,
        staging_dir: str | None = None,
    ) -> None:
        if max_batch < 1 or max_seq_len < 2 or vocab_size < 1:
            raise ValueError(
                "max_batch, max_seq_len and vocab_size must be >= 1, 2, 1, got "
                f"{max_batch}, {max_seq_len}, {vocab_size}"
            )
        self.base_url = base_url.rstrip("/")
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.max_batch = max_batch
        self.request_timeout_s = request_timeout_s
        self._initial_version = policy_version
        self._version = policy_version
        self._metrics = metrics
        self._shapes = (
            None
            if weight_shapes is None
            else {k: tuple(int(d) for d in v) for k, v in weight_shapes.items()}
        )
        self._staging_dir = staging_dir
        self._served_dir: str | None = None  # staged dir now serving (kept for rollback)
        self._tokens = 0
        self._lock = threading.Lock()
        self._live: dict[str, _Job] = {}
        self._local = threading.local()
        self._stopping = False
        self._running = 0  # request workers inside _run
        self._idle = threading.Condition(self._lock)
        self._pending: list[Future] = []  # weight updates not yet done
        self._pool: ThreadPoolExecutor | None = None
        self._updates: ThreadPoolExecutor | None = None
        if metrics is not None:
            metrics.policy_version.set(policy_version)
        self.start()

    # ----- public API (any thread) -------------------------------------------------------

    def start(self) -> None:
        """Create the request and weight-update workers (idempotent)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_batch, thread_name_prefix="sglang-req")
            self._updates = ThreadPoolExecutor(1, thread_name_prefix="sglang-weights")

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request on the server and end it ABORTED; pending weight updates
        fail. Waits up to `timeout` seconds for the workers."""
        with self._lock:
            self._stopping = True
            jobs = list(self._live.values())
            pending, self._pending = self._pending, []
        for job in jobs:
            self._finish(job, _empty(), ABORTED)
            self._abort_on_server(job)
        for future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineError("the engine stopped before the update"))
        for pool in (self._pool, self._updates):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._running and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))

    def submit(self, request: GenerationRequest) -> GenerationStream:
        """Queue a request; returns its stream at once. Raises ValueError naming the bad
        field (as TorchEngine.submit), DuplicateRequestError for a request_id still running,
        RuntimeError once the engine is stopping."""
        validate_request(request, self.vocab_size, self.max_seq_len)
        if request.think_end_ids:
            raise ValueError(
                "think_end_ids: the SGLang adapter does not detect an end-of-thinking marker "
                "yet; leave rollout.think_end empty with rollout.engine=sglang"
            )
        stream = GenerationStream(self, request)
        job = _Job(request, stream, time.monotonic())
        with self._lock:
            if self._stopping or self._pool is None:
                raise RuntimeError("the engine is stopped")
            if request.request_id in self._live:
                raise DuplicateRequestError(f"request_id {request.request_id!r} is already running")
            self._live[request.request_id] = job
            self._set_active_gauge()
        self._pool.submit(self._run, job)
        return stream

    def interrupt(self, request_id: str, mode: int) -> bool:
        """TRUNCATE: abort the thinking call on the server and force the interrupt phrase
        (a no-op once forced). ABORT: end the request ABORTED. Returns False when no running
        or waiting request has that id. Raises ValueError for another mode."""
        if mode not in (TRUNCATE, ABORT):
            raise ValueError(f"mode must be INTERRUPT_MODE_TRUNCATE or _ABORT, got {mode}")
        with self._lock:
            job = self._live.get(request_id)
            if job is None or job.done:
                return False
            if mode == TRUNCATE and (job.forced or job.control is not None):
                return True
            job.control = mode
        self._count_interrupt("abort" if mode == ABORT else "truncate")
        self._abort_on_server(job)
        return True

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> Future:
        """Validate a full state dict (HF names), write it as one safetensors file and load
        it on the server (see `stage_weights_from_file`). Raises ValueError naming the first
        bad tensor (not a tensor, non-float, non-finite, or names/shapes that differ from
        the served model's); nothing changes then."""
        for name, tensor in state_dict.items():
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ValueError(f"weights: {name!r} is not a floating-point tensor")
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"weights: {name!r} has non-finite values")
        self._check_manifest({k: tuple(v.shape) for k, v in state_dict.items()})
        directory = tempfile.mkdtemp(prefix="sglang-weights-", dir=self._staging_dir)
        try:
            from safetensors.torch import save_file

            tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
            save_file(tensors, os.path.join(directory, WEIGHTS_FILE))
        except Exception:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return self._submit_update(directory, int(version), owned=True)

    def stage_weights_from_file(self, path: str, version: int) -> Future:
        """Load the learner's safetensors file (or a directory of them) on the server at a
        pause in place; the Future resolves to `version` once the new weights serve, or
        fails (EngineError) with the old weights still serving at the old version. Raises
        ValueError for a missing or corrupt file, or tensors whose names/shapes differ
        from the served model's."""
        source = Path(path)
        if source.is_dir():
            files = sorted(source.glob("*.safetensors"))
            if not files:
                raise ValueError(f"weights: no *.safetensors file in {path!r}")
        elif source.is_file():
            files = [source]
        else:
            raise ValueError(f"weights: {path!r} does not exist")
        manifest: dict[str, tuple[int, ...]] = {}
        for file in files:
            manifest.update(read_safetensors_shapes(str(file)))
        self._check_manifest(manifest)
        if source.is_dir():
            return self._submit_update(str(source), int(version), owned=False)
        # SGLang loads from a directory; link the file into a staged one of its own.
        directory = tempfile.mkdtemp(prefix="sglang-weights-", dir=self._staging_dir)
        os.symlink(source.resolve(), os.path.join(directory, WEIGHTS_FILE))
        return self._submit_update(directory, int(version), owned=True)

    # ----- weight updates (update thread) ------------------------------------------------

    def _submit_update(self, directory: str, version: int, owned: bool) -> Future:
        future: Future = Future()
        with self._lock:
            if self._stopping or self._updates is None:
                if owned:
                    shutil.rmtree(directory, ignore_errors=True)
                raise RuntimeError("the engine is stopped")
            self._pending.append(future)
            self._updates.submit(self._run_update, future, directory, version, owned)
        return future

    def _run_update(self, future: Future, directory: str, version: int, owned: bool) -> None:
        with self._lock:
            if future not in self._pending:  # failed by stop()
                return
            self._pending.remove(future)
        if not future.set_running_or_notify_cancel():
            if owned:
                shutil.rmtree(directory, ignore_errors=True)
            return  # the caller gave up waiting; never apply a cancelled update
        try:
            future.set_result(self._update(directory, version, owned))
        except BaseException as exc:
            log.warning("weight update to version %d failed: %s", version, exc)
            future.set_exception(exc)

    def _update(self, directory: str, version: int, owned: bool) -> int:
        """pause in place -> update from disk -> continue -> flush; returns `version`.
        Raises EngineError (version unchanged) when the server refuses or is unreachable."""
        start = time.monotonic()
        try:
            self._post("/pause_generation", {"mode": "in_place"})
            try:
                reply = self._post(
                    "/update_weights_from_disk",
                    {
                        "model_path": directory,
                        "weight_version": str(version),
                        "flush_cache": False,
                        "abort_all_requests": False,
                    },
                    accept_400=True,
                )
                if not reply.get("success"):
                    raise EngineError(f"update_weights_from_disk failed: {reply.get('message')}")
                self._version = version
            finally:
                self._post("/continue_generation", {})
        except BaseException:
            if owned:
                shutil.rmtree(directory, ignore_errors=True)
            raise
        self._flush_cache()
        old, self._served_dir = self._served_dir, directory if owned else None
        if old is not None:  # the server may reload the serving dir to roll back; not older
            shutil.rmtree(old, ignore_errors=True)
        if self._shapes is None:
            self._shapes = _dir_shapes(directory)
        if self._metrics is not None:
            self._metrics.policy_version.set(version)
        log.info("policy version %d now serving (update %.3fs)", version, time.monotonic() - start)
        return version

    def _flush_cache(self) -> None:
        """Drop prefix-cache entries of older weights; SGLang answers 400 while requests run
        (their KV must stay), which is expected here and ignored."""
        try:
            reply = self._session().post(
                self.base_url + "/flush_cache", timeout=(CONNECT_TIMEOUT_S, self.request_timeout_s)
            )
            if reply.status_code != 200:
                log.debug("flush_cache skipped (HTTP %d): server busy", reply.status_code)
        except requests.RequestException as exc:
            log.warning("flush_cache failed: %s", exc)

    def _check_manifest(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        if not shapes:
            raise ValueError("weights: no tensors")
        expected = self._shapes
        if expected is None:
            return
        for name, shape in shapes.items():
            if name not in expected:
                raise ValueError(f"weights: tensor {name!r} is not a parameter of the model")
            if tuple(shape) != expected[name]:
                raise ValueError(
                    f"weights: tensor {name!r} has shape {list(shape)}, "
                    f"expected {list(expected[name])}"
                )
        missing = sorted(set(expected) - set(shapes))
        if missing:
            raise ValueError(f"weights: tensor {missing[0]!r} is missing")

    # ----- requests (request workers) ----------------------------------------------------

    def _run(self, job: _Job) -> None:
        with self._lock:
            self._running += 1
        try:
            self._generate(job)
        except Exception as exc:
            if self._stopping or job.control == ABORT:
                self._finish(job, _empty(), ABORTED)
            else:
                log.warning("request %s failed: %s", job.request.request_id, exc)
                self._fail(job, exc)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def _generate(self, job: _Job) -> None:
        """Thinking call, then (budget reached or TRUNCATE) the forced phrase and answer."""
        request = job.request
        if job.control == ABORT:
            self._finish(job, _empty(), ABORTED)
            return
        if job.control != TRUNCATE:
            limit = request.max_new_tokens
            if request.thinking_budget > 0:
                limit = min(limit, request.thinking_budget)
            body = self._body(job, list(request.prompt_ids), limit, request.seed, None)
            for chunk, finish in self._call(job, body):
                if finish is None:
                    self._emit(job, chunk)
                elif finish == "stop":
                    return self._finish(job, chunk, STOP)
                elif finish == "length" and len(job.tokens) >= request.max_new_tokens:
                    return self._finish(job, chunk, LENGTH)
                elif finish == "length" or (finish == "abort" and job.control == TRUNCATE):
                    self._emit(job, chunk)
                    self._count_interrupt("thinking_budget" if finish == "length" else None)
                else:  # aborted by ABORT, or by the server
                    return self._finish(job, chunk, ABORTED)
        self._answer(job)

    def _answer(self, job: _Job) -> None:
        """Force the phrase (as much as max_new_tokens leaves room for), then sample at most
        answer_budget tokens (0 = up to max_new_tokens)."""
        request = job.request
        with self._lock:
            job.forced = True
        phrase = list(request.interrupt_ids[: request.max_new_tokens - len(job.tokens)])
        context = list(request.prompt_ids) + job.tokens
        room = request.max_new_tokens - len(job.tokens) - len(phrase)
        limit = room if request.answer_budget == 0 else min(room, request.answer_budget)
        seed = None if request.seed is None else request.seed + 1
        body = self._body(job, context + phrase, limit, seed, max(0, len(context) - 1))
        first = True
        for chunk, finish in self._call(job, body):
            if first:
                first = False
                forced = self._forced_chunk(job, phrase)
                if room == 0:
                    return self._finish(job, forced, LENGTH)
                if forced.token_ids:
                    self._emit(job, forced)
            if finish is None:
                self._emit(job, chunk)
            elif finish == "stop":
                return self._finish(job, chunk, INTERRUPTED)
            elif finish == "length":
                return self._finish(job, chunk, LENGTH)
            else:
                return self._finish(job, chunk, ABORTED)

    def _forced_chunk(self, job: _Job, phrase: list[int]) -> Chunk:
        meta = job.meta
        entries = meta.get("input_token_logprobs") or []
        tail = entries[len(entries) - len(phrase) :] if phrase else []
        if [int(e[1]) for e in tail] != phrase or any(e[0] is None for e in tail):
            raise EngineError("server returned no input_token_logprobs for the interrupt phrase")
        version = self._version_at(meta, 0)
        job.tokens += phrase
        return Chunk(
            phrase, [float(e[0]) for e in tail], [version] * len(phrase), [True] * len(phrase)
        )

    def _body(
        self,
        job: _Job,
        input_ids: list[int],
        max_new_tokens: int,
        seed: int | None,
        logprob_start_len: int | None,
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
        suffix = "answer" if job.forced else "think"
        body: dict[str, object] = {
            "rid": f"{request.request_id}:{suffix}:{time.monotonic_ns()}",
            "input_ids": input_ids,
            "sampling_params": params,
            "stream": True,
            "return_logprob": True,
            "logprob_start_len": -1 if logprob_start_len is None else logprob_start_len,
            "cache_salt": f"policy-{self._version}",
        }
        if _needs_sampling_logprobs(request):
            body["return_sampling_mask"] = True
        return body

    def _call(self, job: _Job, body: dict) -> Iterator[tuple[Chunk, str | None]]:
        """Stream one /generate call; yields (chunk of new tokens, finish type or None)."""
        with self._lock:
            job.rid = str(body["rid"])
            job.abort_resent = False
        emitted = 0
        finish = None
        try:
            for event in self._events(job, body):
                meta = event.get("meta_info") or {}
                job.meta = meta
                chunk = self._new_tokens(job, meta, emitted)
                emitted += len(chunk.token_ids)
                job.tokens += chunk.token_ids
                reason = meta.get("finish_reason")
                finish = reason.get("type") if isinstance(reason, dict) else None
                self._resend_abort(job)
                yield chunk, finish
                if finish is not None:
                    return
        finally:
            with self._lock:
                job.rid, job.response = "", None
        if finish is None:
            raise EngineError("the /generate stream ended without a finish_reason")

    def _events(self, job: _Job, body: dict) -> Iterator[dict]:
        """Server-sent events of one /generate call, up to `data: [DONE]`."""
        try:
            response = self._session().post(
                self.base_url + "/generate",
                json=body,
                stream=True,
                timeout=(CONNECT_TIMEOUT_S, self.request_timeout_s),
            )
        except requests.RequestException as exc:
            raise EngineError(f"/generate failed: {exc}") from exc
        with response:
            if response.status_code != 200:
                raise EngineError(f"/generate: HTTP {response.status_code}: {response.text[:300]}")
            with self._lock:
                job.response = response
            try:
                for line in response.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise EngineError(f"/generate: {event['error'].get('message')}")
                    yield event
            except (requests.RequestException, ValueError) as exc:
                raise EngineError(f"/generate stream broke: {exc}") from exc

    def _new_tokens(self, job: _Job, meta: dict, emitted: int) -> Chunk:
        """The tokens after the first `emitted` of this call, whether the server streams
        meta_info cumulatively (SGLang's default) or incrementally."""
        total = int(meta.get("completion_tokens", 0))
        count = total - emitted
        entries = _tail(
            meta.get("output_token_logprobs") or [], total, count, "output_token_logprobs"
        )
        ids = [int(e[1]) for e in entries]
        if _needs_sampling_logprobs(job.request):
            values = meta.get("output_token_sampling_logprobs")
            if values is None:
                raise EngineError(
                    "server returned no output_token_sampling_logprobs; top_p < 1 needs "
                    "an SGLang with return_sampling_mask"
                )
            logprobs = [float(v) for v in _tail(values, total, count, "sampling logprobs")]
        else:
            logprobs = [float(e[0]) for e in entries]
        versions = [self._version_at(meta, emitted + i) for i in range(count)]
        return Chunk(ids, logprobs, versions, [False] * count)

    def _version_at(self, meta: dict, position: int) -> int:
        """Policy version of the weights that computed output `position` (see module doc)."""
        for span in meta.get("weight_versions") or ():
            if int(span["start"]) <= position < int(span["end"]):
                return self._parse_version(span["version"])
        if "weight_version" in meta:
            return self._parse_version(meta["weight_version"])
        return self._version

    def _parse_version(self, label: object) -> int:
        try:
            return int(str(label))
        except ValueError:
            return self._initial_version

    def _resend_abort(self, job: _Job) -> None:
        """An abort sent before the server registered the rid is ignored by SGLang; once
        an event proves the rid is known, send a pending abort once more."""
        with self._lock:
            pending = job.control == ABORT or (job.control == TRUNCATE and not job.forced)
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
            self._post("/abort_request", {"rid": rid}, expect_json=False)
        except EngineError as exc:
            log.warning("abort of %s failed: %s", rid, exc)

    # ----- emission ------------------------------------------------------------------------

    def _emit(self, job: _Job, chunk: Chunk) -> None:
        with self._lock:
            if job.done:
                return
        count = len(chunk.token_ids)
        self._tokens += count
        if self._metrics is not None and count:
            self._metrics.tokens_generated.inc(count)
            if not job.first_token:
                self._metrics.time_to_first_token.observe(time.monotonic() - job.submitted_s)
        job.first_token = job.first_token or count > 0
        job.stream._put(chunk)

    def _finish(self, job: _Job, chunk: Chunk, reason: int) -> None:
        with self._lock:
            if job.done:
                return
            self._live.pop(job.request.request_id, None)
            self._set_active_gauge()
        chunk.finish_reason = reason
        self._emit(job, chunk)
        with self._lock:
            job.done = True
        if self._metrics is not None:
            name = rollout_pb2.FinishReason.Name(reason)
            self._metrics.requests_finished.labels(finish_reason=name).inc()

    def _fail(self, job: _Job, exc: BaseException) -> None:
        with self._lock:
            if job.done:
                return
            job.done = True
            self._live.pop(job.request.request_id, None)
            self._set_active_gauge()
        job.stream._put(exc)

    # ----- helpers -----------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _post(
        self, path: str, body: dict, *, accept_400: bool = False, expect_json: bool = True
    ) -> dict:
        """POST JSON; returns the JSON reply ({} when not expected). Raises EngineError on
        a connection failure or an HTTP status other than 200 (or 400 with accept_400)."""
        try:
            reply = self._session().post(
                self.base_url + path, json=body, timeout=(CONNECT_TIMEOUT_S, self.request_timeout_s)
            )
        except requests.RequestException as exc:
            raise EngineError(f"{path} failed: {exc}") from exc
        if reply.status_code != 200 and not (accept_400 and reply.status_code == 400):
            raise EngineError(f"{path}: HTTP {reply.status_code}: {reply.text[:300]}")
        if not expect_json:
            return {}
        try:
            return reply.json()
        except ValueError as exc:
            raise EngineError(f"{path}: reply is not JSON: {reply.text[:300]}") from exc


def read_safetensors_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header, without reading the data.
    Raises ValueError naming the file when it is missing, truncated or not safetensors."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise ValueError(f"weights: {path!r} is not a valid safetensors file: {exc}") from exc


def launch_sglang_server(
    model_path: str, port: int, *, dtype: str, extra_args: Sequence[str] = ()
) -> subprocess.Popen:
    """Start `python -m sglang.launch_server` on 127.0.0.1:`port` for `model_path` (an HF
    directory) with `dtype` ("bfloat16", "float32", ...), an fp32 LM head and token-id
    input/output (`--skip-tokenizer-init`); `extra_args` are appended. Returns the process
    (its own session, so the caller can end its whole group); wait for it with
    `wait_until_ready`. Needs the `sglang` package and a GPU."""
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--enable-fp32-lm-head",
        "--skip-tokenizer-init",
        *extra_args,
    ]
    return subprocess.Popen(command, start_new_session=True)


def wait_until_ready(
    base_url: str, timeout_s: float = 600.0, process: subprocess.Popen | None = None
) -> None:
    """Poll `GET /health` every second until it answers 200. Raises EngineError after
    `timeout_s` seconds or when `process` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise EngineError(f"the SGLang server exited with code {process.returncode}")
        try:
            if requests.get(base_url.rstrip("/") + "/health", timeout=5.0).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise EngineError(f"the SGLang server at {base_url} was not ready after {timeout_s}s")


def _needs_sampling_logprobs(request: GenerationRequest) -> bool:
    return request.temperature > 0 and request.top_p < 1.0


def _tail(values: list, total: int, count: int, name: str) -> list:
    """The last `count` of a per-output-token list that is cumulative (len == total) or
    incremental (len == count)."""
    if len(values) == total:
        return values[total - count :]
    if len(values) == count:
        return values
    raise EngineError(f"{name} holds {len(values)} entries for {count} new of {total} tokens")


def _dir_shapes(directory: str) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        shapes.update(read_safetensors_shapes(str(file)))
    return shapes


def _empty() -> Chunk:
    return Chunk([], [], [], [])
