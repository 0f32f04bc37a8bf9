"""The names of a run's curve series (the total "" and its tasks) and the gauges the curve
service publishes per series."""

from __future__ import annotations

import pytest

from curve_service.errors import CurveInputError, UnknownRunError, UnknownTaskError
from curve_service.fit import fit_sigmoid
from curve_service.metrics import CurveMetrics
from curve_service.store import check_series_room, series_name, validate_task
from scalerl.state.keys import TASK_NAME_PATTERN


@pytest.mark.parametrize("name", ["", "math", "code-v2", "0", "a_b", "a" * 32])
def test_valid_series_names(name: str) -> None:
    assert validate_task(name) == name


@pytest.mark.parametrize("name", ["Math", "-math", "_math", "a" * 33, "ma th", "m:x", "m\n", " "])
def test_invalid_series_names_name_the_field_and_pattern(name: str) -> None:
    with pytest.raises(CurveInputError) as err:
        validate_task(name)
    assert err.value.field == "task"
    assert err.value.message == (
        f"must be '' (the run's total) or match {TASK_NAME_PATTERN.pattern}, got {name!r}"
    )


def test_series_room_counts_tasks_and_always_admits_the_total() -> None:
    check_series_room("r1", "math", 63, 64)
    check_series_room("r1", "", 64, 64)  # the total is the 65th series
    with pytest.raises(CurveInputError, match=r"^task: run 'r1' already holds 64 task series"):
        check_series_room("r1", "math", 64, 64)


def test_not_found_messages_name_run_task_and_series() -> None:
    assert series_name("r1", "") == "run 'r1'"
    assert series_name("r1", "math") == "run 'r1' task 'math'"
    err = UnknownTaskError("r1", "bio", ("", "code"))
    assert (err.status, str(err)) == (
        "NOT_FOUND",
        "task: run 'r1' has no series 'bio'; its series: '' (the total), 'code'",
    )
    assert (
        str(UnknownTaskError("r1", "", ())) == "task: run 'r1' has no series ''; its series: none"
    )
    assert str(UnknownRunError("r9")) == "run_id: no run named 'r9'"
    assert str(UnknownRunError("r9", "math")) == "run_id: no run named 'r9' (asked for task 'math')"


def test_gauges_are_per_series() -> None:
    metrics = CurveMetrics()
    fit = fit_sigmoid([1.0, 2.0, 4.0, 8.0, 16.0], [0.1, 0.2, 0.35, 0.5, 0.58], r0=0.1)
    metrics.set_run("r1", 5, fit, target=100.0, task="math")
    metrics.set_run("r1", 2, None, task="")

    def sample(name: str, task: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"run_id": "r1", "task": task, **labels})

    assert sample("scalerl_curve_points", "math") == 5
    assert sample("scalerl_curve_points", "") == 2
    assert sample("scalerl_curve_asymptote", "math") == fit.a
    assert sample("scalerl_curve_asymptote", "") is None
    predicted = sample("scalerl_curve_predicted_reward", "math", target_compute="100")
    assert 0.1 < predicted <= fit.a
    metrics.set_run("r1", 3, None, task="math")  # a trim left too few points to fit
    assert sample("scalerl_curve_asymptote", "math") is None
    assert sample("scalerl_curve_predicted_reward", "math", target_compute="100") is None
    assert sample("scalerl_curve_points", "math") == 3
