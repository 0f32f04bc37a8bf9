"""Switchable components: the learner config's losses and modes, named recipes,
leave-one-out variants, sweep parsing, and the CLI's exit-2 errors for them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from scalerl.config import LOSS_HYPERPARAMETERS, LearnerConfig, load_config, resolve_key
from scalerl.recipes import COMPONENTS, LEAVE_OUT, RECIPES, recipe_overrides
from scalerl_cli.main import main
from scalerl_cli.sweep import build_variants, parse_vary


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ("cispo", {"eps_max": 4.0}),
        ("dapo", {"eps_low": 0.2, "eps_high": 0.28}),
        ("gspo", {"eps_low": 0.2, "eps_high": 0.28}),
        ("grpo", {"eps": 0.2}),
    ],
)
def test_each_loss_takes_its_own_hyperparameters(loss: str, expected: dict) -> None:
    assert LearnerConfig(loss=loss).loss.hyperparameters == expected
    assert LOSS_HYPERPARAMETERS[loss] == tuple(expected)


def test_hyperparameter_ranges_are_validated() -> None:
    with pytest.raises(ValidationError, match="eps_low"):
        LearnerConfig(loss={"kind": "dapo", "eps_low": 1.0})
    with pytest.raises(ValidationError, match="eps_max"):
        LearnerConfig(loss={"kind": "cispo", "eps_max": 0.0})
    with pytest.raises(ValidationError, match="kind must be one of 'cispo', 'dapo'"):
        LearnerConfig(loss="ppo")


def test_a_clip_of_another_loss_is_refused_not_ignored() -> None:
    """CISPO truncates at eps_max and has no eps_high: setting one is an error."""
    with pytest.raises(ValidationError, match="loss.cispo.eps_high"):
        load_config("default", ["learner.loss.eps_high=0.3"])
    dapo = load_config("default", ["learner.loss=dapo", "learner.loss.eps_high=0.3"])
    assert dapo.learner.loss.hyperparameters == {"eps_low": 0.2, "eps_high": 0.3}
    # A loss named again starts from its defaults: the earlier clip was the other's.
    again = load_config("default", ["learner.loss={kind: dapo, eps_low: 0.1}", "loss=cispo"])
    assert again.learner.loss.hyperparameters == {"eps_max": 4.0}


def test_ppo_off_policy_needs_k_at_least_one() -> None:
    assert LearnerConfig(off_policy_mode="ppo", off_policy_k=1).off_policy_k == 1
    with pytest.raises(ValidationError, match="off_policy_k must be >= 1"):
        LearnerConfig(off_policy_mode="ppo", off_policy_k=0)
    assert LearnerConfig(off_policy_mode="pipeline", off_policy_k=0).off_policy_k == 0


def test_every_recipe_sets_every_component_and_loads() -> None:
    for name, fields in RECIPES.items():
        assert set(COMPONENTS) <= set(fields), name
        learner = load_config("tiny", recipe=name).learner
        for key, value in fields.items():
            assert getattr(learner, key) == getattr(LearnerConfig(**{key: value}), key), name


def test_scalerl_recipe_is_the_default_learner() -> None:
    default = LearnerConfig()
    for key, value in RECIPES["scalerl"].items():
        assert getattr(default, key) == getattr(LearnerConfig(**{key: value}), key), key


def test_leave_one_out_reverts_exactly_one_component() -> None:
    base = load_config("tiny", recipe="scalerl").learner.model_dump()
    for component, fields in LEAVE_OUT.items():
        changed = load_config("tiny", recipe="scalerl", leave_out=[component]).learner
        diff = {k for k, v in changed.model_dump().items() if base[k] != v}
        assert diff and diff <= set(fields), (component, diff)
    assert load_config("tiny", leave_out=["cispo"]).learner.loss.kind == "dapo"
    assert load_config("tiny", leave_out=["pipeline"]).learner.off_policy_mode == "ppo"


def test_command_line_beats_recipe_beats_file(monkeypatch) -> None:
    monkeypatch.delenv("SCALERL_LEARNER__LOSS", raising=False)
    assert (
        load_config("tiny", ["learner.loss=gspo"], recipe="magistral").learner.loss.kind == "gspo"
    )
    monkeypatch.setenv("SCALERL_LEARNER__AGGREGATION", "prompt")
    assert load_config("tiny", recipe="magistral").learner.aggregation == "prompt"
    assert load_config("tiny", ["aggregation=sample"]).learner.aggregation == "sample"


def test_unknown_recipe_or_component_is_named() -> None:
    with pytest.raises(ValueError, match="recipe must be one of scalerl"):
        recipe_overrides("grpo")
    with pytest.raises(ValueError, match="leave-out component must be one of cispo"):
        recipe_overrides(None, ["kl"])


def test_bare_keys_resolve_to_their_section() -> None:
    assert resolve_key("loss") == "learner.loss"
    assert resolve_key("group_size") == "rollout.group_size"
    assert resolve_key("seed") == "seed"
    assert resolve_key("learner.threads") == "learner.threads"
    # A field of one kind of model only (the section is a union of kinds).
    assert resolve_key("tiny_layers") == "model.tiny_layers"
    assert resolve_key("warmup_steps") == "model.warmup_steps"
    with pytest.raises(ValueError, match="a field of rollout and learner"):
        resolve_key("threads")
    with pytest.raises(ValueError, match="not a config field"):
        resolve_key("nonsense")


def test_sweep_variants_are_the_cartesian_product() -> None:
    axes = parse_vary(["loss=cispo,dapo", "recipe=scalerl,magistral"])
    assert axes == [("learner.loss", ["cispo", "dapo"]), ("recipe", ["scalerl", "magistral"])]
    variants = build_variants("tiny", axes, None, [], ["learner.max_steps=3"])
    assert [v.label for v in variants] == [
        "loss=cispo,recipe=scalerl",
        "loss=cispo,recipe=magistral",
        "loss=dapo,recipe=scalerl",
        "loss=dapo,recipe=magistral",
    ]
    # --vary beats the recipe (it is a --set), and every variant has its own run_id.
    assert [v.config.learner.loss.kind for v in variants] == ["cispo", "cispo", "dapo", "dapo"]
    assert variants[1].config.learner.aggregation == "token"  # magistral's
    assert variants[0].config.run_id == "tiny-loss-cispo-recipe-scalerl"
    assert all(v.config.learner.max_steps == 3 for v in variants)
    loo = build_variants("tiny", parse_vary(["leave_out=none,fp32_lm_head"]), None, [], [])
    assert [v.config.learner.fp32_lm_head for v in loo] == [True, False]


def test_sweep_seeds_are_runs_of_each_variant() -> None:
    variants = build_variants("tiny", parse_vary(["loss=cispo,dapo"]), None, [], [], seeds=3)
    cispo = variants[0]
    assert [sub for sub, _ in cispo.runs] == ["seed-0", "seed-1", "seed-2"]
    assert [config.seed for _, config in cispo.runs] == [0, 1, 2]
    assert [config.run_id for _, config in cispo.runs] == [
        "tiny-loss-cispo-s0",
        "tiny-loss-cispo-s1",
        "tiny-loss-cispo-s2",
    ]
    assert {config.learner.loss.kind for _, config in variants[1].runs} == {"dapo"}
    assert cispo.run_dirs(Path("sweep"))[2] == Path("sweep/loss-cispo/seed-2")
    single = build_variants("tiny", parse_vary(["loss=cispo"]), None, [], [])[0]
    assert single.run_dirs(Path("sweep")) == [Path("sweep/loss-cispo")]


def test_sweep_rejects_bad_axes() -> None:
    with pytest.raises(ValueError, match="at least one value"):
        parse_vary(["loss="])
    with pytest.raises(ValueError, match="given twice"):
        parse_vary(["loss=cispo", "learner.loss=dapo"])
    with pytest.raises(ValueError, match="variant loss=bogus: learner.loss"):
        build_variants("tiny", parse_vary(["loss=cispo,bogus"]), None, [], [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--config", "tiny", "--recipe", "nope"], "recipe must be one of"),
        (["run", "--config", "tiny", "--leave-out", "kl"], "leave-out component must be"),
        (
            ["run", "--config", "tiny", "--set", "learner.off_policy_mode=ppo", "--set", "k=0"],
            "not a config field",
        ),
        (
            [
                "run",
                "--config",
                "tiny",
                "--set",
                "learner.off_policy_mode=ppo",
                "--set",
                "learner.off_policy_k=0",
            ],
            "learner.off_policy_k must be >= 1",
        ),
        (["sweep", "--config", "tiny", "--vary", "loss=cispo,bogus"], "variant loss=bogus"),
        (["sweep", "--config", "tiny", "--vary", "threads=1,2"], "threads: a field of"),
        (["sweep", "--config", "tiny", "--vary", "loss=cispo", "--seeds", "0"], "--seeds: must"),
    ],
)
def test_cli_bad_recipe_input_exits_2_with_one_line(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
