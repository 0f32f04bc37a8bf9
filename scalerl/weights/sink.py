"""What an engine offers to receive weights: the one interface every receiving end of a
transport (`receive`, `pull`, `relay`, `broadcast_receive`, `follower`) stages through.
Every rollout engine is one (`rollout_service.engines.api.RolloutEngine` extends it);
the tests' fake sinks are too. Torch-free: a state dict is typed by its keys alone."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class WeightSink(Protocol):
    """Stages policy versions and says which one serves."""

    @property
    def policy_version(self) -> int:
        """Version of the weights now serving."""
        ...

    @property
    def base_version(self) -> int | None:
        """The version of the LoRA base serving (`scalerl.policy.lora`: a LoRA run's
        adapters name it), None when none was loaded (engines without LoRA: always)."""
        ...

    def stage_weights(self, state_dict: dict[str, Any], version: int) -> Future[int]:
        """Validate and stage a full HF-named state dict (with LoRA: a base and its
        adapters, or adapters alone, `scalerl.policy.lora`); the future resolves to
        `version` once it serves. Raises InvalidArgument naming the bad tensor (nothing
        changes) or EngineStopped."""
        ...

    def stage_weights_from_file(self, path: str, version: int) -> Future[int]:
        """As `stage_weights`, from one safetensors file with HF parameter names."""
        ...

    def stage_adapter(self, name: str, state_dict: dict[str, Any], version: int) -> Future[int]:
        """Serve the LoRA adapter tensors of `state_dict` (`scalerl.policy.lora`'s wire
        names) as adapter `name` beside the run's policy, from the next step boundary:
        requests naming it (`GenerationRequest.adapter`) get it, their tokens its
        `version`. Returns a Future resolving to `version` once it serves. Raises
        InvalidArgument naming the field ("adapter" on engines that serve no adapters
        side by side)."""
        ...
