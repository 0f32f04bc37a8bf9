"""What every config section shares: unknown fields are refused, assignments validated;
how a section with one variant per kind (`learner.loss`, `rollout.engine`) reads a
bare name; and how such a section's variants are told apart (`told_apart_by`)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def by_name(value: Any, current: Any = None, default_kind: str = "") -> Any:
    """A variant section set to `value`. A bare name stands for that kind: the `current`
    mapping when it already is that kind (its fields stay: a file's vLLM settings and
    `SCALERL_ROLLOUT__ENGINE=vllm` together), else the kind with its defaults. A mapping
    replaces the section as given. `default_kind`: the kind of a mapping without one."""
    if not isinstance(value, str):
        return value
    if isinstance(current, dict) and current.get("kind", default_kind) == value:
        return current
    return {"kind": value}


def told_apart_by(field: str, names: tuple[str, ...]) -> Discriminator:
    """The discriminator of a section with one variant per `field` value (`kind`, `source`,
    `transport`), each tagged with its name in `names`: a mapping names its variant by
    `field`, `names[0]` when left out (so a field of another variant is reported as not
    permitted for the default one); a built variant by its attribute. Any other name is
    refused with one line listing `names` (error type `unknown_{field}`)."""

    def variant_of(value: Any) -> str | None:
        if isinstance(value, dict):
            name = value.get(field, names[0])
        else:
            name = getattr(value, field, None)
        return None if name is None else str(name)

    listed = ", ".join(repr(name) for name in names)
    return Discriminator(
        variant_of,
        custom_error_type=f"unknown_{field}",
        custom_error_message=f"{field} must be one of {listed}",
    )
