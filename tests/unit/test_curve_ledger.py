"""The prediction ledger's arithmetic (`curve_service.ledger`): grades by the first point
past the target, calibration by level and horizon, hand-computed."""

from __future__ import annotations

import math

import pytest

from curve_service.errors import CurveInputError
from curve_service.ledger import HORIZONS, Prediction, calibrate, check_horizons, grade


def p(made_at: float, target: float, value: float, band: float, level: float = 0.9):
    return Prediction("", made_at, target, value, value - band, value + band, level, "sigmoid")


POINTS = [(1.0, 0.30), (2.0, 0.50), (3.0, 0.60), (4.0, 0.65), (8.0, 0.70)]


def test_a_prediction_is_graded_by_the_first_point_at_or_past_its_target() -> None:
    predictions = [
        p(1.0, 1.2, 0.45, 0.10),  # graded at 2.0 by 0.50: covered, error -0.05
        p(2.0, 3.0, 0.70, 0.05),  # exactly at 3.0 by 0.60: missed, error +0.10
        p(2.0, 5.0, 0.66, 0.02),  # at 8.0 by 0.70: missed, error -0.04
        p(4.0, 9.0, 0.72, 0.10),  # no point past 9.0 yet: not graded
    ]
    grades = grade(predictions, list(reversed(POINTS)), tolerance=math.inf)  # any order
    assert [(g.at, g.actual, g.covered) for g in grades] == [
        (2.0, 0.50, True),
        (3.0, 0.60, False),
        (8.0, 0.70, False),
    ]
    assert [round(g.error, 10) for g in grades] == [-0.05, 0.10, -0.04]


def test_calibration_groups_by_level_and_horizon() -> None:
    predictions = [
        p(1.0, 1.2, 0.45, 0.10),  # horizon 1.2: [1, 1.5)
        p(2.0, 3.0, 0.70, 0.05),  # 1.5: [1.5, 2)
        p(2.0, 2.5, 0.55, 0.08),  # 1.25: [1, 1.5), graded at 3.0 by 0.60: covered, +0.05 off
        p(2.0, 5.0, 0.66, 0.02),  # 2.5: [2, 4)
        p(1.0, 3.0, 0.60, 0.01, level=0.5),  # 3.0: [2, 4), level 0.5: covered, error 0
    ]
    rows = calibrate(grade(predictions, POINTS, tolerance=math.inf))
    got = [
        (r.level, r.horizon_low, r.graded, r.coverage, round(r.mean_width, 10), round(r.mae, 10))
        for r in rows
    ]
    assert got == [
        (0.5, 2.0, 1, 1.0, 0.02, 0.0),
        # widths 0.20 and 0.16; errors |-0.05| and |-0.05|
        (0.9, 1.0, 2, 1.0, 0.18, 0.05),
        (0.9, 1.5, 1, 0.0, 0.10, 0.10),
        (0.9, 2.0, 1, 0.0, 0.04, 0.04),
    ]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"made_at": 0.0}, "made_at"),
        ({"target": 1.0}, "target"),  # not past made_at
        ({"target": float("inf")}, "target"),
        ({"level": 1.0}, "level"),
        ({"lower": 0.6}, "band"),  # the band does not hold the value
    ],
)
def test_a_bad_prediction_names_its_field(fields: dict, field: str) -> None:
    base = dict(task="", made_at=1.0, target=2.0, value=0.5, lower=0.4, upper=0.6)
    with pytest.raises(CurveInputError) as error:
        Prediction(**{**base, "level": 0.9, "method": "sigmoid", **fields})
    assert error.value.field == field


def test_a_point_far_past_the_target_does_not_grade_it() -> None:
    # The first point past 3.3 is 4.0: 1.21x the target, within 1.25x; past 3.1 it is
    # 4.0 too: 1.29x, beyond, so that prediction waits (a later point cannot grade it).
    near, far = p(2.0, 3.3, 0.65, 0.05), p(2.0, 3.1, 0.65, 0.05)
    assert [(g.prediction, g.at) for g in grade([near, far], [(2.0, 0.5), (4.0, 0.65)])] == [
        (near, 4.0)
    ]
    assert grade([far], [(2.0, 0.5), (4.0, 0.65)], tolerance=1.3)[0].at == 4.0


def test_horizon_of_a_prediction_at_one_and_a_half_times_is_exactly_that() -> None:
    made_at = 0.7  # (1.5 x 0.7) / 0.7 is 1.4999999999999998 in floating point
    prediction = p(made_at, 1.5 * made_at, 0.5, 0.1)
    assert prediction.horizon == 1.5
    assert calibrate(grade([prediction], [(1.1, 0.5)]))[0].horizon_low == 1.5


def test_a_prediction_round_trips_through_its_stored_form() -> None:
    prediction = Prediction("math", 0.3, 0.6, 0.51, 0.4, 0.62, 0.9, "sigmoid")
    assert Prediction.from_json(prediction.to_json()) == prediction
    assert prediction.key == "math|0.3|0.6|0.9|sigmoid"
    with pytest.raises(CurveInputError) as err:
        Prediction.from_json('{"task": ""}')
    assert err.value.field == "ledger"


@pytest.mark.parametrize(
    ("edges", "field"),
    [
        ([0.0, 2.0], "horizons[0]"),
        ([1.0, float("nan")], "horizons[1]"),
        ([2.0, 2.0], "horizons[1]"),
        ([3.0], "horizons"),
    ],
)
def test_bad_horizon_edges_name_the_edge(edges, field) -> None:
    with pytest.raises(CurveInputError) as err:
        check_horizons(edges)
    assert err.value.field == field


def test_horizon_edges_make_buckets() -> None:
    assert check_horizons([]) == HORIZONS
    assert check_horizons([1, 2, math.inf]) == ((1.0, 2.0), (2.0, math.inf))
