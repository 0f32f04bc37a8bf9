"""Torch inference engine: continuous batching over one slot KV cache.

One background thread owns the model and runs a loop of *steps*. Each step:

1. swaps in staged weights, if any (the decode-step boundary: in-flight sequences keep
   their KV cache, as in PipelineRL's in-flight weight update);
2. applies interrupts (ABORT, TRUNCATE) that arrived since the last step;
3. admits waiting requests into free slots and prefills them in ONE forward over a
   right-padded batch of their distinct prompts (G requests with the same prompt share a
   row; its KV is copied into the others' slots). A request whose prompt extends a parked
   sequence (a multi-turn trajectory's previous turn, `keep_cache`) takes that slot and
   prefills only the new tokens, in the same forward. Admission is in arrival order and stops
   before the distinct prompts, padded to the longest, would pass `max_prefill_tokens`
   (the first is always admitted), which bounds the prefill's memory;
4. forces the interrupt phrase for requests that asked for it (thinking budget reached,
   or a TRUNCATE), all of them in one batched extend;
5. feeds last step's sampled tokens to the model as one batch (one position per slot),
   then samples one token for every running request (`sampling.sample`) and emits it.

Every emitted token carries the policy version of the weights that computed the logits
it came from. Because step 1 precedes the forward of step 5, every token sampled after a
swap carries the new version. A lender worker's engine (`gate`, `scalerl.lending`) runs
steps 1-2 at once and steps 3-5 only while the learner lends it its cores. Forced tokens
get the log-prob under the plain untempered softmax. The contract is
`rollout_service.engines.api`; the length-control decisions are
`rollout_service.engines.length_control`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from rollout_service.engines.api import (
    ABORT,
    ABORTED,
    LENGTH,
    Chunk,
    EngineStopped,
    GenerationRequest,
    GenerationStream,
    check_interrupt_mode,
    validate_request,
)
from rollout_service.engines.length_control import LengthBudget
from rollout_service.engines.requests import LiveRequest, RequestTable
from rollout_service.engines.torch.adapters import POLICY, Adapter
from rollout_service.engines.torch.decoder import SlotDecoder, StagedWeights
from rollout_service.engines.torch.sampling import sample
from rollout_service.metrics import RolloutMetrics
from scalerl.lending import Borrower
from scalerl.policy.routing import to_message
from scalerl.rpc.errors import InvalidArgument
from scalerl.weights.check import (
    AdapterSpec,
    WeightSpec,
    check_adapter_base,
    load_state_dict,
    parse_payload,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(eq=False)
class _Seq(LiveRequest):
    """Engine-thread state of one request."""

    generator: torch.Generator | None = None
    budget: LengthBudget = field(init=False)
    slot: int = -1
    length: int = 0  # tokens in the KV cache
    next_logits: torch.Tensor | None = None  # [vocab] fp32: distribution of the next token
    logits_version: int = 0
    unfed: int | None = None  # sampled token not yet in the KV cache
    want_force: str | None = None  # reason to force the phrase at the next step
    emitted: list[int] = field(default_factory=list)  # tokens emitted, in cache order
    reused: int = 0  # prompt tokens whose KV came from a parked slot

    def __post_init__(self) -> None:
        self.budget = LengthBudget(self.request)

    def pending_logits(self) -> torch.Tensor:
        """`next_logits` [vocab] fp32; raises RuntimeError before the prefill set them."""
        if self.next_logits is None:
            raise RuntimeError(f"request {self.request.request_id!r} has no logits yet")
        return self.next_logits


@dataclass(eq=False)
class _Staged:
    staged: StagedWeights
    version: int
    future: Future


class TorchEngine:
    """Continuous-batching generation over an HF causal LM with a slot KV cache.

    model: an HF causal LM of a served family (`scalerl.policy.architectures`; ValueError
    otherwise); the engine takes ownership (it is cast in place to
    `dtype` and its parameters are overwritten by weight updates). stop_token_ids: token
    ids that end a sequence when sampled. max_batch: KV-cache slots (concurrent sequences;
    others wait). max_seq_len: prompt + completion tokens per slot. dtype: "float32" or
    "bfloat16" body (the head is always fp32). metrics: an optional `RolloutMetrics`.
    autostart=False leaves the loop thread off so tests can drive `step()` by hand.
    max_prefill_tokens: token budget of one step's batched prefill, counted as distinct
    prompts x the longest of them (padding included); a single longer prompt is still
    admitted, alone. max_lora_rank: the highest LoRA rank an adapter may have. gate: a
    lender worker's `scalerl.lending.Borrower`: the loop passes it before each step, so
    the step waits while the learner has its cores back. Raises
    ValueError for an unknown dtype, max_batch < 1, max_seq_len < 2 or
    max_prefill_tokens < 1.

    LoRA (`rollout_service.engines.torch.adapters`): a LoRA run's updates are its adapter
    (the policy's, served to every request that names none) on the base its first
    version carried (`base_version`); `stage_adapter` serves further adapters by name,
    side by side, each request choosing one (`GenerationRequest.adapter`) and its tokens
    stamped with that adapter's version.
    """

    name = "torch"

    def __init__(
        self,
        model: torch.nn.Module,
        stop_token_ids: Iterable[int],
        max_batch: int = 64,
        max_seq_len: int = 512,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        policy_version: int = 0,
        metrics: RolloutMetrics | None = None,
        autostart: bool = True,
        max_prefill_tokens: int = 2048,
        max_lora_rank: int = 256,
        gate: Borrower | None = None,
    ) -> None:
        torch_dtype = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
        if torch_dtype is None or torch_dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if max_batch < 1 or max_seq_len < 2:
            raise ValueError(
                f"max_batch must be >= 1 and max_seq_len >= 2, got {max_batch}, {max_seq_len}"
            )
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.decoder = SlotDecoder(model, max_batch, max_seq_len, torch_dtype, device)
        # The tied head is the embedding: a state dict may leave lm_head.weight out.
        optional = {"lm_head.weight"} if self.decoder.tied else set()
        self._spec = WeightSpec(self.decoder.parameter_shapes(), optional)
        self._adapter_spec = AdapterSpec(self.decoder.adaptable, max_lora_rank)
        # The base the policy adapter applies to: serving, and newest serving or staged.
        self._base_version: int | None = None
        self._newest_base: int | None = None
        self._adapter_versions: dict[str, int] = {}  # named adapters: newest staged
        self._adapter_serving: dict[str, int] = {}  # named adapters: the version serving
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.vocab_size = self.decoder.vocab_size
        self.dtype = torch_dtype
        self._requests: RequestTable[_Seq] = RequestTable(metrics, policy_version)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[_Seq] = deque()
        self._controls: list[tuple[str, int]] = []
        self._staged: list[_Staged] = []
        self._active: dict[int, _Seq] = {}  # slot -> seq (engine thread only)
        self._free = list(range(max_batch - 1, -1, -1))
        # Slots whose KV a finished `keep_cache` request left, with the ids in them, oldest
        # first; taken over by a continuation, else evicted when a slot is needed.
        self._parked: OrderedDict[int, tuple[str, tuple[int, ...]]] = OrderedDict()
        self.prefix_tokens_reused = 0  # prompt tokens a continuation did not prefill
        self._stopping = False
        self._gate = gate
        self._thread: threading.Thread | None = None
        if autostart:
            self.start()

    # ----- public API (any thread) -------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Version of the weights now serving."""
        return self._requests.policy_version

    @property
    def active_requests(self) -> int:
        """Requests submitted and not yet finished (running or waiting for a slot)."""
        return len(self._requests)

    @property
    def tokens_generated(self) -> int:
        """Completion tokens emitted since start, forced tokens included."""
        return self._requests.tokens_generated

    def start(self) -> None:
        """Start the background loop (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; running and waiting requests end ABORTED, pending weight
        updates fail with EngineStopped."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._shutdown()

    def submit(self, request: GenerationRequest) -> GenerationStream:
        """Queue a request; returns its stream at once. Raises InvalidArgument naming the
        bad field (`validate_request`), DuplicateRequestError for a request_id already
        running, and EngineStopped once the engine is stopping."""
        validate_request(request, self.vocab_size, self.max_seq_len, self._adapter_versions)
        stream = GenerationStream(self, request)
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        generator = None
        if request.temperature > 0:
            generator = torch.Generator().manual_seed(seed)
        seq = _Seq(request, stream, generator=generator)
        with self._wake:
            if self._stopping:
                raise EngineStopped()
            self._requests.add(seq)
            self._waiting.append(seq)
            self._wake.notify_all()
        return stream

    def interrupt(self, request_id: str, mode: int) -> bool:
        """TRUNCATE: force the interrupt phrase at the next step and start the answer budget
        (a no-op if the phrase was already forced). ABORT: end the request (ABORTED).
        Returns False when no running or waiting request has that id. Raises
        InvalidArgument for another mode."""
        check_interrupt_mode(mode)
        with self._wake:
            if self._requests.get(request_id) is None:
                return False
            self._controls.append((request_id, mode))
            self._wake.notify_all()
        return True

    @property
    def base_version(self) -> int | None:
        """The version of the LoRA base serving (the first version of the learner that
        published it), None when no LoRA base was loaded."""
        return self._base_version

    @property
    def adapters(self) -> list[str]:
        """Names of the adapters serving ("" is the run's policy adapter)."""
        return sorted(self.decoder.adapters.adapters)

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> Future:
        """Validate a payload and stage it; the loop applies it at the next decode-step
        boundary. The payload (`scalerl.policy.lora.split_payload`) is full weights
        (`WeightSpec.check_state_dict`), a LoRA base with its adapter, or an adapter alone
        (`AdapterSpec.check`), which must name the base serving or staged. Returns a
        Future whose result is `version` once the new weights serve. Raises
        InvalidArgument naming the first bad tensor, (field "base_version") an adapter
        for another base, or (field "version") a version older than the one serving or
        staged (nothing changes then), EngineStopped once stopping. Several updates
        staged before a boundary are applied in order at that boundary."""
        payload = parse_payload(state_dict)
        if payload.base:
            self._spec.check_state_dict(payload.base)
        if payload.adapter:
            self._adapter_spec.check(payload.adapter)
        staged = self.decoder.prepare_weights(payload)
        future: Future = Future()
        with self._wake:
            if self._stopping:
                raise EngineStopped()
            if not payload.base:
                check_adapter_base(payload.base_version, self._newest_base)
            self._requests.accept_version(int(version))
            if payload.base:
                self._newest_base = payload.base_version
            self._staged.append(_Staged(staged, int(version), future))
            self._wake.notify_all()
        return future

    def stage_adapter(self, name: str, state_dict: dict[str, torch.Tensor], version: int) -> Future:
        """Serve the adapter tensors of `state_dict` (wire names, `scalerl.policy.lora`)
        as adapter `name`, on whatever base serves, from the next decode-step boundary;
        requests naming it get it, and their tokens its `version`. Returns a Future whose
        result is `version` once it serves. Raises InvalidArgument naming the field: an
        empty `name` (the policy's adapter comes with the run's updates), a bad tensor,
        or a version older than the one of `name` serving or staged."""
        if not name:
            raise InvalidArgument("adapter", "must be a non-empty name")
        self._adapter_spec.check(state_dict)
        staged = StagedWeights({}, None, Adapter.of(state_dict, self.dtype, self.decoder.device))
        staged.adapter_name = name
        future: Future = Future()
        with self._wake:
            if self._stopping:
                raise EngineStopped()
            newest = self._adapter_versions.get(name, -1)
            if version < newest:
                raise InvalidArgument(
                    "version", f"{version} is older than version {newest} of adapter {name!r}"
                )
            self._adapter_versions[name] = version
            self._staged.append(_Staged(staged, int(version), future))
            self._wake.notify_all()
        return future

    def stage_weights_from_file(self, path: str, version: int) -> Future:
        """Stage the weights of one safetensors file with HF parameter names (what the
        learner publishes for the `uri` transport): read it, then as `stage_weights`.
        Raises InvalidArgument for an unreadable file or a bad tensor; nothing changes
        then."""
        return self.stage_weights(load_state_dict(path), version)

    # ----- loop (engine thread) ----------------------------------------------------------

    def step(self) -> bool:
        """Run one loop iteration (see the module docstring). Returns False when there was
        nothing to do. Called by the loop thread; tests with autostart=False call it."""
        housekept = self._housekeep()
        return self._generate() or housekept

    def _housekeep(self) -> bool:
        """Apply staged weights and queued controls (interrupts, aborts); False when
        there were none."""
        with self._lock:
            staged, self._staged = self._staged, []
            controls, self._controls = self._controls, []
        self._apply_weights(staged)
        for request_id, mode in controls:
            self._control(request_id, mode)
        return bool(staged or controls)

    def _generate(self) -> bool:
        """Admit waiting requests (prefill), force phrases, decode one token for every
        running one; False when nothing ran or waited."""
        with self._lock:  # after the controls, so an aborted waiting request is gone
            admitted = self._take_waiting()
        busy = bool(admitted or self._active)
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
                self.step() if self._gate is None else self._gated_step(self._gate)
            except Exception as exc:  # keep serving others: fail only the running requests
                log.exception("engine step failed; failing %d requests", len(self._active))
                for seq in list(self._active.values()):
                    self._fail(seq, exc)

    def _gated_step(self, gate: Borrower) -> None:
        """A lender's step: weights and controls at once (an update, which the learner
        waits for, never waits for the gate), generation only through it. While the gate
        is closed, new weights, controls or a stop end the wait (the loop comes back)."""
        self._housekeep()
        if not (self._active or self._waiting):
            return
        if not gate.enter(lambda: self._stopping or bool(self._staged or self._controls)):
            return
        try:
            self._generate()
        finally:
            gate.leave()

    def _version_of(self, seq: _Seq) -> int:
        """The version of the weights `seq` is served with: its named adapter's, else the
        run's policy version."""
        name = seq.request.adapter
        return self._adapter_serving.get(name, 0) if name else self.policy_version

    def _has_work(self) -> bool:
        return bool(self._active or self._waiting or self._controls or self._staged)

    def _take_waiting(self) -> list[_Seq]:
        """Requests to admit this step, in arrival order (caller holds the lock): one per
        free slot while the distinct prompts padded to the longest fit max_prefill_tokens.
        Stops at the first prompt that does not fit, so none is overtaken indefinitely."""
        taken: list[_Seq] = []
        distinct: set[tuple[int, ...]] = set()
        longest = 0
        while self._waiting and len(taken) < len(self._free) + len(self._parked):
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
                self.decoder.load_weights(item.staged)
            except Exception as exc:  # validated already; only a device fault lands here
                item.future.set_exception(exc)
                for later in staged[index + 1 :]:
                    if later.future.set_running_or_notify_cancel():
                        later.future.set_exception(exc)
                raise
            if item.staged.adapter_name == POLICY:
                self._requests.serve(item.version)
                if item.staged.tensors:
                    self._base_version = item.staged.base_version
            else:
                self._adapter_serving[item.staged.adapter_name] = item.version
            item.future.set_result(item.version)
            log.info(
                "policy version %d now serving (swap %.3fs, %d running)",
                item.version,
                time.monotonic() - start,
                len(self._active),
            )

    def _control(self, request_id: str, mode: int) -> None:
        seq = self._requests.get(request_id)
        if seq is None:
            return
        if mode == ABORT:
            self._requests.count_interrupt("abort")
            if seq.slot < 0:  # still waiting for a slot
                with self._lock:
                    if seq in self._waiting:
                        self._waiting.remove(seq)
            self._finish(seq, Chunk.empty(), ABORTED)
        elif seq.want_force is None and seq.budget.truncate():
            seq.want_force = "truncate"

    def _admit(self, seqs: list[_Seq]) -> None:
        """Prefill new requests: one batched forward over their distinct prompts and the
        new tokens of continuations, then the KV of each prompt is copied into the slots
        of the other requests sharing it."""
        continuing = [seq for seq in seqs if self._continue(seq)]
        for seq in seqs:  # all active first, so a failing prefill fails all of them
            if seq.slot < 0:
                seq.slot = self._free.pop() if self._free else self._evict()
            self._active[seq.slot] = seq
            self.decoder.assign_adapter(seq.slot, seq.request.adapter)
        # One prefill row per distinct prompt and adapter (an adapter changes the KV).
        first: dict[tuple[str, tuple[int, ...]], _Seq] = {}
        for seq in seqs:
            if not seq.reused:
                first.setdefault(_prefix_key(seq), seq)
        rows = [*first.values(), *continuing]
        if rows:
            logits = self.decoder.extend_batch(
                [seq.slot for seq in rows],
                [seq.reused for seq in rows],
                [seq.request.prompt_ids[seq.reused :] for seq in rows],
            )
            for seq, row in zip(rows, logits, strict=True):
                seq.next_logits = row
        for seq in seqs:
            prompt = seq.request.prompt_ids
            seq.length = len(prompt)
            seq.logits_version = self._version_of(seq)
            source = first.get(_prefix_key(seq), seq)
            if source is not seq:
                self.decoder.copy_prefix(source.slot, seq.slot, len(prompt))
                seq.next_logits = source.next_logits

    def _continue(self, seq: _Seq) -> bool:
        """Give `seq` the parked slot holding the longest prefix of its prompt, if any;
        it then prefills from there (at least its last prompt token, for its logits)."""
        adapter, prompt = _prefix_key(seq)
        best, best_len = -1, 0
        for slot, (parked_adapter, ids) in self._parked.items():
            fits = best_len < len(ids) <= len(prompt) and prompt[: len(ids)] == ids
            if fits and parked_adapter == adapter:
                best, best_len = slot, len(ids)
        if best < 0:
            return False
        del self._parked[best]
        seq.slot, seq.reused = best, min(best_len, len(prompt) - 1)
        self.prefix_tokens_reused += seq.reused
        return True

    def _evict(self) -> int:
        """The oldest parked slot, given up (its KV is overwritten)."""
        slot, _ = self._parked.popitem(last=False)
        return slot

    def _force_phrases(self, seqs: list[_Seq]) -> None:
        """Append each request's interrupt phrase (as much as its max_new_tokens leaves room
        for), all rows in one batched extend; forced tokens get the plain (untempered)
        log-prob. The batch holds at most max_batch rows of 1 + len(phrase) tokens."""
        phrases = []
        for seq in seqs:
            reason, seq.want_force = seq.want_force or "", None
            self._requests.count_interrupt(reason)
            phrases.append(list(seq.budget.force()))
        rows = [(seq, phrase) for seq, phrase in zip(seqs, phrases, strict=True) if phrase]
        outputs = []
        if rows:
            outputs = self.decoder.extend_batch(
                [seq.slot for seq, _ in rows],
                [seq.length for seq, _ in rows],
                [([seq.unfed] if seq.unfed is not None else []) + phrase for seq, phrase in rows],
                all_logits=True,
            )
        chunks: dict[int, Chunk] = {}  # by id(seq)
        for (seq, phrase), out in zip(rows, outputs, strict=True):
            chunks[id(seq)] = self._forced_chunk(seq, phrase, out)
        for seq in seqs:
            chunk = chunks.get(id(seq), Chunk.empty())
            if seq.budget.length_reason():
                self._finish(seq, chunk, LENGTH)
            else:
                self._requests.emit(seq, chunk)

    def _forced_chunk(self, seq: _Seq, phrase: list[int], out: torch.Tensor) -> Chunk:
        """Update `seq` after its phrase went into the cache; out [len(chunk), vocab] fp32
        are the logits of the extended chunk ([unfed] + phrase, or phrase alone)."""
        if seq.unfed is None:  # the first phrase token is predicted by the pending logits
            out = torch.cat([seq.pending_logits()[None], out])
        logp = torch.log_softmax(out[: len(phrase)], dim=-1)
        picked = logp.gather(1, torch.tensor(phrase)[:, None].to(logp.device))[:, 0]
        seq.length += len(phrase) + (0 if seq.unfed is None else 1)
        seq.unfed = None
        seq.emitted += phrase
        seq.next_logits = out[-1]
        version = seq.logits_version = self._version_of(seq)
        return Chunk(phrase, picked.tolist(), [version] * len(phrase), [True] * len(phrase))

    def _decode(self) -> None:
        """Feed last step's tokens as one batch, then sample one token per request."""
        feed = [seq for seq in self._active.values() if seq.unfed is not None]
        if feed:
            logits = self.decoder.decode(
                torch.tensor([seq.slot for seq in feed]),
                torch.tensor([seq.length for seq in feed]),
                torch.tensor([seq.unfed for seq in feed]),
            )
            for row, seq in enumerate(feed):
                seq.next_logits = logits[row]
                seq.logits_version = self._version_of(seq)
                seq.length += 1
                seq.unfed = None
        seqs = list(self._active.values())
        tokens, logprobs = sample(
            torch.stack([seq.pending_logits() for seq in seqs]),
            [seq.request.temperature for seq in seqs],
            [seq.request.top_p for seq in seqs],
            [seq.generator for seq in seqs],
        )
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True):
            self._after_sample(seq, token, logprob)

    def _after_sample(self, seq: _Seq, token: int, logprob: float) -> None:
        """Emit a sampled token and decide whether the request ends or must be forced."""
        seq.unfed = token
        seq.emitted.append(token)
        chunk = Chunk([token], [logprob], [seq.logits_version], [False])
        reason = seq.budget.sampled_token(token, self.stop_token_ids)
        if reason:
            self._finish(seq, chunk, reason)
            return
        if seq.budget.thinking_due():
            seq.want_force = "thinking_budget"
        self._requests.emit(seq, chunk)

    def _finish(self, seq: _Seq, chunk: Chunk, reason: int) -> None:
        if seq.slot >= 0 and self._active.get(seq.slot) is seq:
            routes = self.decoder.routed_experts(seq.slot, seq.length)
            chunk.routed_experts = None if routes is None else to_message(routes)
        self._release(seq, park=seq.request.keep_cache and reason != ABORTED)
        self._requests.finish(seq, chunk, reason)

    def _fail(self, seq: _Seq, exc: BaseException) -> None:
        self._release(seq, park=False)
        self._requests.fail(seq, exc)

    def _release(self, seq: _Seq, park: bool) -> None:
        """Free the request's slot, if it holds one; with `park`, keep its KV for a
        continuation: the prompt and the emitted tokens already in the cache."""
        if seq.slot >= 0 and self._active.get(seq.slot) is seq:
            del self._active[seq.slot]
            in_cache = seq.length - len(seq.request.prompt_ids)
            if park and in_cache >= 0:
                ids = seq.request.prompt_ids + tuple(seq.emitted[:in_cache])
                self._parked[seq.slot] = (seq.request.adapter, ids)
            else:
                self._free.append(seq.slot)

    def _shutdown(self) -> None:
        """End everything left after the loop stopped (caller's thread)."""
        with self._lock:
            staged, self._staged = self._staged, []
            self._waiting.clear()
        for item in staged:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(EngineStopped("the engine stopped before the swap"))
        for seq in self._requests.close():
            self._finish(seq, Chunk.empty(), ABORTED)


def _prefix_key(seq: _Seq) -> tuple[str, tuple[int, ...]]:
    """What a request's prompt KV depends on: its adapter and its prompt ids."""
    return seq.request.adapter, seq.request.prompt_ids
