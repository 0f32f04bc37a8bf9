"""Build the engine a run config names (`rollout.engine`: torch, vllm or sglang), started
and serving version 0. Engines that load the model from disk (vLLM, SGLang) get a model
folder (`model_folder`); an SGLang server is started here when no URL is configured.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rollout_service.engines.api import RolloutEngine
from scalerl.config import RunConfig, SglangEngineConfig, TorchEngineConfig, VllmEngineConfig
from scalerl.cores import torch_threads
from scalerl.policy.hardware import ResolvedConfig
from scalerl.ports import free_port


def build_engine(
    resolved: ResolvedConfig, model: Any, tokenizer: Any, metrics: Any, gate: Any = None
) -> RolloutEngine:
    """The engine named by `config.rollout.engine`, started and serving version 0, on
    the resolved device in the resolved dtype.

    model: the policy as loaded by `scalerl.policy.models.load_policy` (the torch engine takes
    ownership of it; vLLM and SGLang load the model folder themselves and use it only
    for the tiny model, which has no folder). tokenizer: its `PolicyTokenizer` (stop
    token ids). metrics: a `RolloutMetrics` or None. gate: a lender worker's
    `scalerl.lending.Borrower` (the torch engine's; the config refuses lending with the
    others). Raises ImportError naming the package when the engine's package is not
    installed.
    """
    config = resolved.config
    rollout = config.rollout
    stops = tokenizer.stop_token_ids
    engine = rollout.engine
    if isinstance(engine, TorchEngineConfig):
        from rollout_service.engines.torch.engine import TorchEngine

        return TorchEngine(
            model,
            stops,
            rollout.max_batch,
            rollout.max_seq_len,
            resolved.rollout_dtype,
            device=resolved.device,
            metrics=metrics,
            max_lora_rank=rollout.max_lora_rank,
            gate=gate,
        )
    if isinstance(engine, VllmEngineConfig):
        from rollout_service.engines.vllm.worker import require_vllm

        require_vllm()  # before writing a model folder for nothing
        from rollout_service.engines.vllm.engine import VLLMEngine

        return VLLMEngine(
            str(model_folder(config, model)),
            stops,
            max_batch=rollout.max_batch,
            max_seq_len=rollout.max_seq_len,
            dtype=resolved.rollout_dtype,
            metrics=metrics,
            enforce_eager=engine.enforce_eager,
            kv_cache_gib=engine.kv_cache_gib,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            threads=torch_threads(rollout.threads),
            max_lora_rank=rollout.max_lora_rank if config.learner.lora is not None else None,
        )
    return _build_sglang(resolved, engine, model_folder(config, model), stops, metrics)


def _build_sglang(
    resolved: ResolvedConfig, engine: SglangEngineConfig, folder: Path, stops: Any, metrics: Any
) -> RolloutEngine:
    """An SGLang engine on `rollout.engine.url`, or on a server started here (and ended
    when this process exits) when that is empty."""
    from transformers import AutoConfig

    from rollout_service.engines.sglang.adapters import server_args
    from rollout_service.engines.sglang.engine import SGLangEngine
    from rollout_service.engines.sglang.server import launch_sglang_server, wait_until_ready
    from scalerl.policy.architectures import CheckpointNames
    from scalerl.weights.check import folder_shapes

    rollout = resolved.config.rollout
    lora_rank = rollout.max_lora_rank if resolved.config.learner.lora is not None else None
    url, api_key = engine.url, ""
    if not url:
        port, api_key = free_port(), secrets.token_urlsafe(32)  # a server of our own
        process = launch_sglang_server(
            str(folder),
            port,
            dtype=resolved.rollout_dtype,
            api_key=api_key,
            extra_args=server_args(lora_rank) if lora_rank else (),
        )
        atexit.register(_end_process_group, process)
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url, process=process, api_key=api_key)
    shapes = folder_shapes(folder)
    return SGLangEngine(
        url,
        stop_token_ids=stops,
        max_seq_len=rollout.max_seq_len,
        vocab_size=_vocab_size(folder),
        max_batch=rollout.max_batch,
        metrics=metrics,
        weight_shapes=shapes or None,
        api_key=api_key,
        max_lora_rank=lora_rank,
        checkpoint_names=CheckpointNames(AutoConfig.from_pretrained(folder)),
    )


def _end_process_group(process: subprocess.Popen) -> None:
    """Terminate a server started in its own session, with everything it spawned."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)


def model_folder(config: RunConfig, model: Any) -> Path:
    """A transformers model folder for engines that load from disk: the cached SmolLM2
    folder, the folder `model.path` names (`scalerl.policy.models.policy_folder`), or
    (tiny model, which exists only in memory) `model` saved to a fresh temporary folder
    (safetensors, no tokenizer: these engines take token ids)."""
    from scalerl.policy.models import policy_folder

    if config.model.from_folder:
        return policy_folder(config.model)
    folder = Path(tempfile.mkdtemp(prefix="scalerl-tiny-"))
    model.save_pretrained(folder)
    return folder


def _vocab_size(folder: Path) -> int:
    return int(json.loads((folder / "config.json").read_text())["vocab_size"])
