"""`learner.mismatch`: the correction of the gap between the engine that sampled a token
and the learner that trains on it, one variant per `kind`, each with only its thresholds
(`learner_service.train.objective.mismatch_weights` has the formulas). A bare name
(`--set learner.mismatch=icepop`) is that correction with its defaults; a mapping sets its
own thresholds (`learner.mismatch.high=3`), and a threshold of another correction is
refused.

The ratio corrected is rho_t = pi_learner(y_t) / pi_engine(y_t): the learner's
probability of the sampled token at the step (no gradient) over the engine's at sampling.
For a token of off-policyness 0 it is the engine/learner mismatch alone (precision,
kernels, MoE routing); for an older one it also holds how far the policy has moved since.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag

from scalerl.config.base import _Section, told_apart_by

# The importance-ratio histogram every step reports (metrics.jsonl `ratio_histogram`,
# Prometheus, report.json): bucket i holds the tokens with EDGES[i-1] <= rho < EDGES[i]
# (EDGES[-1] = 0 and EDGES[len] = inf), so len(EDGES) + 1 buckets. Fine around 1, where a
# bf16 engine's mismatch lies (|log rho| of 0.01-0.05 per token).
RATIO_HISTOGRAM_EDGES = (0.5, 0.8, 0.9, 0.95, 0.99, 1.01, 1.05, 1.1, 1.25, 2.0)


class _Mismatch(_Section):
    """What every correction answers: its name and its thresholds."""

    kind: str

    @property
    def thresholds(self) -> dict[str, float]:
        """The correction's thresholds by name (`mismatch_weights`' keyword arguments)."""
        return {name: float(value) for name, value in self.model_dump(exclude={"kind"}).items()}


class NoMismatch(_Mismatch):
    """No correction: the loss's own ratio is pi_theta / pi_engine, truncated (CISPO) or
    clipped (the PPO losses) as the loss says (the paper's)."""

    kind: Literal["none"] = "none"


class TisMismatch(_Mismatch):
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"): each token weighted by min(rho, cap)."""

    kind: Literal["tis"] = "tis"
    cap: float = Field(2.0, ge=1, allow_inf_nan=False, description="Weight cap C: min(rho, C).")


class MisTokenMismatch(_Mismatch):
    """Masked importance sampling per token (Yao et al. 2025; "When speed kills
    stability", Liu et al. 2025): rho where rho <= cap, else the token is masked out."""

    kind: Literal["mis_token"] = "mis_token"
    cap: float = Field(
        2.0, ge=1, allow_inf_nan=False, description="Tokens with rho above C are masked."
    )


class MisSequenceMismatch(_Mismatch):
    """Masked importance sampling per sequence (Liu et al. 2025): the sample's ratio, the
    product of its tokens' rho, weights all its tokens where it is <= cap, else the whole
    sample is masked out."""

    kind: Literal["mis_sequence"] = "mis_sequence"
    cap: float = Field(
        2.0, ge=1, allow_inf_nan=False, description="Samples whose ratio is above C are masked."
    )


class IcePopMismatch(_Mismatch):
    """IcePop (Ling team 2025, "Every Step Evolves", the Ring-1T report): rho where
    low <= rho <= high, else the token is masked out (both sides: a token the engine over-
    or under-rates)."""

    kind: Literal["icepop"] = "icepop"
    low: float = Field(0.5, gt=0, lt=1, description="Tokens with rho below this are masked.")
    high: float = Field(
        5.0, gt=1, allow_inf_nan=False, description="Tokens with rho above this are masked."
    )


MISMATCHES: dict[str, type[_Mismatch]] = {
    "none": NoMismatch,
    "tis": TisMismatch,
    "mis_token": MisTokenMismatch,
    "mis_sequence": MisSequenceMismatch,
    "icepop": IcePopMismatch,
}

# `learner.mismatch`: one variant per correction, told apart by `kind`.
MismatchConfig = Annotated[
    Annotated[NoMismatch, Tag("none")]
    | Annotated[TisMismatch, Tag("tis")]
    | Annotated[MisTokenMismatch, Tag("mis_token")]
    | Annotated[MisSequenceMismatch, Tag("mis_sequence")]
    | Annotated[IcePopMismatch, Tag("icepop")],
    told_apart_by("kind", tuple(MISMATCHES)),
]
