"""LoRA adapters served by an engine that loads them from peft folders (vLLM, SGLang).

Each version of an adapter is written as a peft folder (adapter_config.json,
adapter_model.safetensors) and loaded through the engine's `AdapterLoader`, which turns
the folder into the handle a request carries (vLLM: a `LoRARequest`, loaded in flight at
its first use; SGLang: the name the server registered at `/load_lora_adapter`).

A request (or a request phase) takes the adapter serving when it starts and keeps it to
its end; its tokens are stamped with that adapter's version. Neither engine swaps an
adapter under a running request, so, unlike full weights, an in-flight request finishes
on the adapter it began with: never a new label on old weights. The run's policy adapter
is the name "" (`serve_policy`, and the adapter of a LoRA base, `stage` / `serve_base`);
other names are adapters served beside it (`serve_named`), as a hosted training service
serves several runs over one base.

A retired handle (a newer version of its name serves) is unloaded once no request holds
it (`acquire` / `release`): SGLang's unload waits for the requests that use the adapter
while holding the lock its next load needs, so unloading a handle still in use would
stall the next update.

The scale alpha / r is already in B on the wire (`scalerl.policy.lora`), so the folders
say lora_alpha = r.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from rollout_service.engines.requests import RequestTable
from scalerl.policy.lora import LORA_A, LORA_B, Payload, adapter_shapes
from scalerl.rpc.errors import InvalidArgument
from scalerl.weights.check import AdapterSpec, check_adapter_base

log = logging.getLogger(__name__)

POLICY = ""  # the run's own adapter


class AdapterLoader(Protocol):
    """How an engine serves a peft folder. `load` returns the handle requests carry and
    raises EngineError when the engine refuses the folder; `unload` frees a handle no
    request holds any more; `keeps_folders`: True when the engine reads the folder
    again after `load` (vLLM reads it at first use), False when `load` has read it."""

    keeps_folders: bool

    def load(self, lora_id: int, folder: Path) -> Any: ...

    def unload(self, handle: Any) -> None: ...


@dataclass(eq=False)
class ServedAdapter:
    """An adapter version as the engine serves it: the handle a request carries, its
    version, and the requests holding it (under the table's lock)."""

    handle: Any
    version: int
    holders: int = 0
    retired: bool = False


@dataclass(frozen=True)
class StagedAdapter:
    """A LoRA base's adapter, loaded and waiting for its base to load."""

    served: ServedAdapter
    base_version: int


class FolderAdapters:
    """The adapters one engine serves (thread-safe). modules: the Linear modules an
    adapter may target, (in, out) features by HF name (None = unknown: the engine checks
    them); max_rank: the highest LoRA rank; loader: the engine's `AdapterLoader`; root:
    where folders are written (visible to the engine; None = the temp directory)."""

    _KEEP_FOLDERS = 4  # a folder the engine reads at first use outlives a few newer ones

    def __init__(
        self,
        modules: Mapping[str, tuple[int, int]] | None,
        max_rank: int,
        loader: AdapterLoader,
        root: str | None = None,
    ) -> None:
        self.max_rank = max_rank
        self._spec = AdapterSpec(modules, max_rank)
        self._loader = loader
        self._root = Path(tempfile.mkdtemp(prefix="scalerl-lora-", dir=root))
        self._served: dict[str, ServedAdapter] = {}
        self._newest: dict[str, int] = {}  # named adapter -> newest version admitted
        self._folders: list[Path] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.base_version: int | None = None  # the LoRA base serving
        self._newest_base: int | None = None  # serving or staged

    def names(self) -> list[str]:
        """The named adapters served beside the policy."""
        with self._lock:
            return sorted(name for name in self._served if name != POLICY)

    def serving(self, name: str) -> ServedAdapter | None:
        """What a request naming `name` ("" the policy) gets now; None: the bare base."""
        with self._lock:
            return self._served.get(name)

    def acquire(self, name: str) -> ServedAdapter | None:
        """`serving`, held until `release`: its handle is not unloaded before."""
        with self._lock:
            served = self._served.get(name)
            if served is not None:
                served.holders += 1
            return served

    def release(self, served: ServedAdapter | None) -> None:
        """Give back what `acquire` returned; the last holder of a retired handle
        unloads it."""
        if served is None:
            return
        with self._lock:
            served.holders -= 1
            unload = served.retired and served.holders == 0
        if unload:
            self._unload(served)

    # ----- checks (the caller's thread; nothing changes when they raise) -----------------

    def check_policy(self, payload: Payload, version: int, requests: RequestTable) -> None:
        """The policy's adapter alone as `version`: it must name the base serving or
        staged, and `version` must not be older than the policy's (`requests` admits
        it). Raises InvalidArgument ("base_version", "state_dict", "version")."""
        with self._lock:
            newest = self._newest_base
        check_adapter_base(payload.base_version, newest)
        self._spec.check(payload.adapter)
        requests.accept_version(version)

    def check_named(self, name: str, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Adapter `name` as `version`, admitted. Raises InvalidArgument ("adapter" for
        an empty name, "state_dict", "version" older than that adapter's)."""
        if not name:
            raise InvalidArgument("adapter", "must be a non-empty name")
        self._spec.check(adapter)
        with self._lock:
            newest = self._newest.get(name, -1)
            if version < newest:
                raise InvalidArgument(
                    "version", f"{version} is older than version {newest} of adapter {name!r}"
                )
            self._newest[name] = version

    def check_staged(self, payload: Payload) -> None:
        """The adapter of a LoRA base's payload. Raises InvalidArgument("state_dict")."""
        self._spec.check(payload.adapter)

    # ----- serving (the engine's update path) --------------------------------------------

    def stage(self, payload: Payload, version: int) -> StagedAdapter:
        """Load the adapter of a LoRA base's payload; it serves once its base has loaded
        (`serve_base`), or is dropped (`discard`). Raises EngineError when the engine
        refuses it."""
        assert payload.base_version is not None  # split_payload: adapters name their base
        served = self._load(payload.adapter, version)
        with self._lock:
            self._newest_base = payload.base_version
        return StagedAdapter(served, payload.base_version)

    def discard(self, staged: StagedAdapter | None) -> None:
        """A staged adapter whose base failed to load."""
        if staged is not None:
            self._retire(staged.served)

    def serve_base(self, staged: StagedAdapter | None, version: int) -> None:
        """A base loaded as `version`: serve its adapter as the policy's, or (full weights,
        `staged` None) no policy adapter at all."""
        with self._lock:
            if staged is None:
                old = self._served.pop(POLICY, None)
                self.base_version = self._newest_base = None
            else:
                old = self._served.get(POLICY)
                self._served[POLICY] = staged.served
                self.base_version = staged.base_version
        self._retire(old)

    def serve_policy(self, payload: Payload, version: int, requests: RequestTable) -> None:
        """Serve the policy's adapter alone (checked by `check_policy`) as `version`: new
        requests get it at once. Raises EngineError when the engine refuses it (the
        old adapter keeps serving)."""
        self._swap(POLICY, self._load(payload.adapter, version))
        requests.serve(version)

    def serve_named(self, name: str, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Serve `adapter` (checked by `check_named`) as adapter `name` from now on."""
        self._swap(name, self._load(adapter, version))

    def _swap(self, name: str, served: ServedAdapter) -> None:
        with self._lock:
            old = self._served.get(name)
            self._served[name] = served
        self._retire(old)

    def _load(self, adapter: Mapping[str, torch.Tensor], version: int) -> ServedAdapter:
        lora_id = next(self._ids)
        folder = self._root / f"adapter-{lora_id}"
        write_peft_folder(folder, adapter)
        try:
            handle = self._loader.load(lora_id, folder)
        finally:
            self._keep_folder(folder)
        return ServedAdapter(handle, version)

    def _keep_folder(self, folder: Path) -> None:
        if not self._loader.keeps_folders:
            shutil.rmtree(folder, ignore_errors=True)
            return
        with self._lock:
            self._folders.append(folder)
            keep = self._KEEP_FOLDERS
            stale, self._folders = self._folders[:-keep], self._folders[-keep:]
        for old in stale:
            shutil.rmtree(old, ignore_errors=True)

    def _retire(self, served: ServedAdapter | None) -> None:
        if served is None:
            return
        with self._lock:
            served.retired = True
            unload = served.holders == 0
        if unload:
            self._unload(served)

    def _unload(self, served: ServedAdapter) -> None:
        try:
            self._loader.unload(served.handle)
        except Exception as exc:  # an adapter left loaded costs memory, not correctness
            log.warning("unloading adapter %s failed: %s", served.handle, exc)


def write_peft_folder(folder: Path, adapter: Mapping[str, torch.Tensor]) -> None:
    """adapter_config.json and adapter_model.safetensors (peft's names) of wire adapter
    tensors, whose B already holds the scale: lora_alpha = r. Raises
    InvalidArgument("state_dict") when the adapters' ranks differ."""
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


def linear_modules(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """(in, out) features of every 2-D weight of the decoder layers, by module name, from
    a model's tensor shapes (`scalerl.weights.check.folder_shapes`): what an adapter may target."""
    found = {}
    for name, shape in shapes.items():
        if name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2:
            found[name.removesuffix(".weight")] = (int(shape[1]), int(shape[0]))
    return found
