"""A sweep's verdict, checked (`scalerl_cli.sweep_verdict`): the final scores' call with
its seeds, the share from which the curves named the winner, and the verdict history on
the curve service in this process."""

from __future__ import annotations

import math

import numpy as np
import pytest

from curve_service.server import CurveServicer
from curve_service.sigmoid import SigmoidParams, predict
from scalerl.rpc.clients.curve import CurveClient, FitSpec
from scalerl_cli.sweep_verdict import (
    CONFIDENT,
    TOO_CLOSE,
    Score,
    VerdictAt,
    checkpoints,
    final_call,
    settled_share,
    verdict_history,
)


def test_a_score_over_seeds_is_their_mean_and_the_stderr_of_that_mean() -> None:
    one = Score.of([(0.40, 0.03)])
    assert (one.mean, one.stderr, one.seeds) == (0.40, 0.03, 1)
    three = Score.of([(0.40, 0.03), (0.46, 0.03), (0.43, 0.03)])
    # mean 0.43; sample sd sqrt((0.03^2 + 0.03^2 + 0) / 2) = 0.03; / sqrt(3)
    assert three.mean == pytest.approx(0.43)
    assert three.stderr == pytest.approx(0.03 / math.sqrt(3))
    assert three.seeds == 3


def test_the_best_is_named_only_beyond_both_standard_errors() -> None:
    clear = final_call([Score(0.50, 0.01, 3), Score(0.60, 0.01, 3), Score(0.55, 0.02, 3)])
    # 0.60 - 0.55 = 0.05 > 0.01 + 0.02
    assert (clear.best, clear.gap) == (1, pytest.approx(0.05))
    close = final_call([Score(0.394, 0.045, 1), Score(0.385, 0.045, 1)])
    assert close.best is None and close.gap == pytest.approx(0.009)
    # (0.045 + 0.045) / 0.009 = 10, squared: 100 seeds per variant.
    assert close.seeds_needed == 100
    assert close.line.startswith(f"{TOO_CLOSE}: the best two ended 0.009 apart")
    # On the boundary, gap == the sum of the stderrs: not beyond it, too close.
    assert final_call([Score(0.5, 0.025, 1), Score(0.45, 0.025, 1)]).best is None
    tie = final_call([Score(0.5, 0.02, 2), Score(0.5, 0.02, 2)])
    assert (tie.best, tie.seeds_needed) == (None, None)


def at(share: float, best: int | None) -> VerdictAt:
    return VerdictAt(compute=share, share=share, best=best, p_best=0.95, decided_by="A")


def test_the_settled_share_is_where_the_final_winner_held_from() -> None:
    history = [at(0.2, 0), at(0.3, None), at(0.4, 1), at(0.6, 1), at(1.0, 1)]
    assert settled_share(history, 1) == 0.4
    assert settled_share(history, 0) is None  # named early, but not at the end
    assert settled_share(history, None) is None
    assert settled_share([at(0.5, 1), at(1.0, None)], 1) is None


def test_checkpoints_span_the_shortest_run_from_where_every_run_can_be_fitted() -> None:
    runs = [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [0.0, 1.5, 2.5, 3.5, 4.5]]
    # The 4th evaluation of each: 3.0 and 3.5; the shortest run ends at 4.5.
    assert checkpoints(runs) == ([3.5, 4.0, 4.5], 4.5)
    # Two seeds pooled: the 4th distinct compute, not the 4th point.
    assert checkpoints([[0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]]) == ([3.0], 3.0)


def spec(params: SigmoidParams, noise: float, seed: int) -> FitSpec:
    compute = np.linspace(0.05, 1.0, 12)
    reward = predict(params, compute) + np.random.default_rng(seed).normal(0, noise, 12)
    return FitSpec(
        compute=list(compute),
        reward=list(np.clip(reward, 0, 1)),
        stderr=[max(noise, 0.005)] * 12,
        r0=params.r0,
        bootstrap_resamples=100,
    )


def test_the_history_names_the_clearly_better_recipe_and_not_a_tie() -> None:
    low = SigmoidParams(a=0.5, b=2.0, c_mid=0.3, r0=0.1)
    high = SigmoidParams(a=0.8, b=2.0, c_mid=0.3, r0=0.1)
    with CurveClient.in_process(CurveServicer()) as client:
        clear = verdict_history(client, [spec(low, 0.01, 1), spec(high, 0.01, 2)])
        tie = verdict_history(client, [spec(high, 0.05, 3), spec(high, 0.05, 4)])
    # Windows from the 4th evaluation (compute 0.3136) to the end, one per evaluation.
    assert [v.share for v in clear] == pytest.approx(list(np.linspace(0.05, 1.0, 12)[3:]))
    assert clear[-1].best == 1 and clear[-1].p_best >= CONFIDENT
    assert settled_share(clear, 1) is not None and settled_share(clear, 1) < 1.0
    # The same recipe twice: the curves do not name one at the end.
    assert tie[-1].best is None and tie[-1].p_best < CONFIDENT


def test_a_lone_score_without_a_standard_error_is_not_compared() -> None:
    from scalerl_cli.sweep import score_of

    assert score_of("lr=1e-4", [(0.6, None)]) is None  # it would look exact
    assert score_of("lr=1e-4", [(0.6, 0.03)]) == Score(0.6, 0.03, 1)
    # With two seeds the spread is the standard error, known without the evaluations'.
    two = score_of("lr=1e-4", [(0.6, None), (0.5, None)])
    assert two is not None and two.stderr == pytest.approx(0.05)
