"""`learner.loss`: the policy loss, one variant per `kind`, each with only the clipping it
takes (`learner_service.train.objective.policy_loss` has the formulas). A bare name
(`--set learner.loss=dapo`, `--vary loss=cispo,dapo`) is that loss, with its defaults
unless it was that loss already (`scalerl.config.base.by_name`); a mapping sets its own
fields (`learner.loss.eps_high=0.3`), and a field of another loss
is refused (`learner.loss.cispo.eps_high`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag

from scalerl.config.base import _Section, told_apart_by


class _Loss(_Section):
    """What every policy loss answers: its name and its hyperparameters."""

    kind: str

    @property
    def hyperparameters(self) -> dict[str, float]:
        """The loss's eps values by name (`policy_loss`'s keyword arguments)."""
        return {name: float(value) for name, value in self.model_dump(exclude={"kind"}).items()}


class CispoLoss(_Loss):
    """CISPO (MiniMax-M1; the paper's Eq. 4): truncated importance-sampling REINFORCE."""

    kind: Literal["cispo"] = "cispo"
    eps_max: float = Field(4.0, gt=0, description="Importance-ratio truncation: min(rho, eps_max).")


class DapoLoss(_Loss):
    """DAPO: PPO's clipped surrogate with an asymmetric clip."""

    kind: Literal["dapo"] = "dapo"
    eps_low: float = Field(0.2, ge=0, lt=1, description="Lower clip: 1 - eps_low.")
    eps_high: float = Field(0.28, ge=0, description="Upper clip: 1 + eps_high.")


class GspoLoss(_Loss):
    """GSPO: DAPO's clip on the sequence-level (length-normalized) importance ratio."""

    kind: Literal["gspo"] = "gspo"
    eps_low: float = Field(0.2, ge=0, lt=1, description="Lower clip: 1 - eps_low.")
    eps_high: float = Field(0.28, ge=0, description="Upper clip: 1 + eps_high.")


class GrpoLoss(_Loss):
    """GRPO: PPO's clipped surrogate with a symmetric clip."""

    kind: Literal["grpo"] = "grpo"
    eps: float = Field(0.2, ge=0, lt=1, description="Symmetric clip: 1 -/+ eps.")


LOSSES: dict[str, type[_Loss]] = {
    "cispo": CispoLoss,
    "dapo": DapoLoss,
    "gspo": GspoLoss,
    "grpo": GrpoLoss,
}
# Hyperparameters each policy loss takes: torch-free, so that the config and the
# learner's objective share one table.
LOSS_HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    kind: tuple(name for name in loss.model_fields if name != "kind")
    for kind, loss in LOSSES.items()
}


# `learner.loss`: one variant per policy loss, told apart by `kind`.
LossConfig = Annotated[
    Annotated[CispoLoss, Tag("cispo")]
    | Annotated[DapoLoss, Tag("dapo")]
    | Annotated[GspoLoss, Tag("gspo")]
    | Annotated[GrpoLoss, Tag("grpo")],
    told_apart_by("kind", ("cispo", "dapo", "gspo", "grpo")),
]
