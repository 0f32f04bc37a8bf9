"""LoRA adapters on SGLang (`--enable-lora`): the engine-neutral table of adapters
(`rollout_service.engines.adapters.FolderAdapters`) with SGLang's loader.

Shapes from SGLang's `entrypoints/http_server.py` and `managers/io_struct.py`:
- `POST /load_lora_adapter` {`lora_name`, `lora_path` (a peft folder the server can
  read), `pinned` = false} answers {`success`, `error_message`, `loaded_adapters`}, HTTP
  400 when success is false (rank above `--max-lora-rank`, a module outside
  `--lora-target-modules`, a name already loaded). The server has read the folder when
  it answers, so the folder goes then (`keeps_folders` False).
- `POST /unload_lora_adapter` {`lora_name`}: new requests stop getting it at once; the
  server unloads it once the requests using it finish, holding the lock its next load
  needs until then (which is why the table unloads only what no request holds).
- `/generate` carries `lora_path` = a loaded adapter's name; a request keeps that
  adapter to its end (SGLang counts the requests per adapter).

Every version is loaded under a name of its own (`scalerl-<id>`): SGLang refuses to load
a name twice, and an in-flight request must keep the version it started with.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout_service.engines.adapters import FolderAdapters, linear_modules
from rollout_service.engines.api import EngineError
from rollout_service.engines.sglang.client import SGLangClient

MAX_LORAS_PER_BATCH = 4  # the policy's last two versions while in-flight requests finish
# on the older one, and others served beside it


class SGLangLoader:
    """`AdapterLoader` of an SGLang server (`client`)."""

    keeps_folders = False

    def __init__(self, client: SGLangClient) -> None:
        self._client = client

    def load(self, lora_id: int, folder: Path) -> Any:
        """Load the folder as `scalerl-<lora_id>`; returns that name. Raises EngineError
        with the server's message when it refuses."""
        name = f"scalerl-{lora_id}"
        body = {"lora_name": name, "lora_path": str(folder), "pinned": False}
        reply = self._client.post("/load_lora_adapter", body, accept_400=True)
        if not reply.get("success"):
            raise EngineError(f"load_lora_adapter failed: {reply.get('error_message')}")
        return name

    def unload(self, handle: Any) -> None:
        """Unload adapter `handle` (a name `load` returned). Raises EngineError."""
        reply = self._client.post("/unload_lora_adapter", {"lora_name": handle}, accept_400=True)
        if not reply.get("success"):
            raise EngineError(f"unload_lora_adapter failed: {reply.get('error_message')}")


def sglang_adapters(
    client: SGLangClient,
    weight_shapes: Mapping[str, tuple[int, ...]] | None,
    max_rank: int,
    staging_dir: str | None,
) -> FolderAdapters:
    """The adapters an SGLang engine serves: ranks up to `max_rank`, modules checked
    against `weight_shapes` when known (else by the server), folders written under
    `staging_dir` (it must be visible to the server)."""
    modules = linear_modules(weight_shapes) if weight_shapes else None
    return FolderAdapters(modules, max_rank, SGLangLoader(client), staging_dir)


def server_args(max_rank: int) -> list[str]:
    """`sglang.launch_server` arguments that serve adapters up to `max_rank` on every
    Linear module, `MAX_LORAS_PER_BATCH` in a batch."""
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(max_rank),
        "--lora-target-modules",
        "all",
        "--max-loras-per-batch",
        str(MAX_LORAS_PER_BATCH),
    ]
