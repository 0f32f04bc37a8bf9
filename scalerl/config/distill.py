"""`learner.distill`: on-policy distillation (the student samples, a teacher scores every
sampled token, the per-token reverse KL is the signal; `learner_service.train.objective.
distill_advantages`), mixed with the task's reward."""

from __future__ import annotations

from pydantic import Field, model_validator

from scalerl.config.base import _Section
from scalerl.config.model import ModelConfig


class DistillConfig(_Section):
    """The teacher and the mix. Teacher workers (`scalerl-rollout --role teacher`, started
    by the launcher as `teachers` processes) load `teacher`, with `checkpoint`'s weights
    when given, and score each group's sampled tokens before the group reaches the replay
    stream; a group its teachers cannot score within `deadline_s` is dead-lettered
    (teacher_unavailable), never trained on. The teacher's tokenizer must be the
    student's."""

    teacher: ModelConfig = Field(description="The teacher model (a `model` section).")
    checkpoint: str = Field(
        "",
        description="The teacher's weights: a run folder, its checkpoint/, an HF folder or "
        "a .safetensors file ('' = the teacher as `teacher` loads it).",
    )
    kl_coef: float = Field(
        1.0, ge=0, le=1000, description="Weight of the reverse-KL advantage per token."
    )
    reward_coef: float = Field(
        0.0, ge=0, le=1000, description="Weight of the task reward's group advantage."
    )
    teachers: int = Field(1, ge=1, le=256, description="Teacher workers the launcher starts.")
    deadline_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Seconds a group's teacher scores are retried across the teachers; then "
        "it is dead-lettered (teacher_unavailable).",
    )

    @model_validator(mode="after")
    def _check_mix(self) -> DistillConfig:
        if self.kl_coef == 0 and self.reward_coef == 0:
            raise ValueError("learner.distill: kl_coef and reward_coef must not both be 0")
        return self
