"""The prediction ledger's arithmetic (`curve_service.ledger`): grades by the first point
past the target, calibration by level and horizon, hand-computed."""

from __future__ import annotations

import pytest

from curve_service.errors import CurveInputError
from curve_service.ledger import Prediction, calibrate, grade


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
    grades = grade(predictions, list(reversed(POINTS)))  # any order of points
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
    rows = calibrate(grade(predictions, POINTS))
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
