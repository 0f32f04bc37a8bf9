"""Configs: every shipped config loads; bad input is one line naming the field, exit 2."""

from __future__ import annotations

import typing

import pytest
from pydantic import Discriminator, Tag, TypeAdapter, ValidationError

from scalerl.config import (
    CONFIG_DIR,
    FileTaskConfig,
    PathModel,
    SglangEngineConfig,
    VllmEngineConfig,
    dump_config,
    load_config,
)
from scalerl.config.engine import EngineConfig
from scalerl.config.loss import LossConfig
from scalerl.config.model import ModelConfig
from scalerl.config.run import load_yaml
from scalerl.config.task import TaskConfig
from scalerl.config.weights import WeightsConfig
from scalerl_cli import main as cli


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_shipped_config_loads_and_round_trips(name, tmp_path):
    config = load_config(name)
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(config))
    assert load_config(str(path)) == config


def test_replay_capacity_is_k_plus_one_batches():
    config = load_config("default", ["learner.off_policy_k=3", "learner.batch_prompts=5"])
    assert config.replay_capacity == 4 * 5 * 3  # filled up to 3 x 5 groups a step
    unfilled = load_config("default", ["learner.off_policy_k=3", "learner.dynamic_sampling=1"])
    assert unfilled.replay_capacity == 4 * 8


def test_switching_the_model_kind_drops_only_the_earlier_kinds_fields():
    config = load_config("tiny", ["model.kind=path", "model.path=/models/qwen3"])
    assert isinstance(config.model, PathModel) and config.model.path == "/models/qwen3"
    # The tiny config's warm-up settings are every kind's and stay; its size does not.
    assert config.model.warmup_steps == load_config("tiny").model.warmup_steps > 0
    with pytest.raises(ValueError, match="model.path.tiny_layers"):
        load_config("tiny", ["model.kind=path", "model.path=/m", "model.tiny_layers=2"])


def test_naming_the_engine_keeps_its_settings_and_another_engine_starts_fresh(
    monkeypatch, tmp_path
):
    """A deploy overlay's vLLM settings survive the component's SCALERL_ROLLOUT__ENGINE."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        "rollout:\n  engine: {kind: vllm, enforce_eager: false, gpu_memory_utilization: 0.8}\n"
        "learner:\n  lend_idle: 'off'\n"
    )
    monkeypatch.setenv("SCALERL_ROLLOUT__ENGINE", "vllm")
    engine = load_config(str(config_file)).rollout.engine
    assert isinstance(engine, VllmEngineConfig)
    assert (engine.enforce_eager, engine.gpu_memory_utilization, engine.kv_cache_gib) == (
        False,
        0.8,
        1,
    )
    monkeypatch.setenv("SCALERL_ROLLOUT__ENGINE", "sglang")
    assert load_config(str(config_file)).rollout.engine == SglangEngineConfig(url="")


def test_a_task_takes_only_its_sources_fields() -> None:
    """The tiny config's additions task (large_max) switched to a file: its operands go,
    and the file's own fields are required; an operand on a file task is refused."""
    config = load_config(
        "tiny",
        [
            "task.source=file",
            "task.path=data.jsonl",
            "task.verifier=last_integer",
            "model.warmup_steps=0",
        ],
    )
    (task,) = config.task
    assert isinstance(task, FileTaskConfig) and task.heldout_size == 30  # shared: kept
    with pytest.raises(ValueError, match="path is required for source file"):
        load_config("tiny", ["task.source=file", "task.verifier=last_integer"])
    with pytest.raises(ValueError, match="task.0.file.large_max"):
        load_config(
            "tiny",
            ["task.source=file", "task.path=d.jsonl", "task.verifier=math", "task.large_max=9"],
        )
    with pytest.raises(ValueError, match="source must be one of 'additions', 'file'"):
        load_config("tiny", ["task.source=csv"])


@pytest.mark.parametrize(
    "union, field",
    [
        (EngineConfig, "kind"),
        (LossConfig, "kind"),
        (ModelConfig, "kind"),
        (TaskConfig, "source"),
        (WeightsConfig, "transport"),
    ],
)
def test_each_variant_section_lists_exactly_its_variants(union: object, field: str) -> None:
    """The names a wrong value is told about are the union's tags, the first the default."""
    members, discriminator = typing.get_args(union)
    assert isinstance(discriminator, Discriminator)
    tags = [
        next(m.tag for m in typing.get_args(member)[1:] if isinstance(m, Tag))
        for member in typing.get_args(members)
    ]
    adapter = TypeAdapter(union)
    with pytest.raises(ValidationError) as error:
        adapter.validate_python({field: "nope"})
    listed = ", ".join(repr(tag) for tag in tags)
    assert error.value.errors()[0]["msg"] == f"{field} must be one of {listed}"
    assert (
        getattr(adapter.validate_python({"name": "t"} if field == "source" else {}), field)
        == (tags[0])
    )


