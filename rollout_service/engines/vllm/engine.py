"""vLLM inference engine: the torch engine's contract on top of vLLM's `AsyncLLM`.

vLLM runs in this process (its engine core and model worker are child processes it
spawns, so entry points need a `if __name__ == "__main__":` guard). One background thread
runs an asyncio loop that owns the `AsyncLLM`; every request is one task on it that
streams vLLM's output deltas (`RequestOutputKind.DELTA`, `logprobs=0`) into the request's
`GenerationStream`. The contract (`rollout_service.engines.api`) maps onto vLLM as follows.

- Log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, so the reported
  log-prob is that of the sampled token under the distribution actually sampled from
  (after temperature and the top-p nucleus, renormalised; Holtzman et al. 2020, Sec. 3.1);
  greedy requests report log softmax of the untempered logits, as the torch engine does.
  The LM head runs in the engine dtype: fp32 with dtype "float32"; with "bfloat16" the
  head is bf16 too (vLLM has no fp32-head option), so the learner/generator log-ratio is
  that of two bf16 paths (SmolLM2: mean |log ratio| 0.03, max 0.23; BENCHMARKS.md). The
  contract suite checks the fp32 engine, within 1e-3 of the learner.
- Per-token policy version: each weight update pauses vLLM's scheduler keeping requests
  and their KV cache (`pause_generation(mode="keep")`), reloads the weights in place,
  labels the engine's weights with the new version (`set_weight_version`) and resumes.
  vLLM stamps every engine step's outputs with the label, so a token's version is that of
  the weights that computed its logits; tokens sampled before the swap keep the old one.
- Interruption-based length control (ScaleRL, Khatri et al. 2025, Sec. 3.1): vLLM cannot
  splice tokens into a running request, so a request runs in phases. The first phase
  samples at most `thinking_budget` tokens; when the budget is reached (or a TRUNCATE
  arrives, which cancels the phase), a continuation request with prompt = prompt +
  completion so far + interrupt phrase is submitted with `prompt_logprobs=0`. Its prompt
  log-probs of the phrase (plain untempered softmax, what the torch engine reports for
  forced tokens) are emitted as forced tokens, then it samples the answer (at most
  `answer_budget` tokens). The continuation's prompt KV is recomputed by the weights
  serving at that time. The budget decisions are `rollout_service.engines.length_control`.
- LoRA (`max_lora_rank`, `rollout_service.engines.vllm.adapters`): a LoRA base reloads as
  full weights do and its adapter becomes the policy's; an adapter alone is written as a
  peft folder and new phases use it at once through its `LoRARequest`, while a running
  phase keeps the adapter it started with (vLLM swaps none under a request), so its
  tokens carry that adapter's version, never a newer label.
- Abort: the request's task is cancelled, which aborts the vLLM request.
- Prefix cache: every request is salted with the policy version it starts under, so
  a request never reuses prompt KV computed by older weights (vLLM cannot clear the
  prefix cache while kept requests hold blocks).

Weight files are validated (`scalerl.weights.check`: names, shapes, float
dtypes, finite values) against the model folder's own safetensors before vLLM sees them,
so a bad update changes nothing. vLLM's model worker reloads them through
`rollout_service.engines.vllm.worker.WorkerExtension`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rollout_service.engines.adapters import FolderAdapters, ServedAdapter, StagedAdapter
from rollout_service.engines.api import (
    ABORT,
    ABORTED,
    LENGTH,
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
from rollout_service.engines.vllm import worker
from rollout_service.engines.vllm.adapters import engine_options, vllm_adapters
from rollout_service.metrics import RolloutMetrics
from scalerl.obs.logging import request_context
from scalerl.policy.architectures import CheckpointNames, check_vllm_serves
from scalerl.policy.lora import BASE_VERSION, LORA_A, LORA_B
from scalerl.rpc.errors import InvalidArgument
from scalerl.weights.check import (
    WeightSpec,
    folder_shapes,
    load_state_dict,
    parse_payload,
    read_header,
)

log = logging.getLogger(__name__)
DTYPES = ("float32", "bfloat16")
# Seeds of a request's later phases: distinct streams derived from the request's seed.
_PHASE_SEED_STRIDE = 1_000_003
_SEED_MODULUS = 2**63 - 1


@dataclass(eq=False)
class _Request(LiveRequest):
    """Loop-thread state of one request."""

    seed: int = 0
    budget: LengthBudget = field(init=False)
    tokens: list[int] = field(default_factory=list)  # completion so far, forced included
    want_force: str | None = None  # "thinking_budget" or "truncate"
    phases: int = 0
    task: asyncio.Task | None = None
    phase: asyncio.Task | None = None

    def __post_init__(self) -> None:
        self.budget = LengthBudget(self.request)


class VLLMEngine:
    """Continuous-batching generation with vLLM, under the engine contract.

    model_path: a transformers model folder with safetensors weights (the engine takes
    token ids, so no tokenizer is needed). stop_token_ids: ids that end a sequence when
    sampled (the model's own EOS is ignored otherwise, as in the torch engine). max_batch:
    concurrent sequences (vLLM max_num_seqs). max_seq_len: prompt + completion tokens.
    dtype: "float32" or "bfloat16" (whole model, LM head included). enforce_eager: skip
    graph compilation (start-up ~20 s instead of ~80 s on a CPU). kv_cache_gib: KV cache
    size on a CPU (GiB); gpu_memory_utilization: fraction of GPU memory on a GPU.
    threads: CPU threads of the model worker (None = vLLM's default). max_lora_rank:
    serve LoRA adapters up to this rank (`vllm.adapters`; None: none). Raises ValueError
    for a bad argument (an MoE family in float32 on a CPU included), FileNotFoundError
    for a folder without safetensors weights, ImportError when vLLM is not installed,
    and a TimeoutError when vLLM does not start within `start_timeout_s` seconds.
    """

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        stop_token_ids: Iterable[int],
        *,
        max_batch: int = 64,
        max_seq_len: int = 512,
        dtype: str = "bfloat16",
        policy_version: int = 0,
        metrics: RolloutMetrics | None = None,
        enforce_eager: bool = True,
        kv_cache_gib: int = 1,
        gpu_memory_utilization: float = 0.4,
        threads: int | None = None,
        start_timeout_s: float = 600.0,
        max_lora_rank: int | None = None,
    ) -> None:
        worker.require_vllm()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if max_batch < 1 or max_seq_len < 2:
            raise ValueError(
                f"max_batch must be >= 1 and max_seq_len >= 2, got {max_batch}, {max_seq_len}"
            )
        self.model_path = Path(model_path)
        config = _checked_config(self.model_path, dtype)
        # The learner's tensors in the checkpoint's names, which vLLM loads (split MoE experts).
        self._names = CheckpointNames(config)
        self._spec = _weight_spec(self.model_path)
        self.vocab_size = int(_hf_config(self.model_path)["vocab_size"])
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self._requests: RequestTable[_Request] = RequestTable(metrics, policy_version)
        self._stop_lock = threading.Lock()
        self._options: dict[str, Any] = {
            "enforce_eager": enforce_eager,
            "gpu_memory_utilization": gpu_memory_utilization,
        }
        # LoRA (`scalerl.policy.lora`): vLLM's adapters, one folder per version.
        self._adapters = vllm_adapters(self.model_path, max_lora_rank) if max_lora_rank else None
        if max_lora_rank:
            self._options |= engine_options(self.model_path, max_lora_rank)
        worker.set_cpu_environment(kv_cache_gib, threads)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine")
        self._thread.daemon = True
        self._thread.start()
        self._swap_lock = asyncio.Lock()  # binds to the engine's loop at first use
        try:
            self._call(self._create(), start_timeout_s)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise

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
        """No-op: vLLM starts in the constructor (kept for the engine interface)."""

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request (ABORTED), fail pending weight updates, shut vLLM down.
        Safe to call more than once."""
        with self._stop_lock:
            if self._requests.closed:
                return
            self._requests.close()
        try:
            self._call(self._shutdown(), timeout + 30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> GenerationStream:
        """Queue a request; returns its stream at once. Raises InvalidArgument naming the
        bad field (`validate_request`), DuplicateRequestError for a request_id still
        running, EngineStopped once the engine is stopping."""
        names = self._adapters.names() if self._adapters is not None else ()
        validate_request(request, self.vocab_size, self.max_seq_len, names)
        stream = GenerationStream(self, request)
        seed = request.seed if request.seed is not None else secrets.randbits(62)
        state = _Request(request, stream, seed=seed)
        self._requests.add(state)
        self._loop.call_soon_threadsafe(self._start_task, state)
        return stream

    def interrupt(self, request_id: str, mode: int) -> bool:
        """TRUNCATE: force the interrupt phrase now and start the answer budget (a no-op
        once forced). ABORT: end the request ABORTED. False when no such request is
        running. Raises InvalidArgument for another mode."""
        check_interrupt_mode(mode)
        if self._requests.get(request_id) is None:
            return False
        self._loop.call_soon_threadsafe(self._control, request_id, mode)
        return True

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> Future:
        """Validate a full HF-named state dict (the tied `lm_head.weight` may be left out),
        write it to a temporary safetensors file and load it like
        `stage_weights_from_file`. A LoRA payload (`scalerl.policy.lora.split_payload`):
        its base likewise, then its adapter as the run's policy adapter; an adapter alone
        must name the base serving, and serves new requests (and phases) at once, those
        running keep theirs. Raises InvalidArgument naming the first bad tensor, or the
        field ("base_version", "version") of a refused update."""
        payload = parse_payload(state_dict)
        if payload.adapter and not payload.base:
            adapters = self._lora("state_dict")
            adapters.check_policy(payload, version, self._requests)
            adapters.serve_policy(payload, version, self._requests)
            done: Future = Future()
            done.set_result(version)
            return done
        base = self._names(payload.base)
        self._spec.check_state_dict(base)
        adapter = None
        if payload.adapter:
            self._lora("state_dict").check_staged(payload)
            adapter = self._lora("state_dict").stage(payload, version)
        handle, path = tempfile.mkstemp(suffix=".safetensors", prefix="scalerl-weights-")
        os.close(handle)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in base.items()}
        save_file(tensors, path)
        return self._stage(path, version, remove=True, adapter=adapter)

    def stage_adapter(self, name: str, state_dict: dict[str, torch.Tensor], version: int) -> Future:
        """Serve the adapter tensors of `state_dict` as adapter `name` (`FolderAdapters`):
        requests naming it get it from now on, their tokens its `version`. Returns a done
        Future. Raises InvalidArgument naming the field: "adapter" without LoRA (no
        `max_lora_rank`) or for an empty name, "state_dict" for a bad tensor, "version"
        for one older than that adapter's."""
        adapters = self._lora("adapter")
        adapters.check_named(name, state_dict, version)
        adapters.serve_named(name, state_dict, version)
        future: Future = Future()
        future.set_result(version)
        return future

    def _lora(self, field: str) -> FolderAdapters:
        if self._adapters is None:
            raise InvalidArgument(field, "this vLLM engine serves no LoRA adapters")
        return self._adapters

    def stage_weights_from_file(self, path: str, version: int) -> Future:
        """Load one safetensors file with HF parameter names at the next step boundary:
        pause (requests and their KV cache kept), reload in place, label the weights
        `version`, resume. Returns a Future resolving to `version` once they serve.
        Raises InvalidArgument (unreadable file, unknown/missing tensor, wrong shape,
        non-float, non-finite values) before anything changes."""
        header = read_header(path)
        if any(name.endswith((LORA_A, LORA_B)) or name == BASE_VERSION for name in header):
            return self.stage_weights(load_state_dict(path), version)  # a LoRA payload
        if not self._names.identity:  # the learner's names: renamed into a staged copy
            return self.stage_weights(load_state_dict(path), version)
        self._spec.check_file(path, values=True)
        return self._stage(str(path), version, remove=False)

    # ----- loop thread -------------------------------------------------------------------

    def _call(self, coroutine, timeout: float | None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _create(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(self.model_path),
            skip_tokenizer_init=True,
            dtype=self.dtype,
            max_model_len=self.max_seq_len,
            max_num_seqs=self.max_batch,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            disable_log_stats=True,
            worker_extension_cls=f"{worker.__name__}.WorkerExtension",
            **self._options,
        )
        self._llm = AsyncLLM.from_engine_args(args)
        await self._llm.engine_core.set_weight_version_async(str(self.policy_version))

    def _stage(
        self, path: str, version: int, remove: bool, adapter: StagedAdapter | None = None
    ) -> Future:
        if self._requests.closed:
            raise EngineStopped()
        try:
            self._requests.accept_version(int(version))  # InvalidArgument("version") if older
        except InvalidArgument:
            if remove:
                os.unlink(path)
            raise
        swap = self._swap(path, int(version), remove, adapter)
        return asyncio.run_coroutine_threadsafe(swap, self._loop)

    async def _swap(
        self, path: str, version: int, remove: bool, adapter: StagedAdapter | None = None
    ) -> int:
        """Pause keeping requests, reload from `path`, relabel, serve `adapter` (a LoRA
        base's) or no policy adapter (full weights), resume."""
        try:
            async with self._swap_lock:
                start = time.monotonic()
                with tempfile.TemporaryDirectory(prefix="scalerl-reload-") as folder:
                    # reload_weights takes a folder; it reads every *.safetensors in it.
                    os.symlink(os.path.abspath(path), os.path.join(folder, "model.safetensors"))
                    await self._llm.pause_generation(mode="keep", clear_cache=False)
                    try:
                        await self._llm.collective_rpc(
                            "scalerl_reload_weights", kwargs={"weights_path": folder}
                        )
                        await self._llm.engine_core.set_weight_version_async(str(version))
                        if self._adapters is not None:
                            self._adapters.serve_base(adapter, version)
                        self._requests.serve(version)
                        # Fails (harmlessly) while kept requests hold blocks; the per-version
                        # cache salt keeps new requests off old-version KV either way.
                        await self._llm.reset_prefix_cache()
                    finally:
                        await self._llm.resume_generation()
        finally:
            if remove:
                os.unlink(path)
        log.info(
            "policy version %d now serving (swap %.3fs, %d running)",
            version,
            time.monotonic() - start,
            len(self._requests),
        )
        return version

    def _start_task(self, state: _Request) -> None:
        state.task = self._loop.create_task(self._serve(state))
        state.task.add_done_callback(lambda task: self._after_task(state, task))

    def _after_task(self, state: _Request, task: asyncio.Task) -> None:
        """A task cancelled before it ever ran skips its own handlers: end it here."""
        if task.cancelled():
            self._requests.finish(state, Chunk.empty(), ABORTED)

    def _control(self, request_id: str, mode: int) -> None:
        state = self._requests.get(request_id)
        if state is None or state.task is None:
            return
        if mode == ABORT:
            self._requests.count_interrupt("abort")
            state.task.cancel()
        elif state.want_force is None and state.budget.truncate():
            state.want_force = "truncate"
            if state.phase is not None:
                state.phase.cancel()

    async def _serve(self, state: _Request) -> None:
        """Run the request's phases until one ends it (the task's own log context)."""
        with request_context(state.request.request_id):
            try:
                reason = 0
                while not reason:
                    state.phase = asyncio.ensure_future(self._run_phase(state))
                    try:
                        reason = await state.phase
                    except asyncio.CancelledError:
                        cancelling = state.task is not None and state.task.cancelling()
                        if state.want_force != "truncate" or cancelling:
                            raise
                    finally:
                        state.phase = None
            except asyncio.CancelledError:
                self._requests.finish(state, Chunk.empty(), ABORTED)
            except Exception as exc:  # noqa: BLE001 - fail this request, keep serving others
                log.exception("request %s failed", state.request.request_id)
                self._requests.fail(state, exc)

    async def _run_phase(self, state: _Request) -> int:
        """One vLLM request: sample (after forcing the phrase, when due). Returns the
        finish reason, or 0 when the request continues in a new phase."""
        from vllm.inputs import TokensPrompt

        request, budget = state.request, state.budget
        phrase: list[int] = []
        if state.want_force and not budget.answering:
            self._requests.count_interrupt(state.want_force)
            state.want_force = None
            phrase = list(budget.force())
        limit = budget.sample_limit()
        if not phrase and limit <= 0:  # nothing to force (empty phrase) and no room
            self._requests.finish(state, Chunk.empty(), LENGTH)
            return LENGTH
        state.phases += 1
        params = self._sampling_params(state, limit, prompt_logprobs=bool(phrase))
        ids = list(request.prompt_ids) + state.tokens + phrase
        prompt = TokensPrompt(prompt_token_ids=ids, cache_salt=f"v{self.policy_version}")
        vllm_id = f"{request.request_id}#{state.phases}"
        received = 0
        prompt_logps: list = []  # prompt log-probs, possibly over several deltas
        finish = None
        # A phase keeps the adapter it started with: its tokens carry that version.
        served = self._adapters.serving(request.adapter) if self._adapters else None
        lora = served.handle if served is not None else None
        stream = self._llm.generate(prompt, params, request_id=vllm_id, lora_request=lora)
        async with contextlib.aclosing(stream):  # leaving early aborts the vLLM request
            async for output in stream:
                completion = output.outputs[0]
                finish = completion.finish_reason
                count = len(completion.token_ids)
                versions = (
                    [served.version] * count
                    if served is not None
                    else self._versions(vllm_id, completion, received, count)
                )
                if phrase:
                    prompt_logps += output.prompt_logprobs or []
                    if len(prompt_logps) < len(ids):
                        continue  # chunked prefill: the rest of the prompt comes later
                    tail = zip(prompt_logps[-len(phrase) :], phrase, strict=True)
                    logps = [float(d[token].logprob) for d, token in tail]
                    version = versions[0] if versions else self._phase_version(served)
                    chunk = self._forced_chunk(state, phrase, logps, version)
                    phrase = []
                    if limit <= 0:  # no room after the phrase: its sampled token is dropped
                        self._requests.finish(state, chunk, LENGTH)
                        return LENGTH
                    self._requests.emit(state, chunk)
                received += count
                reason = self._take_sampled(state, completion, versions)
                if reason >= 0:
                    return reason
        if state.want_force == "thinking_budget":
            return 0
        if budget.thought_closed and finish == "length":  # the thinking budget's phase ended
            return 0  # after the model closed its thinking: go on sampling, no phrase
        raise EngineError(f"vLLM ended request {vllm_id} early (finish_reason {finish!r})")

    def _phase_version(self, served: ServedAdapter | None) -> int:
        return served.version if served is not None else self.policy_version

    def _sampling_params(self, state: _Request, limit: int, prompt_logprobs: bool) -> Any:
        """vLLM sampling parameters of the request's next phase (its own seed stream)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        request = state.request
        return SamplingParams(
            max_tokens=max(limit, 1),  # a phrase with no room left still needs a forward
            temperature=request.temperature,
            top_p=request.top_p,
            seed=(state.seed + (state.phases - 1) * _PHASE_SEED_STRIDE) % _SEED_MODULUS,
            logprobs=0,
            prompt_logprobs=0 if prompt_logprobs else None,
            stop_token_ids=sorted(self.stop_token_ids),
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _take_sampled(self, state: _Request, completion: Any, versions: list[int]) -> int:
        """Emit a delta's sampled tokens. Returns the finish reason when the request ends,
        0 when the thinking budget was reached (force next), -1 to keep streaming."""
        chunk = Chunk.empty()
        for index, token in enumerate(completion.token_ids):
            state.tokens.append(token)
            chunk.token_ids.append(token)
            chunk.logprobs.append(float(completion.logprobs[index][token].logprob))
            chunk.versions.append(versions[index])
            chunk.forced.append(False)
            reason = state.budget.sampled_token(token, self.stop_token_ids)
            if reason:
                self._requests.finish(state, chunk, reason)
                return reason
            if state.budget.thinking_due():
                state.want_force = "thinking_budget"
                self._requests.emit(state, chunk)
                return 0
        self._requests.emit(state, chunk)
        return -1

    def _forced_chunk(
        self, state: _Request, phrase: list[int], logps: list[float], version: int
    ) -> Chunk:
        state.tokens.extend(phrase)
        return Chunk(phrase, logps, [version] * len(phrase), [True] * len(phrase))

    def _versions(self, vllm_id: str, completion: Any, start: int, count: int) -> list[int]:
        """Policy versions of output tokens start..start+count-1 of one vLLM request, from
        vLLM's weight-version spans (final output) or its running span record."""
        spans = completion.weight_versions
        if spans is not None:
            starts = [(span.version, span.start) for span in spans]
        else:
            states = self._llm.output_processor.request_states
            record = getattr(states.get(vllm_id), "weight_version_starts", None)
            starts = list(record or [])
        versions = []
        for index in range(start, start + count):
            label = next((v for v, s in reversed(starts) if s <= index), None)
            known = label is not None and label.isdigit()
            versions.append(int(label) if known and label is not None else self.policy_version)
        return versions

    async def _shutdown(self) -> None:
        tasks = [s.task for s in self._requests.entries() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for state in self._requests.entries():  # submitted but not started yet
            self._requests.finish(state, Chunk.empty(), ABORTED)
        llm, self._llm = self._llm, None
        llm.shutdown()
        del llm  # collected now, not during interpreter teardown (its __del__ shuts down)


def _hf_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _checked_config(folder: Path, dtype: str) -> Any:
    """The folder's transformers config. Raises ValueError, one line naming the field, for
    what vLLM cannot compute here (`scalerl.policy.architectures.check_vllm_serves`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    check_vllm_serves(config, dtype, worker.on_cpu())
    return config


def _weight_spec(folder: Path) -> WeightSpec:
    """What a weight update must hold: the tensors of the folder's own safetensors files
    (a tied `lm_head.weight` may be left out). Raises FileNotFoundError when it has none."""
    shapes = folder_shapes(folder)
    if not shapes:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    tied = bool(_hf_config(folder).get("tie_word_embeddings", False))
    return WeightSpec(shapes, {"lm_head.weight"} if tied else ())
