"""gRPC `RolloutService` over one rollout engine (`rollout_service.engines.api`): converts
messages, validates input and calls the engine. Domain errors (`ServiceError`s: the
engine's, `InvalidArgument`, `WeightsError`) propagate to the one error interceptor of
`scalerl.rpc.server`, which maps them to statuses; anything else becomes INTERNAL."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Iterator
from typing import Protocol

import grpc
from grpc_health.v1 import health

from rollout_service.engines.api import (
    MAX_TEMPERATURE,
    Chunk,
    GenerationRequest,
    RolloutEngine,
    check_interrupt_mode,
    finish_reason_enum,
)
from rollout_service.metrics import RolloutMetrics
from rollout_service.trajectories import TrajectoryTable
from scalerl.crash_points import hang_point
from scalerl.obs.logging import request_context
from scalerl.rpc.errors import FailedPrecondition, InvalidArgument
from scalerl.rpc.security import Security
from scalerl.rpc.services import ROLLOUT, serve
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc
from scalerl.weights.broadcast_receive import BroadcastReceiver
from scalerl.weights.receive import ByteBudget, LastPayload, receive_weights
from scalerl.weights.store import WeightStore

log = logging.getLogger(__name__)
# Two full-precision copies of a ~0.5 GB policy (security.max_inflight_weight_bytes).
DEFAULT_INFLIGHT_WEIGHT_BYTES = 2 * 1024**3


# The most FetchWeights streams a relaying worker serves at once (`relay_fanout`'s bound).
RELAY_STREAMS = 16


class TextEncoder(Protocol):
    """What the servicer needs of a tokenizer: text -> token ids (KeyError or ValueError
    for text it cannot encode)."""

    def encode(self, text: str) -> list[int]: ...


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Generate / Interrupt / UpdateWeights / JoinWeightGroup / ReceiveWeights / GetStatus /
    FetchWeights over one engine.

    tokenizer: a `scalerl.policy.models.PolicyTokenizer` (for prompt_text and interrupt text).
    default_interrupt_text: forced phrase when a request leaves it empty.
    default_max_new_tokens: used when a request's max_new_tokens is 0.
    think_end: the model's end-of-thinking marker (`rollout.think_end`; "" = none): forced
    after every interrupt phrase, and a sampled one ends the thinking without a phrase.
    weights_root: the folder an UpdateWeights `uri` must lie in (None or "": `uri` refused).
    max_inflight_weight_bytes: streamed weight bytes buffered at once, over all concurrent
    UpdateWeights streams; one that does not fit is answered RESOURCE_EXHAUSTED.
    broadcast: the worker's membership in the weight group (weight transport `broadcast`);
    None: JoinWeightGroup and ReceiveWeights answer FAILED_PRECONDITION.
    relay_store: the version this worker relays to peers (`learner.weights.relay_fanout`);
    None: FetchWeights answers FAILED_PRECONDITION. last: the last payload the worker
    received (the follower's), the base of a delta UpdateWeights; None: deltas refused.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: TextEncoder,
        worker_id: str,
        model_name: str,
        default_interrupt_text: str,
        default_max_new_tokens: int,
        metrics: RolloutMetrics | None = None,
        think_end: str = "",
        weights_root: str | None = None,
        max_inflight_weight_bytes: int = DEFAULT_INFLIGHT_WEIGHT_BYTES,
        broadcast: BroadcastReceiver | None = None,
        trajectories: TrajectoryTable | None = None,
        relay_store: WeightStore | None = None,
        last: LastPayload | None = None,
    ) -> None:
        self._engine = engine
        self._last = last
        self._trajectories = TrajectoryTable() if trajectories is None else trajectories
        self._tokenizer = tokenizer
        self._worker_id = worker_id
        self._model_name = model_name
        self._think_end_ids = tuple(tokenizer.encode(think_end)) if think_end else ()
        self._default_interrupt_ids = (
            tuple(tokenizer.encode(default_interrupt_text)) + self._think_end_ids
        )
        self._default_max_new_tokens = default_max_new_tokens
        self._metrics = metrics
        self._weights_root = weights_root or None
        self._weight_budget = ByteBudget(max_inflight_weight_bytes)
        self._broadcast = broadcast
        self._relay_store = relay_store

    def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[rollout_pb2.GenerateResponse]:
        engine_request = self.to_engine_request(request)
        request_id, prompt_tokens = engine_request.request_id, len(engine_request.prompt_ids)
        with request_context(request_id):
            stream = self._engine.submit(engine_request)
        # Runs when the RPC ends for any reason; after a normal finish it finds nothing.
        context.add_callback(stream.cancel)
        chunks = stream.chunks()
        while True:
            # The log context is entered per chunk, never held across a yield: a generator
            # abandoned by a cancelled client may be finalized late, by another thread,
            # and must not leave its request id on this one.
            with request_context(request_id):
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield _response(request_id, prompt_tokens, chunk)

    def Interrupt(
        self, request: rollout_pb2.InterruptRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.InterruptResponse:
        check_interrupt_mode(request.mode)
        with request_context(request.request_id):
            found = self._trajectories.interrupt(request.request_id, request.mode)
            if found is None:  # a request (or one turn of a trajectory) on the engine
                found = self._engine.interrupt(request.request_id, request.mode)
        return rollout_pb2.InterruptResponse(found=found)

    def UpdateWeights(
        self,
        request_iterator: Iterator[rollout_pb2.UpdateWeightsRequest],
        context: grpc.ServicerContext,
    ) -> rollout_pb2.UpdateWeightsResponse:
        version, seconds = receive_weights(
            request_iterator,
            self._engine,
            weights_root=self._weights_root,
            budget=self._weight_budget,
            last=self._last,
        )
        if self._metrics is not None:
            self._metrics.weight_update_seconds.observe(seconds)
        log.info("weights of policy version %d applied in %.3fs", version, seconds)
        return rollout_pb2.UpdateWeightsResponse(policy_version=version, seconds=seconds)

    def JoinWeightGroup(
        self, request: rollout_pb2.JoinWeightGroupRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.JoinWeightGroupResponse:
        self._broadcast_receiver().join(request)
        return rollout_pb2.JoinWeightGroupResponse(epoch=request.epoch, rank=request.rank)

    def ReceiveWeights(
        self, request: rollout_pb2.ReceiveWeightsRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        if request.version < 0:
            raise InvalidArgument("version", f"must be >= 0, got {request.version}")
        version, seconds = self._broadcast_receiver().receive(request.epoch, request.version)
        if self._metrics is not None:
            self._metrics.weight_update_seconds.observe(seconds)
        log.info("broadcast weights of policy version %d applied in %.3fs", version, seconds)
        return rollout_pb2.UpdateWeightsResponse(policy_version=version, seconds=seconds)

    def FetchWeights(
        self, request: rollout_pb2.FetchWeightsRequest, context: grpc.ServicerContext
    ) -> Iterator[rollout_pb2.FetchWeightsChunk]:
        if self._relay_store is None:
            raise FailedPrecondition(
                "learner.weights.relay_fanout: this worker does not relay weights (0)"
            )
        hang_point("relay.serve")  # fault tests: a holder that accepted and hangs
        return self._relay_store.chunks(request)

    def _broadcast_receiver(self) -> BroadcastReceiver:
        if self._broadcast is None:
            raise FailedPrecondition(
                "learner.weights.transport: this worker is not configured for 'broadcast'"
            )
        return self._broadcast

    def GetStatus(
        self, request: rollout_pb2.GetRolloutStatusRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.GetRolloutStatusResponse:
        return rollout_pb2.GetRolloutStatusResponse(
            worker_id=self._worker_id,
            engine=self._engine.name,
            model=self._model_name,
            policy_version=self._engine.policy_version,
            active_requests=self._engine.active_requests,
            tokens_generated=self._engine.tokens_generated,
        )

    # ----- conversion ----------------------------------------------------------------------

    def to_engine_request(self, request: rollout_pb2.GenerateRequest) -> GenerationRequest:
        """Validate a GenerateRequest and fill defaults. Raises InvalidArgument naming the
        field (prompt, sampling.*, length_control.*)."""
        prompt = self._prompt_ids(request)
        sampling, control = request.sampling, request.length_control
        temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
        if math.isnan(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise InvalidArgument(
                "sampling.temperature", f"must lie in [0, {MAX_TEMPERATURE}], got {temperature}"
            )
        top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
        if math.isnan(top_p) or not 0.0 < top_p <= 1.0:
            raise InvalidArgument("sampling.top_p", f"must lie in (0, 1], got {top_p}")
        max_new = sampling.max_new_tokens or self._default_max_new_tokens
        limit = self._engine.max_seq_len
        if len(prompt) + max_new > limit:
            raise InvalidArgument(
                "sampling.max_new_tokens",
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) must be <= {limit}",
            )
        if control.thinking_budget and control.thinking_budget >= max_new:
            raise InvalidArgument(
                "length_control.thinking_budget",
                f"must be < max_new_tokens ({max_new}), got {control.thinking_budget}",
            )
        return GenerationRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_ids=prompt,
            max_new_tokens=max_new,
            temperature=temperature,
            top_p=top_p,
            seed=sampling.seed if sampling.HasField("seed") else None,
            thinking_budget=control.thinking_budget,
            answer_budget=control.answer_budget,
            interrupt_ids=self._interrupt_ids(control.interrupt_text),
            think_end_ids=self._think_end_ids,
            adapter=request.adapter,
        )

    def _prompt_ids(self, request: rollout_pb2.GenerateRequest) -> tuple[int, ...]:
        has_text, has_ids = bool(request.prompt_text), bool(request.prompt_token_ids)
        if has_text == has_ids:
            raise InvalidArgument("prompt", "set exactly one of prompt_text or prompt_token_ids")
        if has_ids:
            vocab = self._engine.vocab_size
            bad = [t for t in request.prompt_token_ids if t >= vocab]
            if bad:
                raise InvalidArgument(
                    "prompt_token_ids", f"token id {bad[0]} outside 0..{vocab - 1}"
                )
            return tuple(request.prompt_token_ids)
        return tuple(self._encode("prompt_text", request.prompt_text))

    def _interrupt_ids(self, text: str) -> tuple[int, ...]:
        if not text:
            return self._default_interrupt_ids
        return tuple(self._encode("length_control.interrupt_text", text)) + self._think_end_ids

    def _encode(self, field: str, text: str) -> list[int]:
        try:
            ids = self._tokenizer.encode(text)
        except (KeyError, ValueError) as exc:  # the character tokenizer's unknown symbol
            raise InvalidArgument(field, f"cannot be tokenized: {exc}") from exc
        if not ids:
            raise InvalidArgument(field, "encodes to no tokens")
        return ids


def _response(request_id: str, prompt_tokens: int, chunk: Chunk) -> rollout_pb2.GenerateResponse:
    return rollout_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=chunk.token_ids,
        logprobs=chunk.logprobs,
        policy_versions=chunk.versions,
        forced=chunk.forced,
        finish_reason=finish_reason_enum(chunk.finish_reason),
        prompt_tokens=prompt_tokens,
    )


def start_server(
    servicer: RolloutServicer,
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int | None = None,
    security: Security | None = None,
    advertise_host: str | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Serve `servicer` (`scalerl.rpc.services.serve`); returns (server, bound port,
    health servicer). security: token and TLS (default: the process's). advertise_host:
    the host the run dials this worker by (its registry address's; default: `host`).

    Each open Generate stream holds a server thread, so the pool defaults to the engine's
    slot count plus room for Interrupt, UpdateWeights, GetStatus and health checks, and
    for a relaying worker the most FetchWeights streams it serves (`relay_fanout` <= 16),
    which must not take the threads the others need."""
    relay = RELAY_STREAMS if servicer._relay_store is not None else 0
    workers = max_workers or servicer._engine.max_batch + 16 + relay
    return serve(
        ROLLOUT,
        servicer,
        port,
        host,
        max_workers=workers,
        security=security,
        advertise_host=advertise_host,
    )
