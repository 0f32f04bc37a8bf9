"""Named RL recipes and ScaleRL's leave-one-out variants, as config overrides (torch-free).

A recipe fixes the algorithmic components the paper compares (loss and its clipping,
loss aggregation, advantage normalization, FP32 LM head, zero-variance filtering,
No-Positive-Resampling, off-policy mode); everything else (model, task, k, batch, budget)
stays the run config's. Precedence: config file < recipe < leave-out < environment <
`--set`.

Recipes, as far as the paper describes them (Khatri et al. 2025, Sec. 4-5, Fig. 2):
- `scalerl`: PipelineRL-k, CISPO, prompt-level aggregation, batch-level advantage
  normalization, FP32 LM head, zero-variance filtering, No-Positive-Resampling (Sec. 4).
- `deepseek-grpo`: GRPO's symmetric clip (eps 0.2), sample-level aggregation, per-prompt
  normalization, synchronous PPO-style batches (PPO-off-policy-k).
- `qwen2.5-dapo`: DAPO's asymmetric clip (0.2 / 0.28), token-level aggregation,
  per-prompt normalization, dynamic sampling (= zero-variance filtering).
- `magistral`: DAPO clipping (0.2 / 0.28), token-level aggregation, advantages normalized
  over the minibatch (batch-level), groups with zero advantage filtered.
- `minimax-m1`: CISPO with token-level aggregation, per-prompt normalization, FP32 LM head.
The four comparison recipes train with PPO-off-policy-k (a frozen policy per batch), as
their papers do; the paper reran them in its own setup, which is what these are.

Leave-one-out (Sec. 4, "leave-one-out ablations"): ScaleRL with one component reverted
to the paper's baseline choice (`LEAVE_OUT`). The FP32 LM head switch is the learner's; the
torch rollout engine always computes its head in fp32.
"""

from __future__ import annotations

# Every recipe sets every component, so a recipe never inherits another one's choice.
COMPONENTS = (
    "loss",
    "aggregation",
    "advantage_norm",
    "fp32_lm_head",
    "zero_variance_filter",
    "no_positive_resampling",
    "off_policy_mode",
)

RECIPES: dict[str, dict[str, object]] = {
    "scalerl": {
        "loss": "cispo",
        "aggregation": "prompt",
        "advantage_norm": "batch",
        "fp32_lm_head": True,
        "zero_variance_filter": True,
        "no_positive_resampling": True,
        "off_policy_mode": "pipeline",
    },
    "deepseek-grpo": {
        "loss": {"kind": "grpo", "eps": 0.2},
        "aggregation": "sample",
        "advantage_norm": "prompt",
        "fp32_lm_head": False,
        "zero_variance_filter": False,
        "no_positive_resampling": False,
        "off_policy_mode": "ppo",
    },
    "qwen2.5-dapo": {
        "loss": {"kind": "dapo", "eps_low": 0.2, "eps_high": 0.28},
        "aggregation": "token",
        "advantage_norm": "prompt",
        "fp32_lm_head": False,
        "zero_variance_filter": True,
        "no_positive_resampling": False,
        "off_policy_mode": "ppo",
    },
    "magistral": {
        "loss": {"kind": "dapo", "eps_low": 0.2, "eps_high": 0.28},
        "aggregation": "token",
        "advantage_norm": "batch",
        "fp32_lm_head": False,
        "zero_variance_filter": True,
        "no_positive_resampling": False,
        "off_policy_mode": "ppo",
    },
    "minimax-m1": {
        "loss": "cispo",
        "aggregation": "token",
        "advantage_norm": "prompt",
        "fp32_lm_head": True,
        "zero_variance_filter": False,
        "no_positive_resampling": False,
        "off_policy_mode": "ppo",
    },
}

# ScaleRL component -> the learner fields that revert it to the paper's baseline.
LEAVE_OUT: dict[str, dict[str, object]] = {
    "cispo": {"loss": {"kind": "dapo", "eps_low": 0.2, "eps_high": 0.28}},
    "prompt_aggregation": {"aggregation": "sample"},
    "batch_advantage_norm": {"advantage_norm": "prompt"},
    "fp32_lm_head": {"fp32_lm_head": False},
    "zero_variance_filter": {"zero_variance_filter": False},
    "no_positive_resampling": {"no_positive_resampling": False},
    "pipeline": {"off_policy_mode": "ppo"},
}


def recipe_overrides(recipe: str | None, leave_out: list[str] | tuple[str, ...] = ()) -> list[str]:
    """`learner.field=value` overrides for a named recipe and leave-one-out components,
    in the order they apply.

    Raises:
        ValueError: an unknown recipe or component, naming the allowed ones.
    """
    fields: dict[str, object] = {}
    if recipe is not None:
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
        fields.update(RECIPES[recipe])
    for component in leave_out:
        if component not in LEAVE_OUT:
            raise ValueError(
                f"leave-out component must be one of {', '.join(LEAVE_OUT)}, got {component!r}"
            )
        fields.update(LEAVE_OUT[component])
    return [f"learner.{key}={_yaml(value)}" for key, value in fields.items()]


def _yaml(value: object) -> str:
    if isinstance(value, dict):  # a loss with its clipping, as a YAML flow mapping
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value).lower() if isinstance(value, bool) else str(value)
