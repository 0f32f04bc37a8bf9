"""LoRA adapters on vLLM (`enable_lora`): each version of an adapter is written as a peft
folder (adapter_config.json, adapter_model.safetensors) and served through its own
`LoRARequest`, loaded by vLLM in flight at its first use, without restarting the engine.

A request phase takes the adapter serving when it starts (`serving`) and keeps it to its
end; its tokens are stamped with that adapter's version (vLLM cannot swap an adapter
under a running request, so, unlike full weights, an in-flight request finishes on the
adapter it began with: never a new label on old weights). The run's policy adapter is
the name "" (`publish_policy`, and the adapter of a LoRA base, `staged` / `serve_base`);
other names are adapters served beside it (`publish`). The scale alpha / r is already in
B on the wire (`scalerl.policy.lora`), so the folders say lora_alpha = r.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rollout_service.engines.requests import RequestTable
from rollout_service.engines.weight_check import AdapterSpec, check_adapter_base, folder_shapes
from scalerl.policy.lora import LORA_A, LORA_B, Payload, adapter_shapes
from scalerl.rpc.errors import InvalidArgument

POLICY = ""  # the run's own adapter
_KEEP_FOLDERS = 4  # a version's folder outlives a few newer ones (vLLM reads it at first use)


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter version as vLLM serves it: its `LoRARequest` and version."""

    request: Any
    version: int


@dataclass(frozen=True)
class StagedAdapter:
    """A LoRA base's adapter, written and waiting for its base to load."""

    folder: Path
    lora_id: int
    base_version: int


class VLLMAdapters:
    """The adapters one vLLM engine serves (thread-safe). model_path: the model folder
    (which Linear modules exist, with their features); max_rank: the highest LoRA rank."""

    def __init__(self, model_path: Path, max_rank: int) -> None:
        self.max_rank = max_rank
        self._spec = AdapterSpec(linear_modules(model_path), max_rank)
        self._root = Path(tempfile.mkdtemp(prefix="scalerl-lora-"))
        self._served: dict[str, ServedAdapter] = {}
        self._versions: dict[str, int] = {}
        self._folders: list[Path] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.base_version: int | None = None  # the LoRA base serving
        self._newest_base: int | None = None  # serving or staged

    def engine_options(self) -> dict[str, Any]:
        """vLLM engine arguments: LoRA on, up to `max_rank`, four adapters in a batch (the
        policy's last two versions while in-flight requests finish, and others)."""
        return {"enable_lora": True, "max_lora_rank": self.max_rank, "max_loras": 4}

    def names(self) -> list[str]:
        """The named adapters served beside the policy."""
        with self._lock:
            return sorted(name for name in self._served if name != POLICY)

    def serving(self, name: str) -> ServedAdapter | None:
        """What a request naming `name` ("" the policy) gets now; None: the bare base."""
        with self._lock:
            return self._served.get(name)

    def staged(self, payload: Payload) -> StagedAdapter:
        """Validate and write the adapter of a LoRA base's payload; it serves once its
        base has loaded (`serve_base`). Raises InvalidArgument("state_dict") for a bad
        tensor."""
        assert payload.base_version is not None  # split_payload: adapters name their base
        folder, lora_id = self._write(payload.adapter)
        with self._lock:
            self._newest_base = payload.base_version
        return StagedAdapter(folder, lora_id, payload.base_version)

    def serve_base(self, staged: StagedAdapter | None, version: int) -> None:
        """A base loaded as `version`: serve its adapter as the policy's, or (full weights,
        `staged` None) no policy adapter at all."""
        with self._lock:
            if staged is None:
                self._served.pop(POLICY, None)
                self.base_version = self._newest_base = None
                return
            self._served[POLICY] = _served(version, staged.lora_id, staged.folder)
            self.base_version = staged.base_version

    def publish_policy(self, payload: Payload, version: int, requests: RequestTable) -> None:
        """The policy's adapter alone, as `version`: it must name the base serving or
        staged, and `version` must not be older than the policy's (`requests`). New
        phases get it at once. Raises InvalidArgument ("base_version", "version",
        "state_dict"); nothing changes then."""
        with self._lock:
            newest = self._newest_base
        check_adapter_base(payload.base_version, newest)
        self._spec.check(payload.adapter)
        requests.accept_version(version)
        folder, lora_id = self._write(payload.adapter)
        with self._lock:
            self._served[POLICY] = _served(version, lora_id, folder)
        requests.serve(version)

    def publish(self, name: str, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Serve `adapter` as the named adapter `name` from now on. Raises InvalidArgument
        ("state_dict", or "version" older than that adapter's)."""
        with self._lock:
            newest = self._versions.get(name, -1)
        if version < newest:
            raise InvalidArgument(
                "version", f"{version} is older than version {newest} of adapter {name!r}"
            )
        folder, lora_id = self._write(adapter)
        with self._lock:
            self._versions[name] = version
            self._served[name] = _served(version, lora_id, folder)

    def _write(self, adapter: Mapping[str, torch.Tensor]) -> tuple[Path, int]:
        """Validate, then write a peft folder of the wire tensors; (folder, a new id)."""
        self._spec.check(adapter)
        lora_id = next(self._ids)
        folder = self._root / f"adapter-{lora_id}"
        write_peft_folder(folder, adapter)
        with self._lock:
            self._folders.append(folder)
            stale, self._folders = self._folders[:-_KEEP_FOLDERS], self._folders[-_KEEP_FOLDERS:]
        for old in stale:
            shutil.rmtree(old, ignore_errors=True)
        return folder, lora_id


def _served(version: int, lora_id: int, folder: Path) -> ServedAdapter:
    from vllm.lora.request import LoRARequest

    return ServedAdapter(LoRARequest(f"adapter-{lora_id}", lora_id, str(folder)), version)


def write_peft_folder(folder: Path, adapter: Mapping[str, torch.Tensor]) -> None:
    """adapter_config.json and adapter_model.safetensors (peft's names) of wire adapter
    tensors, whose B already holds the scale: lora_alpha = r."""
    shapes = adapter_shapes(adapter)
    ranks = {shape.rank for shape in shapes.values()}
    if len(ranks) != 1:
        raise InvalidArgument("state_dict", f"the adapters' ranks differ: {sorted(ranks)}")
    (rank,) = ranks
    folder.mkdir(parents=True)
    tensors = {}
    for module in shapes:
        for suffix in (LORA_A, LORA_B):
            tensor = adapter[module + suffix].detach().to("cpu").contiguous()
            tensors[f"base_model.model.{module}{suffix}"] = tensor
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in shapes}),
        "base_model_name_or_path": "",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))


def linear_modules(model_path: Path) -> dict[str, tuple[int, int]]:
    """(in, out) features of every 2-D weight of the decoder layers in a model folder's
    safetensors, by module name: what an adapter may target."""
    found = {}
    for name, shape in folder_shapes(model_path).items():
        if name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2:
            found[name.removesuffix(".weight")] = (int(shape[1]), int(shape[0]))
    return found
