"""LoRA adapters on vLLM (`enable_lora`): the engine-neutral table of adapters
(`rollout_service.engines.adapters.FolderAdapters`) with vLLM's loader, which turns a peft
folder into a `LoRARequest` that vLLM loads in flight at its first use, without
restarting the engine (so the folder must outlive the load: `keeps_folders`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_service.engines.adapters import FolderAdapters, linear_modules
from scalerl.weights.check import folder_shapes

MAX_LORAS = 4  # adapters in one batch: the policy's last two versions while in-flight
# requests finish on the older one, and others served beside it


class VLLMLoader:
    """`AdapterLoader` of vLLM: a `LoRARequest` per folder; vLLM evicts adapters no
    request uses from its own cache (least recently used), so nothing is unloaded here."""

    keeps_folders = True

    def load(self, lora_id: int, folder: Path) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"adapter-{lora_id}", lora_id, str(folder))

    def unload(self, handle: Any) -> None:
        return None


def vllm_adapters(model_path: Path, max_rank: int) -> FolderAdapters:
    """The adapters a vLLM engine of the model folder `model_path` serves, ranks up to
    `max_rank`."""
    return FolderAdapters(linear_modules(folder_shapes(model_path)), max_rank, VLLMLoader())


def engine_options(model_path: Path, max_rank: int) -> dict[str, Any]:
    """vLLM engine arguments: LoRA on, ranks up to `max_rank`, `MAX_LORAS` in a batch, on
    the decoder's Linear modules alone. Leaving out the LM head (which no adapter of ours
    targets) keeps vLLM from wrapping its logits processor for LoRA, whose CPU kernel
    fails on prompt log-probs in a mixed batch (vLLM 0.32: it applies one adapter index
    per request to every prompt position), and those are how the interrupt phrase of the
    thinking budget is scored."""
    suffixes = {name.rsplit(".", 1)[-1] for name in linear_modules(folder_shapes(model_path))}
    return {
        "enable_lora": True,
        "max_lora_rank": max_rank,
        "max_loras": MAX_LORAS,
        "lora_target_modules": sorted(suffixes),
    }
