"""The tests' one fake of `scalerl.weights.sink.WeightSink`: what it is given to stage
serves at once, and `staged` keeps (version, state dict or file path) of every update in
order, `adapters` (name, version, state dict) of every adapter."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class FakeSink:
    """A weight sink serving `version` (and LoRA base `base_version`) until given more."""

    def __init__(self, version: int = 0, base_version: int | None = None) -> None:
        self.policy_version = version
        self.base_version = base_version
        self.staged: list[tuple[int, Any]] = []
        self.adapters: list[tuple[str, int, dict[str, Any]]] = []

    def stage_weights(self, state_dict: dict[str, Any], version: int) -> Future:
        self.staged.append((version, state_dict))
        return self._serves(version)

    def stage_weights_from_file(self, path: str, version: int) -> Future:
        self.staged.append((version, path))
        return self._serves(version)

    def stage_adapter(self, name: str, state_dict: dict[str, Any], version: int) -> Future:
        self.adapters.append((name, version, state_dict))
        done: Future = Future()
        done.set_result(version)
        return done

    def _serves(self, version: int) -> Future:
        self.policy_version = version
        done: Future = Future()
        done.set_result(version)
        return done