def test_off_is_a_word_in_files_and_overrides_and_only_true_false_are_booleans(tmp_path) -> None:
    """YAML 1.1 would read `off` as False, which a field of words refuses."""
    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  lend_idle: off\n  weights:\n    delta: off\n")
    assert load_config(str(path)).learner.lend_idle == "off"
    config = load_config(overrides=["learner.lend_idle=off", "learner.weights.delta=auto"])
    assert (config.learner.lend_idle, config.learner.weights.sends_deltas) == ("off", True)
    assert (
        load_config(overrides=["learner.weights.delta=off"]).learner.weights.sends_deltas is False
    )
    assert load_yaml("a: yes\nb: true\nc: False\nd: on") == {
        "a": "yes",
        "b": True,
        "c": False,
        "d": "on",
    }


def test_environment_overrides_a_field(monkeypatch):
    monkeypatch.setenv("SCALERL_LEARNER__LR", "2e-5")
    assert load_config("default").learner.lr == 2e-5


@pytest.mark.parametrize(
    ("value", "trackers"),
    [("", []), ("wandb", ["wandb"]), ("[tensorboard, mlflow]", ["tensorboard", "mlflow"])],
)
def test_trackers_are_a_list_a_name_or_an_environment_variable(monkeypatch, value, trackers):
    assert load_config("tiny").tracking == []  # none by default
    assert load_config("tiny", ["tracking=mlflow"]).tracking == ["mlflow"]
    monkeypatch.setenv("SCALERL_TRACKING", value)
    assert load_config("tiny").tracking == trackers
    assert load_config("tiny", ["tracking=[wandb]"]).tracking == ["wandb"]  # the flag wins


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "learner.lr=-1"], "scalerl: learner.lr: Input should be greater than 0"),
        (["--set", "rollout.group_size=1"], "scalerl: rollout.group_size: Input should be"),
        (["--set", "learner.nope=1"], "scalerl: learner.nope: Extra inputs are not permitted"),
        (
            ["--set", "rollout.thinking_budget=99"],
            "scalerl: rollout.thinking_budget + rollout.interrupt_text + rollout.answer_budget",
        ),
        (
            # Fits the token-free check (16 + >= 1 + 9 <= 26), not the tokenizer's: the
            # phrase is 4 tokens. Refused before anything starts.
            ["--set", "rollout.answer_budget=9", "--run-dir", "/nonexistent/never-created"],
            "scalerl: rollout.thinking_budget + rollout.interrupt_text + rollout.answer_budget"
            " = 16 + 4 tokens + 9 = 29 exceeds rollout.max_new_tokens = 26",
        ),
        (
            # The broadcast group sends tensors, never deltas: no silently ignored field.
            ["--set", "learner.weights.transport=broadcast", "--set", "learner.weights.delta=auto"],
            "scalerl: learner.weights.broadcast.delta: Extra inputs are not permitted",
        ),
        (
            # Each kind of model takes its own fields: a tiny model reads no folder, and
            # a folder model names one.
            ["--config", "tiny", "--set", "model.path=/models/qwen3"],
            "scalerl: model.tiny.path: Extra inputs are not permitted",
        ),
        (["--set", "model.kind=path"], "scalerl: model.path.path: Field required"),
        (
            # vLLM's settings are vLLM's: none is silently ignored by the torch engine.
            ["--set", "rollout.engine.enforce_eager=false"],
            "scalerl: rollout.engine.torch.enforce_eager: Extra inputs are not permitted",
        ),
        (
            ["--set", "rollout.engine=tpu"],
            "scalerl: rollout.engine: kind must be one of 'torch', 'vllm', 'sglang'",
        ),
        (["--set", "model.tiny_layers=2"], "scalerl: model.smollm2.tiny_layers: Extra inputs"),
        (
            ["--set", "model.kind=llama"],
            "scalerl: model: kind must be one of 'smollm2', 'tiny', 'path'",
        ),
        (
            ["--set", "tracking=[tensorboard, neptune]"],
            "scalerl: tracking.1: Input should be 'tensorboard', 'wandb' or 'mlflow' (got "
            "'neptune')",
        ),
        (
            ["--set", "tracking=[wandb, wandb]"],
            "scalerl: tracking: each tracker once, repeated: wandb",
        ),
        (["--config", "missing"], "scalerl: config 'missing': not a YAML file nor one of"),
        (["--set", "no-equals-sign"], "scalerl: override 'no-equals-sign' must look like"),
        *(
            (
                ["--redis-url", bad],
                "scalerl: --redis-url: must look like "
                "redis[s]://[[user]:password@]host[:port][/db][?cluster=true], got "
                f"{shown!r}",
            )
            for bad, shown in (
                ("localhost:6379", "localhost:6379"),
                ("http://h:6379", "http://h:6379"),
                ("redis://:pw@:6379/0", "redis://:***@:6379/0"),
                ("redis://h:99999/0", "redis://h:99999/0"),
            )
        ),
        (
            ["--redis-url", "redis://h:6379/0?cluster=on"],
            "scalerl: --redis-url: Redis URL parameter cluster must be one of true, false, "
            "got 'on'",
        ),
        *(
            (
                ["--set", f"eval.budget_fraction={bad}"],
                f"scalerl: eval.budget_fraction must lie in (0, 1] (a share of the run's "
                f"compute), got {bad}",
            )
            for bad in ("0.0", "-0.1", "1.5", "nan")
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(args, expected, capsys):
    assert cli.main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected), err
    assert err.count("\n") == 1
