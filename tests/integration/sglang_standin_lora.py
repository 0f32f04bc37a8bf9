"""LoRA on the SGLang stand-in (sglang_standin.py): SGLang's dynamic adapter API, with its
request and reply shapes (`entrypoints/http_server.py`, `managers/io_struct.py`,
`lora/lora_registry.py`).

- `/load_lora_adapter` {lora_name, lora_path, pinned}: reads a peft folder
  (adapter_config.json, adapter_model.safetensors with `base_model.model.<module>.lora_A
  .weight` names) at once; refuses (HTTP 400, {success: false, error_message}) when LoRA
  is off, the name is loaded already, the folder is not an adapter, its rank is above
  max_lora_rank, or a module is not in the model (or has other features).
- `/unload_lora_adapter` {lora_name}: as SGLang, waits until no unfinished request uses
  the adapter before it answers (SGLang holds its LoRA lock meanwhile); every such wait
  is counted in `waited_unloads`, which a careful client keeps at 0.
- `/generate` with `lora_path` = a loaded name; an unknown one is refused.

The fake adapter's effect: it adds sum over its modules of (B A)[0, 0] to the fake
model's step (so greedy decoding with it counts up by 1 + round(lm_head[0, 0] + shift)).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from sglang_standin_http import BadRequest

MODULES = {  # the fake model's Linear modules an adapter may target: (in, out) features
    "model.layers.0.self_attn.q_proj": (4, 4),
    "model.layers.0.mlp.down_proj": (8, 4),
}
_PREFIX = "base_model.model."


@dataclass
class _Adapter:
    path: str
    shift: float
    users: int = 0  # unfinished requests on it


class StandinLoRA:
    """The adapters one stand-in serves; max_rank None = LoRA off (no --enable-lora)."""

    def __init__(self, max_rank: int | None, cond: threading.Condition) -> None:
        self.max_rank = max_rank
        self._cond = cond  # the stand-in's lock
        self._adapters: dict[str, _Adapter] = {}
        self.waited_unloads = 0

    def load(self, body: dict) -> tuple[bool, dict]:
        name, path = str(body.get("lora_name", "")), str(body.get("lora_path", ""))
        try:
            shift = self._read(name, path)
        except ValueError as exc:
            return False, {"success": False, "error_message": str(exc), "loaded_adapters": None}
        with self._cond:
            self._adapters[name] = _Adapter(path, shift)
            loaded = {n: a.path for n, a in self._adapters.items()}
        return True, {"success": True, "error_message": None, "loaded_adapters": loaded}

    def unload(self, body: dict) -> tuple[bool, dict]:
        name = str(body.get("lora_name", ""))
        with self._cond:
            adapter = self._adapters.get(name)
            if adapter is None:
                message = f"LoRA adapter {name} is not loaded"
                return False, {"success": False, "error_message": message}
            if adapter.users:
                self.waited_unloads += 1
                self._cond.wait_for(lambda: adapter.users == 0, 30.0)
            del self._adapters[name]
            loaded = {n: a.path for n, a in self._adapters.items()}
        return True, {"success": True, "error_message": None, "loaded_adapters": loaded}

    def names(self) -> list[str]:
        with self._cond:
            return sorted(self._adapters)

    def acquire(self, name: str | None) -> float:
        """The shift of adapter `name` for a new request, which holds it until `release`
        (call under the lock). Raises BadRequest for a name not loaded."""
        if name is None:
            return 0.0
        if self.max_rank is None:
            raise BadRequest("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        adapter = self._adapters.get(name)
        if adapter is None:
            raise BadRequest(f"The following requested LoRA adapters are not loaded: {name}")
        adapter.users += 1
        return adapter.shift

    def release(self, name: str | None) -> None:
        """A request on `name` finished (call under the lock)."""
        adapter = self._adapters.get(name) if name is not None else None
        if adapter is not None:
            adapter.users -= 1
            self._cond.notify_all()

    def _read(self, name: str, path: str) -> float:
        if self.max_rank is None:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        with self._cond:
            if name in self._adapters:
                raise ValueError(f"The LoRA adapter {name} has already been loaded.")
        folder = Path(path)
        if not (folder / "adapter_config.json").is_file():
            raise ValueError(f"No adapter_config.json found in {path}")
        config = json.loads((folder / "adapter_config.json").read_text())
        rank = int(config["r"])
        if rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current "
                f"LoRA memory pool configuration (max_lora_rank {self.max_rank})."
            )
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        scale = float(config["lora_alpha"]) / rank
        shift = 0.0
        for module, (fan_in, fan_out) in self._modules(tensors).items():
            a = tensors[f"{_PREFIX}{module}.lora_A.weight"].float()
            b = tensors[f"{_PREFIX}{module}.lora_B.weight"].float()
            if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
                raise ValueError(f"LoRA weights of {module} do not fit the model")
            shift += scale * float((b @ a)[0, 0])
        return shift

    @staticmethod
    def _modules(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
        found = {}
        for key in tensors:
            module = key.removeprefix(_PREFIX).rsplit(".lora_", 1)[0]
            if module not in MODULES:
                raise ValueError(f"LoRA target module {module} is not in the base model")
            found[module] = MODULES[module]
        return found
