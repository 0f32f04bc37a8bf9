"""`learner`: the ScaleRL update (paper Sec. 4), the off-policy mode and the learner's
schedule."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from scalerl.config.base import _Section, by_name
from scalerl.config.distill import DistillConfig
from scalerl.config.loss import CispoLoss, LossConfig
from scalerl.config.mismatch import MismatchConfig, NoMismatch
from scalerl.config.weights import UriWeights, WeightsConfig

# Every Linear of a Llama decoder layer: "LoRA Without Regret" (Schulman et al. 2025)
# found that adapting the MLPs as well as attention is needed to match full fine-tuning.


class LoraConfig(_Section):
    """LoRA adapters (Hu et al. 2021): the base is frozen and only the adapters are trained
    and published (`scalerl.policy.lora`)."""

    rank: int = Field(16, ge=1, le=1024, description="r: the adapters' rank.")
    alpha: float = Field(
        32.0,
        gt=0,
        le=65_536,
        description="The update is scaled by alpha / rank; 32 whatever the rank, as in "
        "'LoRA Without Regret' (Schulman et al. 2025), keeps the best learning rate "
        "nearly independent of the rank.",
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapters' input while training; the generator never "
        "drops, so above 0 the learner's log-probs differ from the generator's.",
    )
    target_modules: list[str] = Field(
        default_factory=list,
        description="Names (or name suffixes) of the Linear modules adapted; empty (the "
        "default): every projection of the decoder layers by the family's own names "
        "(q/k/v/o, gate/up/down; Phi-3's fused qkv_proj and gate_up_proj; attention only "
        "for MoE families, whose experts are not Linear modules). The LM head is never "
        "adapted.",
    )


class LearnerConfig(_Section):
    """The ScaleRL update (paper Sec. 4) and the learner's schedule."""

    batch_prompts: int = Field(8, ge=1, le=65_536, description="Prompt groups per step.")
    world_size: int = Field(
        1,
        ge=1,
        le=4096,
        description="Learner ranks: above 1 the learner runs under torchrun as that many "
        "processes, parameters, gradients and AdamW state sharded with FSDP2 (gloo on CPU, "
        "nccl on GPU); `scalerl run` starts them on this machine.",
    )
    lr: float = Field(1e-5, gt=0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    max_steps: int = Field(60, ge=0, le=10_000_000, description="Optimizer steps to run.")
    max_minutes: float = Field(
        0.0,
        ge=0,
        description="The run's learner time budget in minutes, set-up and evaluations "
        "included, summed over its learner processes (a restarted or resumed learner has "
        "what the earlier ones left; 0 = no limit); the final evaluation fits within it.",
    )
    off_policy_k: int = Field(8, ge=0, le=1024, description="k: max policy-version lag.")
    off_policy_mode: Literal["pipeline", "ppo"] = Field(
        "pipeline",
        description="pipeline: PipelineRL-k, in-flight weight updates, a group is used while "
        "learner version - its oldest token's version <= k; ppo: PPO-off-policy-k, a frozen "
        "policy generates k x batch_prompts groups, split into k minibatches, one optimizer "
        "step each, then new weights (paper Sec. 3.1).",
    )
    loss: LossConfig = Field(
        default_factory=CispoLoss,
        description="Policy loss (learner_service.train.objective.policy_loss), one of "
        "cispo (eps_max), dapo and gspo (eps_low, eps_high), grpo (eps): a name, or a "
        "mapping with `kind` and its own clipping (scalerl.config.loss).",
    )
    mismatch: MismatchConfig = Field(
        default_factory=NoMismatch,
        description="Engine/learner mismatch correction (learner_service.train.objective."
        "mismatch_weights), one of none, tis (cap), mis_token (cap), mis_sequence (cap), "
        "icepop (low, high): a name, or a mapping with `kind` and its own thresholds "
        "(scalerl.config.mismatch).",
    )
    aggregation: Literal["prompt", "sample", "token"] = "prompt"
    advantage_norm: Literal["batch", "prompt", "none"] = "batch"
    zero_variance_filter: bool = True
    dynamic_sampling: int = Field(
        3,
        ge=1,
        le=64,
        description="Dynamic sampling (DAPO): with zero_variance_filter in pipeline mode, "
        "read up to this many x batch_prompts groups so that batch_prompts of them carry a "
        "gradient (samples that did not all score alike); 1 = off.",
    )
    no_positive_resampling: bool = Field(
        True, description="Retire prompts whose pass rate reaches npr_threshold (Sec. 3.2)."
    )
    npr_threshold: float = Field(
        0.9, gt=0, le=1.0, description="No-Positive-Resampling pass-rate threshold."
    )
    npr_min_attempts: int = Field(
        8, ge=1, description="Attempts before a prompt can be retired by NPR."
    )
    fp32_lm_head: bool = True
    routing_replay: bool = Field(
        True,
        description="MoE models: the learner's forward routes each token to the experts "
        "the engine routed it to (R3), so the importance ratio compares one network; the "
        "torch engine records them. An engine that records none (vllm, sglang) needs "
        "false, and the learner then routes by itself.",
    )
    autocast_bf16: bool | Literal["auto"] = Field(
        "auto",
        description="bf16 autocast for the body (logits fp32); auto = on where the device "
        "computes bf16 natively (scalerl.policy.hardware).",
    )
    micro_batch_samples: int = Field(
        16, ge=1, description="Samples per forward/backward (without shared_prefix)."
    )
    shared_prefix: bool = Field(
        True,
        description="Forward each group's prompt once for its G samples (one group per "
        "forward/backward); same loss and gradient, far fewer tokens for short replies.",
    )
    threads: int = Field(
        0,
        ge=0,
        le=256,
        description="torch threads of the learner (each rank); 0 = the launcher's core "
        "plan (scalerl.cores), or every core this process may use when started alone.",
    )
    lend_idle: Literal["off", "workers"] = Field(
        "off",
        description="What `scalerl run` does with the learner's cores while it waits for "
        "groups or an evaluation. off: they idle. workers: lender workers, rollout workers "
        "pinned to the learner's cores, generate until the learner has work, then stop "
        "within one decode step (scalerl.lending); CPU learners of one rank with the torch "
        "engine (on a GPU node the learner's device is not lent: off).",
    )
    checkpoint_every: int = Field(
        10,
        ge=0,
        le=10_000_000,
        description="Checkpoint every N optimizer steps (0 = only by time and at the end).",
    )
    checkpoint_minutes: float = Field(
        15.0,
        ge=0,
        le=10_080,
        description="Also checkpoint when this many minutes passed since the last "
        "checkpoint (0 = only by steps and at the end); a preempted pod loses at most this.",
    )
    distill: DistillConfig | None = Field(
        None,
        description="On-policy distillation from a teacher, mixed with the task reward "
        "(None = RL alone; scalerl.config.distill).",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters instead of every weight, and publish the adapters "
        "alone (None = full fine-tuning); `--set learner.lora.rank=16` turns it on.",
    )
    weights: WeightsConfig = Field(
        default_factory=lambda: UriWeights(),
        description="How new weights reach the workers (`transport` picks the variant).",
    )
    batch_timeout_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 86_400,
        description="Stop the run when no admissible group arrives for this many seconds "
        "(every worker gone or wedged); max_minutes also ends the wait.",
    )

    @property
    def filters_zero_variance(self) -> bool:
        """Zero-variance groups are dropped: `zero_variance_filter`, but not under
        distillation with a KL term, where every group carries the teacher's signal."""
        distilled = self.distill is not None and self.distill.kl_coef > 0
        return self.zero_variance_filter and not distilled

    @property
    def fill_up_to(self) -> int:
        """Groups a PipelineRL round reads at most with dynamic sampling: dynamic_sampling
        x batch_prompts with the zero-variance filter in pipeline mode; 0 (no filling)
        otherwise."""
        if self.off_policy_mode != "pipeline" or not self.filters_zero_variance:
            return 0
        return self.dynamic_sampling * self.batch_prompts

    @field_validator("loss", "mismatch", mode="before")
    @classmethod
    def _variant_by_name(cls, value: object) -> object:
        return by_name(value)

    @model_validator(mode="after")
    def _check_mode(self) -> LearnerConfig:
        if self.lend_idle == "workers" and self.world_size > 1:
            raise ValueError(
                "learner.lend_idle: workers lends the cores of a learner of one rank, got "
                f"learner.world_size {self.world_size} (set lend_idle off)"
            )
        if self.off_policy_mode == "ppo" and self.off_policy_k < 1:
            raise ValueError(
                "learner.off_policy_k must be >= 1 with off_policy_mode 'ppo' "
                f"(k minibatches per generated batch), got {self.off_policy_k}"
            )
        return self
