"""The rollout engine interface and the factory that builds the configured engine.

Every engine (torch, vLLM, SGLang) serves the same contract, stated in
`rollout_service.engines.torch.engine`'s docstring and checked by the engine contract test suite:
streamed chunks of tokens with the log-prob of each sampled token under the distribution
actually sampled from, the policy version of the weights that computed each token,
interrupt-and-truncate (ScaleRL, Khatri et al. 2025, Sec. 3.1), abort, and in-flight
weight updates that keep running requests (PipelineRL-style).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import tempfile
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rollout_service.engines.torch.engine import GenerationRequest, GenerationStream
from scalerl.config import RunConfig
from scalerl.ports import free_port

log = logging.getLogger(__name__)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the gRPC servicer, the actor loop, the weight receiver and the worker use."""

    max_batch: int
    max_seq_len: int
    vocab_size: int

    @property
    def policy_version(self) -> int:
        """Version of the weights now serving."""
        ...

    @property
    def active_requests(self) -> int:
        """Requests submitted and not yet finished."""
        ...

    @property
    def tokens_generated(self) -> int:
        """Completion tokens emitted since start, forced tokens included."""
        ...

    def start(self) -> None:
        """Start serving (idempotent)."""
        ...

    def stop(self, timeout: float = 10.0) -> None:
        """Stop; running requests end ABORTED, pending weight updates fail."""
        ...

    def submit(self, request: GenerationRequest) -> GenerationStream:
        """Queue a request. Raises ValueError naming the bad field,
        DuplicateRequestError, RuntimeError once stopping."""
        ...

    def interrupt(self, request_id: str, mode: int) -> bool:
        """TRUNCATE or ABORT a request; False when it is not running."""
        ...

    def stage_weights(self, state_dict: dict[str, Any], version: int) -> Future:
        """Validate and stage a full HF-named state dict; the future resolves to
        `version` once it serves. ValueError naming the bad tensor; nothing changes."""
        ...

    def stage_weights_from_file(self, path: str, version: int) -> Future:
        """As `stage_weights`, from one safetensors file with HF parameter names."""
        ...


def build_engine(config: RunConfig, model: Any, tokenizer: Any, metrics: Any) -> RolloutEngine:
    """The engine named by `config.rollout.engine`, started and serving version 0.

    model: the policy as loaded by `scalerl.policy.models.load_policy` (the torch engine takes
    ownership of it; vLLM and SGLang load the model folder themselves and use it only
    for the tiny model, which has no folder). tokenizer: its `PolicyTokenizer` (stop
    token ids). metrics: a `RolloutMetrics` or None. Raises ImportError naming the
    package when the engine's package is not installed.
    """
    rollout = config.rollout
    stops = tokenizer.stop_token_ids
    if rollout.engine == "torch":
        from rollout_service.engines.torch.engine import TorchEngine

        return TorchEngine(
            model,
            stops,
            rollout.max_batch,
            rollout.max_seq_len,
            _concrete(rollout.dtype),
            device=config.device if config.device != "auto" else "cpu",
            metrics=metrics,
        )
    if rollout.engine == "vllm":
        from rollout_service.engines.vllm.engine import VLLMEngine, require_vllm

        require_vllm()  # before writing a model folder for nothing
        return VLLMEngine(
            str(model_folder(config, model)),
            stops,
            max_batch=rollout.max_batch,
            max_seq_len=rollout.max_seq_len,
            dtype=_concrete(rollout.dtype),
            metrics=metrics,
            enforce_eager=rollout.vllm_enforce_eager,
            kv_cache_gib=rollout.vllm_kv_cache_gib,
            gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
            threads=rollout.threads,
        )
    return _build_sglang(config, model_folder(config, model), stops, metrics)


def _concrete(dtype: str) -> str:
    """The engine dtype; "auto" must have been resolved by `scalerl.policy.hardware` first (the
    worker's entry point does), so an unresolved one falls back to float32, never to a
    bf16 that may be emulated."""
    return "float32" if dtype == "auto" else dtype


def _build_sglang(config: RunConfig, folder: Path, stops: Any, metrics: Any) -> RolloutEngine:
    """An SGLang engine on `rollout.sglang_url`, or on a server started here (and ended
    when this process exits) when that is empty."""
    from rollout_service.engines.sglang.engine import (
        SGLangEngine,
        launch_sglang_server,
        read_safetensors_shapes,
        wait_until_ready,
    )

    rollout = config.rollout
    url = rollout.sglang_url
    if not url:
        port = free_port()
        process = launch_sglang_server(str(folder), port, dtype=_concrete(rollout.dtype))
        atexit.register(_end_process_group, process)
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url, process=process)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        shapes.update(read_safetensors_shapes(str(file)))
    return SGLangEngine(
        url,
        stop_token_ids=stops,
        max_seq_len=rollout.max_seq_len,
        vocab_size=_vocab_size(folder),
        max_batch=rollout.max_batch,
        metrics=metrics,
        weight_shapes=shapes or None,
    )


def _end_process_group(process: subprocess.Popen) -> None:
    """Terminate a server started in its own session, with everything it spawned."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)


def model_folder(config: RunConfig, model: Any) -> Path:
    """A transformers model folder for engines that load from disk: the cached SmolLM2
    folder, `model.path`, or (tiny model, which exists only in memory) `model` saved to
    a fresh temporary folder (safetensors, no tokenizer: these engines take token ids)."""
    from scalerl.policy.models import smollm2_dir

    kind = config.model.kind
    if kind == "smollm2":
        return smollm2_dir(config.model.cache_dir)
    if kind == "path":
        return Path(config.model.path)
    folder = Path(tempfile.mkdtemp(prefix="scalerl-tiny-"))
    model.save_pretrained(folder)
    return folder


def _vocab_size(folder: Path) -> int:
    import json

    return int(json.loads((folder / "config.json").read_text())["vocab_size"])
