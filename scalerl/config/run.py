"""The whole run (`RunConfig`) and how it is loaded: built-in configs in
`scalerl/configs/*.yaml`, recipes, `--set a.b=value` overrides and `SCALERL_*`
environment variables."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from scalerl.config.base import by_name
from scalerl.config.learner import LearnerConfig
from scalerl.config.model import ModelConfig, SmolLM2Model, switch_kind
from scalerl.config.rollout import RolloutConfig
from scalerl.config.services import CurveConfig, EvalConfig, FleetConfig, SecurityConfig
from scalerl.config.task import (
    TASK_FIELDS,
    TASK_SOURCES,
    AdditionsTaskConfig,
    TaskConfig,
    VerifierConfig,
    as_task_list,
)
from scalerl.state.keys import RUN_ID_PATTERN

CONFIG_DIR = Path(__file__).parent.parent / "configs"
_BOOL = "tag:yaml.org,2002:bool"


class _ConfigLoader(yaml.SafeLoader):
    """YAML as a config means it: only true and false are booleans (YAML 1.2's core
    schema). PyYAML's YAML 1.1 also reads on, off, yes and no as booleans, which would
    make `delta: off` or `--set learner.lend_idle=off` the boolean False, refused by a
    field whose values are words."""


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml(text: str) -> Any:
    """`text` parsed as a config's YAML (`_ConfigLoader`). Raises yaml.YAMLError."""
    return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader


ENV_PREFIX = "SCALERL_"
# Top-level fields settable as SCALERL_<NAME>.
_ENV_FIELDS = ("run_id", "seed", "device", "tracking")
# Hyperparameters each policy loss takes (`learner_service.train.objective.policy_loss`): here,
# torch-free, so that the config and the learner share one table.


# The experiment trackers a run can log to (`scalerl.tracking`, whose factory is the one
# place that maps a name to its class).
TrackerName = Literal["tensorboard", "wandb", "mlflow"]


def _one_additions_task() -> list[TaskConfig]:
    return [AdditionsTaskConfig()]


