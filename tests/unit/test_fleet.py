"""How many rollout workers the learner asks for (`scalerl.fleet.desired_replicas`,
docs/architecture.md, "How many workers"): bounded, monotone in each signal, deaf to flips
shorter than the hold, one change at most under constant inputs, a closed loop that
settles, the cooldown kept; and hand-computed answers."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from scalerl.config import FleetConfig, RunConfig
from scalerl.fleet import FleetState, desired_replicas

POLICY = FleetConfig(
    min_replicas=1,
    max_replicas=16,
    starvation_up=0.25,
    throttle_down=0.25,
    hold_s=60.0,
    cooldown_s=300.0,
    max_step_up=4,
    max_step_down=4,
)
INITIAL = FleetState()
FAST = settings(max_examples=150, deadline=None)


def decide(current, s, g, f, now_s, state=INITIAL, policy=POLICY):
    return desired_replicas(current, s, g, f, now_s=now_s, state=state, policy=policy)


def run(inputs, policy, start=INITIAL):
    """Feed (current, s, g, f, now_s) tuples in order; the answers and the last state."""
    answers, state = [], start
    for current, s, g, f, now_s in inputs:
        desired, state = decide(current, s, g, f, now_s, state, policy)
        answers.append(desired)
    return answers, state


# ----- strategies ---------------------------------------------------------------------------


@st.composite
def policies(draw) -> FleetConfig:
    low = draw(st.integers(1, 6))
    return FleetConfig(
        min_replicas=low,
        max_replicas=draw(st.integers(low, 24)),
        starvation_up=draw(st.sampled_from([0.05, 0.25, 0.5, 1.0, 2.0])),
        throttle_down=draw(st.sampled_from([0.05, 0.25, 0.5, 0.75])),
        hold_s=draw(st.sampled_from([0.0, 5.0, 60.0])),
        cooldown_s=draw(st.sampled_from([0.0, 30.0, 300.0])),
        max_step_up=draw(st.integers(1, 8)),
        max_step_down=draw(st.integers(1, 8)),
    )


currents = st.integers(0, 40)
starvations = st.floats(0.0, 20.0, allow_nan=False)
throttles = st.floats(0.0, 1.0, allow_nan=False)
free = st.integers(-8, 64)
gaps = st.floats(0.0, 400.0, allow_nan=False)


@st.composite
def states(draw, now_s: float) -> FleetState:
    """Any state a run of calls up to `now_s` can leave."""
    if draw(st.booleans()):
        return FleetState()

    def earlier():
        return draw(st.one_of(st.none(), st.floats(now_s - 1000.0, now_s, allow_nan=False)))

    return FleetState(
        desired=draw(st.integers(1, 30)),
        starved_since_s=earlier(),
        throttled_since_s=earlier(),
        changed_at_s=earlier(),
        observed_at_s=now_s - draw(st.floats(0.0, 100.0, allow_nan=False)),
    )


@st.composite
def sequences(draw, max_size: int = 40):
    """1 to `max_size` (current, s, g, f, now_s) tuples at non-decreasing times."""
    now, out = 0.0, []
    for _ in range(draw(st.integers(1, max_size))):
        now += draw(gaps)
        out.append((draw(currents), draw(starvations), draw(throttles), draw(free), now))
    return out


# ----- properties ---------------------------------------------------------------------------


@FAST
@given(policies(), sequences())
def test_every_answer_lies_within_the_bounds(policy, inputs) -> None:
    answers, _ = run(inputs, policy)
    assert all(policy.min_replicas <= a <= policy.max_replicas for a in answers)


@FAST
@given(st.data(), policies(), currents, starvations, starvations, throttles, free)
def test_more_starvation_never_asks_for_fewer(data, policy, current, s1, s2, g, f) -> None:
    state = data.draw(states(now_s=1000.0))
    low, high = sorted((s1, s2))
    assert (
        decide(current, low, g, f, 1000.0, state, policy)[0]
        <= decide(current, high, g, f, 1000.0, state, policy)[0]
    )


@FAST
@given(st.data(), policies(), currents, starvations, throttles, throttles, free)
def test_more_throttle_never_asks_for_more(data, policy, current, s, g1, g2, f) -> None:
    state = data.draw(states(now_s=1000.0))
    low, high = sorted((g1, g2))
    assert (
        decide(current, s, high, f, 1000.0, state, policy)[0]
        <= decide(current, s, low, f, 1000.0, state, policy)[0]
    )


@FAST
@given(
    policies(),
    currents,
    st.lists(st.integers(1, 6), min_size=1, max_size=20),
    st.floats(0.01, 10.0),
    free,
)
def test_a_signal_flipping_faster_than_the_hold_never_changes_the_answer(
    policy, current, runs, over, f
) -> None:
    """Starvation (or throttle) alternates between runs above its threshold, each shorter
    than the hold, and one observation below it: the answer stays what it is without
    any signal, the current count within the bounds."""
    assume(policy.hold_s > 0)
    dt = policy.hold_s / 7  # a run of at most 6 observations spans less than the hold
    above_s, above_g = policy.starvation_up + over, min(1.0, policy.throttle_down + over / 10)
    for flipping in ("starvation", "throttle"):
        inputs, now = [], 0.0
        for length in runs:
            for above in [True] * length + [False]:
                s = above_s if flipping == "starvation" and above else 0.0
                g = above_g if flipping == "throttle" and above else 0.0
                inputs.append((current, s, g, f, now))
                now += dt
        answers, _ = run(inputs, policy)
        resting = min(max(current, policy.min_replicas), policy.max_replicas)
        assert answers == [resting] * len(answers), flipping


@FAST
@given(
    policies(), currents, starvations, throttles, free, st.floats(0.5, 500.0), st.integers(2, 30)
)
def test_constant_inputs_change_the_answer_at_most_once(
    policy, current, s, g, f, dt, calls
) -> None:
    """No oscillation in a steady state: the same measurements at every call give one
    answer, or one change and then that answer for good."""
    answers, _ = run([(current, s, g, f, i * dt) for i in range(calls)], policy)
    changes = sum(a != b for a, b in pairwise(answers))
    assert changes <= 1


@FAST
@given(policies(), st.floats(1.0, 40.0), st.integers(0, 30))
def test_a_fleet_that_follows_the_answer_settles_inside_the_dead_band(
    policy, capacity, start
) -> None:
    """A closed loop: the learner consumes what `capacity` workers make; with n workers it
    waits s = capacity / n - 1 per step second, or they are blocked g = 1 - capacity / n of
    their time. The fleet takes each answer before the next observation. When some
    allowed count has both signals at their thresholds or below, the answers move one way
    only and settle on such a count."""
    s_up, g_down = policy.starvation_up, policy.throttle_down
    band = [
        n
        for n in range(policy.min_replicas, policy.max_replicas + 1)
        if capacity / n - 1 <= s_up and 1 - capacity / n <= g_down
    ]
    assume(band)
    dt = max(policy.hold_s, policy.cooldown_s) + 1.0
    state, n, answers = FleetState(), start, []
    for i in range(80):
        s = max(0.0, capacity / n - 1) if n else 20.0
        g = max(0.0, 1 - capacity / n) if n else 0.0
        n, state = decide(n, s, g, 1000, i * dt, state, policy)
        answers.append(n)
    steps = [b - a for a, b in pairwise(answers)]
    assert all(d >= 0 for d in steps) or all(d <= 0 for d in steps), answers
    assert answers[-1] in band and answers[-10:] == [answers[-1]] * 10


@FAST
@given(policies(), sequences(max_size=60))
def test_changes_are_a_cooldown_apart_and_follow_a_held_signal(policy, inputs) -> None:
    """Every increase follows starvation above its threshold for the hold (every
    decrease, throttle), and two changes are at least the cooldown apart."""
    answers, _ = run(inputs, policy)
    changed_at = []
    for i in range(1, len(inputs)):
        if answers[i] == answers[i - 1]:
            continue
        changed_at.append(inputs[i][4])
        signal, threshold = (
            (1, policy.starvation_up) if answers[i] > answers[i - 1] else (2, policy.throttle_down)
        )
        first = i  # the first observation of the streak above the threshold
        while first > 0 and inputs[first - 1][signal] > threshold:
            first -= 1
        assert inputs[i][signal] > threshold
        assert inputs[i][4] - inputs[first][4] >= policy.hold_s
    assert all(b - a >= policy.cooldown_s for a, b in pairwise(changed_at))


@FAST
@given(st.data(), policies(), currents, starvations, throttles, free)
def test_the_same_inputs_give_the_same_answer(data, policy, current, s, g, f) -> None:
    state = data.draw(states(now_s=500.0))
    assert decide(current, s, g, f, 500.0, state, policy) == decide(
        current, s, g, f, 500.0, state, policy
    )


# ----- hand-computed ------------------------------------------------------------------------


def test_starvation_held_for_the_hold_scales_up_by_the_missing_throughput() -> None:
    """4 workers, the learner waits 1.5 s per step second: 4 x 2.5 / 1.25 = 8 workers
    bring the wait down to 0.25; the step is 4 (= max_step_up)."""
    desired, state = decide(4, 1.5, 0.0, 10, now_s=0.0)
    assert desired == 4 and state.starved_since_s == 0.0 and state.changed_at_s is None
    desired, state = decide(4, 1.5, 0.0, 10, now_s=59.0, state=state)
    assert desired == 4  # held 59 s of 60
    desired, state = decide(4, 1.5, 0.0, 10, now_s=60.0, state=state)
    assert desired == 8 and state.changed_at_s == 60.0
    # The new workers are still loading: the target stands through the cooldown.
    desired, state = decide(4, 1.5, 0.0, 10, now_s=359.0, state=state)
    assert desired == 8
    # They joined; the wait is 0.5 now: 8 x 0.25 / 1.25 = 1.6 -> 2 more.
    desired, state = decide(8, 0.5, 0.0, 10, now_s=360.0, state=state)
    assert desired == 10 and state.changed_at_s == 360.0


def test_the_up_step_is_capped_by_max_step_up_and_the_free_slots() -> None:
    start = FleetState(desired=10, starved_since_s=0.0, observed_at_s=0.0)
    # 10 x (3 - 0.25) / 1.25 = 22, capped at 4 by max_step_up, at 2 by the free slots.
    assert decide(10, 3.0, 0.0, 50, 100.0, start)[0] == 14
    assert decide(10, 3.0, 0.0, 2, 100.0, start)[0] == 12
    # No free slot: more workers could not admit a group, so none are asked for.
    assert decide(10, 3.0, 0.0, 0, 100.0, start)[0] == 10
    assert decide(10, 3.0, 0.0, -3, 100.0, start)[0] == 10


def test_throttle_held_scales_down_to_what_the_learner_consumes() -> None:
    """6 workers blocked 55% of their time: 6 x 0.45 / 0.75 = 3.6 workers keep the
    learner fed with 25% slack, so 6 x 0.3 / 0.75 = 2.4 -> 3 go (max_step_down 4)."""
    start = FleetState(desired=6, throttled_since_s=0.0, observed_at_s=0.0)
    assert decide(6, 0.0, 0.55, 0, 60.0, start)[0] == 3
    one_at_a_time = POLICY.model_copy(update={"max_step_down": 1})
    assert decide(6, 0.0, 0.55, 0, 60.0, start, one_at_a_time)[0] == 5
    # 5 x 0.3 / 0.75 is 2 plus a rounding error: 2 go, not 3.
    assert decide(5, 0.0, 0.55, 0, 60.0, start)[0] == 3


def test_up_and_down_count_from_the_workers_present_and_keep_the_target() -> None:
    """Asked for 8, 4 came: starvation adds to the 4 present but never lowers the
    target (4 + 2 < 8); throttle removes from the 4 present."""
    start = FleetState(desired=8, starved_since_s=0.0, throttled_since_s=None, observed_at_s=0.0)
    desired, state = decide(4, 0.75, 0.0, 10, 500.0, start)
    assert desired == 8 and state.changed_at_s is None
    throttled = FleetState(desired=8, throttled_since_s=0.0, observed_at_s=0.0)
    assert decide(4, 0.0, 0.55, 10, 500.0, throttled)[0] == 2  # 4 - ceil(1.6)


def test_both_signals_held_keep_the_answer() -> None:
    start = FleetState(desired=5, starved_since_s=0.0, throttled_since_s=0.0, observed_at_s=0.0)
    assert decide(5, 2.0, 0.9, 10, 100.0, start)[0] == 5


def test_the_answer_is_clamped_to_the_bounds() -> None:
    narrow = POLICY.model_copy(update={"min_replicas": 2, "max_replicas": 5})
    assert decide(0, 0.0, 0.0, 10, 0.0, policy=narrow)[0] == 2  # no worker yet: the minimum
    assert decide(9, 0.0, 0.0, 10, 0.0, policy=narrow)[0] == 5
    start = FleetState(desired=4, starved_since_s=0.0, observed_at_s=0.0)
    assert decide(4, 1.5, 0.0, 10, 60.0, start, narrow)[0] == 5  # 4 + 4, capped at 5
    down = FleetState(desired=2, throttled_since_s=0.0, observed_at_s=0.0)
    assert decide(2, 0.0, 1.0, 0, 60.0, down, narrow)[0] == 2  # never below min


@pytest.mark.parametrize(
    ("field", "args", "message"),
    [
        ("current", (-1, 0.0, 0.0, 0), "current must be an integer >= 0"),
        ("current", (2.5, 0.0, 0.0, 0), "current must be an integer >= 0"),
        ("starvation", (1, -0.1, 0.0, 0), "starvation must be a finite number >= 0"),
        ("starvation", (1, float("inf"), 0.0, 0), "starvation must be a finite number >= 0"),
        ("throttle", (1, 0.0, 1.5, 0), r"throttle must be a fraction in \[0, 1\]"),
        ("throttle", (1, 0.0, float("nan"), 0), r"throttle must be a fraction in \[0, 1\]"),
        ("free_slots", (1, 0.0, 0.0, 1.5), "free_slots must be an integer"),
    ],
)
def test_bad_input_names_the_field_and_range(field, args, message) -> None:
    with pytest.raises(ValueError, match=message):
        decide(*args, now_s=0.0)


def test_time_must_not_go_back_and_the_state_must_be_a_fleet_state() -> None:
    _, state = decide(2, 0.0, 0.0, 1, now_s=10.0)
    with pytest.raises(ValueError, match=r"now_s must be >= the state's observed_at_s \(10.0\)"):
        decide(2, 0.0, 0.0, 1, 9.0, state)
    with pytest.raises(ValueError, match="now_s must be a finite number"):
        decide(2, 0.0, 0.0, 1, float("nan"))
    with pytest.raises(ValueError, match="state must be a FleetState"):
        decide(2, 0.0, 0.0, 1, 0.0, {"desired": 2})


def test_the_fleet_section_checks_its_bounds() -> None:
    with pytest.raises(ValueError, match=r"fleet.max_replicas must be >= fleet.min_replicas \(4\)"):
        FleetConfig(min_replicas=4, max_replicas=3)
    with pytest.raises(ValueError, match="throttle_down"):
        FleetConfig(throttle_down=1.0)
    with pytest.raises(ValueError, match="min_replicas"):
        RunConfig(fleet={"min_replicas": 0})
    assert RunConfig().fleet == FleetConfig()
