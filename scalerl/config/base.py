"""What every config section shares: unknown fields are refused, assignments validated;
and how a section with one variant per kind (`learner.loss`, `rollout.engine`) reads a
bare name."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
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