class RunConfig(BaseSettings):
    """Everything one training run needs. Environment: SCALERL_<SECTION>__<FIELD>."""

    model_config = SettingsConfigDict(
        env_prefix="SCALERL_", env_nested_delimiter="__", extra="forbid"
    )

    run_id: str = Field("run", pattern=RUN_ID_PATTERN.pattern, description="Run name.")
    seed: int = Field(0, description="Global seed.")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="auto: CUDA when present (cuda:LOCAL_RANK), else the CPU; or cpu, cuda, "
        "cuda:N (scalerl.policy.hardware).",
    )
    model: ModelConfig = SmolLM2Model()
    task: list[TaskConfig] = Field(
        default_factory=_one_additions_task,
        min_length=1,
        max_length=64,
        description="The run's tasks (one mapping is a list of one).",
    )
    verifier: VerifierConfig = VerifierConfig()
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = LearnerConfig()
    eval: EvalConfig = EvalConfig()
    fleet: FleetConfig = FleetConfig()
    curve: CurveConfig = CurveConfig()
    security: SecurityConfig = SecurityConfig()
    # NoDecode: SCALERL_TRACKING is read as YAML by `_one_or_many_trackers` (`wandb`,
    # `[wandb, mlflow]`), not as the JSON pydantic-settings requires of a list.
    tracking: Annotated[list[TrackerName], NoDecode] = Field(
        default_factory=list,
        description="Experiment trackers the run also logs to, each under the run folder's "
        "tracking/ (`scalerl.tracking`): tensorboard, wandb (offline), mlflow (a file "
        "store); empty = none. A tracker that fails is dropped with one warning.",
    )

    @field_validator("task", mode="before")
    @classmethod
    def _one_or_many_tasks(cls, value: Any) -> Any:
        return as_task_list(value)

    @field_validator("tracking", mode="before")
    @classmethod
    def _one_or_many_trackers(cls, value: Any) -> Any:
        """A list of names, one name, or either as YAML text (an environment variable);
        nothing (an empty variable) is none. Raises ValueError for text that is not YAML."""
        if isinstance(value, str):
            try:
                value = load_yaml(value)
            except yaml.YAMLError as exc:
                raise ValueError(f"tracking: not YAML ({_yaml_problem(exc)})") from None
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("tracking")
    @classmethod
    def _trackers_once(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"tracking: each tracker once, repeated: {', '.join(repeated)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        names = [t.name for t in self.task]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"task names must be unique, repeated: {', '.join(repeated)}")
        if self.model.warmup_steps and not any(t.source == "additions" for t in self.task):
            raise ValueError("model.warmup_steps needs a task with source additions to warm up on")
        r = self.rollout
        self._check_lora()
        if self.learner.lend_idle == "workers" and r.engine.kind != "torch":
            raise ValueError(
                "learner.lend_idle: workers needs rollout.engine torch (its lenders stop "
                f"between decode steps), got {r.engine.kind!r} (set lend_idle off)"
            )
        # The phrase takes at least one token; its exact length needs the tokenizer
        # (scalerl.length_control.check_budgets, run before any process starts).
        if r.thinking_budget and r.thinking_budget + 1 + r.answer_budget > r.max_new_tokens:
            raise ValueError(
                "rollout.thinking_budget + rollout.interrupt_text + rollout.answer_budget "
                f"must fit rollout.max_new_tokens: {r.thinking_budget} + at least 1 + "
                f"{r.answer_budget} > {r.max_new_tokens}"
            )
        return self

    def _check_lora(self) -> None:
        """LoRA within the engines' max_lora_rank. Raises ValueError naming the field."""
        lora = self.learner.lora
        if lora is None:
            return
        if lora.rank > self.rollout.max_lora_rank:
            raise ValueError(
                f"learner.lora.rank must be <= rollout.max_lora_rank "
                f"({self.rollout.max_lora_rank}), got {lora.rank}"
            )

    @property
    def replay_capacity(self) -> int:
        """(k + 1) x the groups one round reads (docs/architecture.md, "PipelineRL-k"):
        batch_prompts, or with dynamic sampling `learner.fill_up_to`. The groups a round
        has read stay in the stream until its step ends, so a capacity of (k + 1) x
        batch_prompts left the workers k batches less room than that while the learner
        trained on a filled batch: they waited, then the learner waited for them."""
        learner = self.learner
        return (learner.off_policy_k + 1) * max(learner.batch_prompts, learner.fill_up_to)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.c` in nested dicts. The task list is entered by index (`task.0.weight`),
    by task name (`task.math.weight`) or, when it holds one task, directly
    (`task.heldout_size`). Raises ValueError when no task matches."""
    keys = dotted.split(".")
    node = data
    if keys[0] == "task" and len(keys) > 1:
        tasks = data["task"] = as_task_list(data.get("task", [{}]))
        node, keys = _task_entry(tasks, keys[1:])
        if keys == ["source"] and value in TASK_SOURCES:  # the earlier source's fields go
            for field in [k for k in node if k not in TASK_SOURCES[value].model_fields]:
                del node[field]
    for depth, key in enumerate(keys[:-1]):
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"{'.'.join(keys[: depth + 1])}: a section, not a value")
    node[keys[-1]] = value


def _task_entry(tasks: list[dict[str, Any]], keys: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The task mapping that `keys` (after `task.`) address, and the keys left."""
    head = keys[0]
    names = [t.get("name", AdditionsTaskConfig.model_fields["name"].default) for t in tasks]
    if head.isdigit() and int(head) < len(tasks) and len(keys) > 1:
        return tasks[int(head)], keys[1:]
    if head in names and len(keys) > 1:
        return tasks[names.index(head)], keys[1:]
    if len(tasks) == 1 and head in TASK_FIELDS:
        return tasks[0], keys
    raise ValueError(
        f"task.{'.'.join(keys)}: name a task by index (0..{len(tasks) - 1}) or name "
        f"({', '.join(names)}), e.g. task.{names[0]}.{keys[-1]}"
    )


def parse_override(item: str) -> tuple[str, Any]:
    """Split 'section.field=value' and parse value as YAML. Raises ValueError if no '=',
    no key, or a value that is not YAML."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like section.field=value")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ValueError(f"override {item!r} must look like section.field=value")
    try:
        return key.strip(), load_yaml(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"{key.strip()}: the value is not YAML ({_yaml_problem(exc)})") from None


def resolve_config_path(name_or_path: str) -> Path:
    """A built-in config name (default, tiny) or a YAML path. Raises FileNotFoundError."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") and candidate.exists():
        return candidate
    builtin = CONFIG_DIR / f"{name_or_path}.yaml"
    if builtin.exists():
        return builtin
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise FileNotFoundError(f"config {name_or_path!r}: not a YAML file nor one of: {names}")


def environment_overrides(environ: Mapping[str, str] | None = None) -> list[str]:
    """`SCALERL_SECTION__FIELD=value` variables as `section.field=value` overrides."""
    variables = os.environ if environ is None else environ
    found = []
    for key, value in sorted(variables.items()):
        name = key.removeprefix(ENV_PREFIX).lower()
        if key.startswith(ENV_PREFIX) and ("__" in name or name in _ENV_FIELDS):
            found.append(f"{name.replace('__', '.')}={value}")
    return found


def load_config(
    name_or_path: str = "default",
    overrides: list[str] | None = None,
    recipe: str | None = None,
    leave_out: list[str] | tuple[str, ...] = (),
) -> RunConfig:
    """Load a built-in or file config, apply a recipe and `a.b=value` overrides, validate.

    Precedence, highest first: `overrides` (the command line), environment variables
    (`SCALERL_LEARNER__LR=2e-5`, what Kubernetes users set), leave-one-out components, the
    named recipe (`scalerl.recipes`), the YAML file, defaults.

    Raises FileNotFoundError for an unknown config and ValueError for an unknown recipe
    or component, or (pydantic.ValidationError) a field out of range (the message names
    the field and the allowed range).
    """
    from scalerl.recipes import recipe_overrides

    path = resolve_config_path(name_or_path)
    data = _variants_by_name(_relative_to(read_config_file(path), path.parent))
    layers = recipe_overrides(recipe, leave_out) + environment_overrides() + list(overrides or [])
    for item in layers:
        key, value = parse_override(item)
        key = resolve_key(key)
        if key == "model.kind":  # another kind of model: the earlier kind's fields go
            data["model"] = switch_kind(data.get("model", {}), value)
        if key in _NAMED_VARIANTS:
            section, name = key.split(".")
            current = (
                data.get(section, {}).get(name) if isinstance(data.get(section), dict) else None
            )
            value = by_name(value, current, _NAMED_VARIANTS[key])
        _set_dotted(data, key, value)
    return RunConfig(**data)


# Sections with one variant per kind that a bare name selects, and their default kind.
_NAMED_VARIANTS = {"learner.loss": "cispo", "learner.mismatch": "none", "rollout.engine": "torch"}


def _variants_by_name(data: dict[str, Any]) -> dict[str, Any]:
    """A config file's `learner.loss: NAME`, `learner.mismatch: NAME` and `rollout.engine:
    NAME` as the mappings they stand for, so that a later override can set one of their fields
    (`learner.loss.eps_high=0.3`)."""
    for key in _NAMED_VARIANTS:
        section, name = key.split(".")
        if isinstance(data.get(section), dict) and name in data[section]:
            data[section][name] = by_name(data[section][name])
    return data


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping of sections a YAML config file holds. Raises ValueError, one line
    naming the file (and the line for a syntax error), for a file that cannot be read, is
    not UTF-8, is not YAML, is empty (an empty file must not silently run the default
    job) or holds anything but a mapping at the top."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"config {path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ValueError(f"config {path}: not UTF-8 text") from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"config {path}: not valid YAML ({_yaml_problem(exc)})") from None
    if data is None:
        raise ValueError(
            f"config {path}: empty; give the sections to change (e.g. run_id: my-run), "
            "or --config default for the default job"
        )
    if not isinstance(data, dict):
        raise ValueError(
            f"config {path}: must be a mapping of sections (run_id:, model:, learner:, ...), "
            f"got {_a(type(data).__name__)}"
        )
    return data


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """ "line L, column C: problem" of a YAML error (its first line when it has no mark)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return str(problem)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _relative_to(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A config file's task paths, when relative, are relative to the file's folder (so an
    example config finds its data from any working directory); overrides are not."""
    tasks = data.get("task")
    for task in tasks if isinstance(tasks, list) else [tasks] if isinstance(tasks, dict) else []:
        if isinstance(task, dict) and isinstance(task.get("path"), str) and task["path"]:
            if not Path(task["path"]).is_absolute():
                task["path"] = str((folder / task["path"]).resolve())
    return data


def resolve_key(key: str) -> str:
    """`section.field` as given, or a bare field name (`loss`) resolved to the one section
    that has it (`learner.loss`). Raises ValueError for an unknown or ambiguous name."""
    if "." in key or key in RunConfig.model_fields:
        return key
    owners = [
        name
        for name, info in RunConfig.model_fields.items()
        if any(key in variant.model_fields for variant in _section_classes(info.annotation))
    ]
    if len(owners) != 1:
        found = f"a field of {' and '.join(owners)}" if owners else "not a config field"
        raise ValueError(f"{key}: {found}; write it as section.{key}")
    return f"{owners[0]}.{key}"


def _section_classes(annotation: Any) -> list[type[BaseModel]]:
    """The config classes a section's annotation names: itself, or each variant of a
    discriminated union (`model`), or none (a list, a plain value)."""
    if isinstance(annotation, type):
        return [annotation] if issubclass(annotation, BaseModel) else []
    if get_origin(annotation) is list:
        return []
    return [found for arg in get_args(annotation) for found in _section_classes(arg)]


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML (round-trips through load_config)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
