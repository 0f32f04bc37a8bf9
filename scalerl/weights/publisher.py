"""Weight publication: every new policy version goes to the rollout workers, by the
transport's sender (`scalerl.weights.senders`). Every version is announced in
Redis, so a worker that starts (or restarts) later loads the latest weights before
generating.

The learner's thread only takes a snapshot (a CPU copy of the state dict in the engines'
dtype, the LM head in fp32: a memory copy, well under a second for SmolLM2-135M); the
safetensors serialization, the sha256 and the sender's delivery run in the background
while the learner reads its next batch and steps, as PipelineRL does. (Serializing on the
learner's thread cost 4-17 s of a 13-34 s fp32 step on a 2-core AVX2 machine.) A new
publish first waits for the previous one, so versions arrive in order.

With LoRA adapters (`lora`, `scalerl.policy.lora`) the first publication of the process
carries the base and the adapters (written to a file where the transport has files, held
by the learner where workers pull, recorded as the board's base), every later one the
adapters alone; each names the base version it applies to.

Where the sender takes deltas (`Sender.deltas`, `learner.weights.delta`), the publisher
keeps the last payload and encodes each new one as its delta from it in the same
background thread (`scalerl.weights.delta`; about 0.5 s on one core for SmolLM2-135M);
the sender sends it to whoever holds that payload. A version whose layout differs from
the last one's (a LoRA run's first adapters after the base) or whose delta would not be
smaller goes whole.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from scalerl.config import RunConfig
from scalerl.policy.lora import BASE_VERSION, base_version_tensor
from scalerl.state.registry import WorkerRegistry
from scalerl.state.run_state import RunState
from scalerl.v1 import rollout_pb2
from scalerl.weights import delta
from scalerl.weights.broadcast_send import Delivery
from scalerl.weights.senders import Sender, make_sender
from scalerl.weights.store import WeightStore
from scalerl.weights.wire import (
    FULL,
    LORA_ADAPTER,
    LORA_BASE,
    Delta,
    Part,
    delta_header,
    head_names,
    payload_header,
    snapshot_state_dict,
)

log = logging.getLogger(__name__)


class WeightPublisher:
    """Publishes the model's weights (the body cast to the engines' dtype `dtype`, the LM
    head in fp32) through `sender`, announcing each version in `state`.

    registry: the workers `wait_served` waits for. timeout_s: how long `wait_served`
    waits, seconds. snapshot: how the CPU copy is taken (`snapshot_state_dict`'s
    signature; a sharded learner gathers it across its ranks). lora: the model has LoRA
    adapters; publish the base once, then the adapters alone (module docstring).
    `last_seconds`: snapshot, serialization and delivery of the last completed publish
    (mostly in the background); `last_snapshot_seconds`: the part on the caller's
    thread; `last_bytes`: its payload's size; `last_delta_bytes`: the size of its delta
    from the version before (0: none, it went whole).
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        state: RunState,
        sender: Sender,
        dtype: str,
        timeout_s: float = 120.0,
        snapshot: Callable[..., dict] = snapshot_state_dict,
        lora: bool = False,
    ) -> None:
        self.registry = registry
        self.state = state
        self.sender = sender
        self.dtype = getattr(torch, dtype)
        self.timeout_s = timeout_s
        self._snapshot = snapshot
        self.last_seconds = 0.0
        self.last_snapshot_seconds = 0.0
        self.last_bytes = 0  # payload of the last completed publish
        self.last_delta_bytes = 0
        self._previous: tuple[rollout_pb2.WeightsHeader, bytes] | None = None
        self.lora = lora
        self.base_version: int | None = None  # LoRA: the version that carried the base
        self._base_forgotten = False
        self._sending: threading.Thread | None = None
        self._error: Exception | None = None

    def publish(
        self, model: torch.nn.Module, version: int, force_file: bool = False, wait: bool = False
    ) -> None:
        """Snapshot `model` as `version` and hand it to the sender in the background.

        force_file: write the payload to a file where the transport can (stream: so late
        workers can load the first version). wait: return only once the delivery ended.
        Raises what the previous publish raised in the background (for example OSError:
        disk full)."""
        self.wait()
        start = time.monotonic()
        part = self._part(version)
        snapshot = self._snapshot(model, self.dtype, keep_fp32=head_names(model), part=part)
        if self.base_version is not None:
            snapshot[BASE_VERSION] = base_version_tensor(self.base_version)
        self.last_snapshot_seconds = time.monotonic() - start
        self._sending = threading.Thread(
            target=self._background,
            args=(snapshot, version, force_file, start, part),
            daemon=True,
        )
        self._sending.start()
        if wait:
            self.wait()

    def _part(self, version: int) -> Part:
        """What this version's payload carries: everything without LoRA; with it, the
        base and the adapters the first time, the adapters alone afterwards."""
        if not self.lora:
            return FULL
        if self.base_version is None:
            self.base_version = version
            return LORA_BASE
        return LORA_ADAPTER

    def wait(self) -> None:
        """Block until the previous publish was delivered (or failed). Raises the
        exception that ended the previous publish's serialization or delivery."""
        if self._sending is not None:
            self._sending.join()
            self._sending = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def wait_served(self, poll_s: float = 0.1) -> list[str]:
        """`wait`, then, where the workers fetch the versions the learner holds, also until
        every READY worker serves the last one or a newer one (`VersionBoard.serving`,
        read every `poll_s` seconds, for at most `timeout_s`; a worker that leaves the
        registry is no longer waited for). With the push transports, until the sends a
        delivery left running past its deadline end (`Sender.settle`, at most
        `timeout_s`). Returns the ids of the workers still behind at the deadline (logged),
        [] when all serve it. Raises what `wait` raises."""
        self.wait()
        self.sender.settle(self.timeout_s)
        version = self.sender.held_version()
        if version is None:
            return []
        deadline = time.monotonic() + self.timeout_s
        while True:
            serving = self.state.versions.serving(self.registry)
            behind = [worker for worker, served in serving.items() if served < version]
            if not behind or time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        if behind:
            log.warning("workers %s did not fetch policy version %d in time", behind, version)
        return behind

    def start(self, closing: threading.Event) -> None:
        """Start the sender's own background work (stream's catch-up) until `closing`."""
        self.sender.start(closing)

    def close(self) -> None:
        """Close the sender, which first lets the last publish end where it must (the
        broadcast group's)."""
        self.sender.close(drain=self._drain)

    def _drain(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - reported where the run waited for it
            log.debug("the last publish had failed", exc_info=True)

    def _background(
        self, snapshot: dict, version: int, force_file: bool, start: float, part: Part
    ) -> None:
        base = part == LORA_BASE
        try:
            if part == FULL and not self._base_forgotten:
                self.state.versions.forget_base()  # no LoRA base of an earlier learner
                self._base_forgotten = True
            if not base:  # the base goes once, by the path joiners take too
                self.sender.before_payload(snapshot, version)
            payload = save_safetensors(snapshot)
            del snapshot
            path = self.sender.payload_file(version, force_file or base, base=base)
            header = payload_header(payload, version, str(path) if path is not None else "")
            diff = self._delta(header, payload) if not base else None
            board = self.state.versions
            announce = functools.partial(board.publish, base=base)
            self.sender.deliver(header, payload, announce, pin=base, delta=diff)
            self._previous = (header, payload) if self.sender.deltas else None
            self.last_seconds = time.monotonic() - start
            self.last_bytes = len(payload)
            self.last_delta_bytes = len(diff.data) if diff is not None else 0
        except Exception as exc:  # noqa: BLE001 - handed to the learner's thread by wait()
            log.exception("publishing policy version %d failed", version)
            self._error = exc

    def _delta(self, header: rollout_pb2.WeightsHeader, payload: bytes) -> Delta | None:
        """`payload`'s delta from the previous publish's, when the sender takes deltas and
        it is smaller than the payload."""
        if self._previous is None or not self.sender.deltas:
            return None
        base, base_payload = self._previous
        data = delta.encode(base_payload, payload, base.sha256, header.sha256)
        if data is None or len(data) >= len(payload):
            return None
        return Delta(delta_header(header, base.version, base.sha256, data), data)


def make_publisher(
    config: RunConfig,
    registry: WorkerRegistry,
    state: RunState,
    weights_dir: Path,
    store: WeightStore,
    source: str,
    hosts: tuple[str, str],
    dtype: str,
    snapshot: Callable[..., dict] = snapshot_state_dict,
    on_broadcast: Callable[[Delivery], None] | None = None,
    gpu: str = "",
) -> WeightPublisher:
    """The run's publisher (`dtype`: the engines'; `snapshot`: how its CPU copy is taken)
    over the sender of `config.learner.weights` (`make_sender`, which takes the rest).
    Raises ValueError as `make_sender`."""
    sender = make_sender(
        config, registry, weights_dir, store, source, hosts, on_broadcast=on_broadcast, gpu=gpu
    )
    lora = config.learner.lora is not None
    return WeightPublisher(registry, state, sender, dtype, snapshot=snapshot, lora=lora)
