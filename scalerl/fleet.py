"""How many rollout workers the learner needs: the autoscaling rule (docs/architecture.md,
"How many workers").

A pure, deterministic function of the learner's measurements and an explicit state (the
time is passed in, never read), exported by the learner as the gauge
`scalerl_rollout_desired_replicas` for an autoscaler to follow (KEDA prometheus trigger,
threshold 1). Inputs, each over the learner's recent window (`fleet.window_s`; measured by
`learner_service.fleet_signals`):

- learner starvation s = batch-wait seconds / step seconds (verl `trainer/idle_ratio`,
  prime-rl `wait_for_batch`): from the step records' `batch_wait_seconds` and
  `step_seconds`;
- generator throttle g = fraction of worker time blocked by the k bound, i.e. producers
  waiting in `ReplayStream.push` on a full stream (PipelineRL's budget exhausted, prime-rl
  `wait_for_policy`, verl `rollouter/idle_ratio`): from the workers' push-blocked seconds
  (`scalerl.state.push_blocked`) over workers x window seconds;
- free admission slots f = capacity - (queued + in flight): the replay capacity less
  the stream's depth and the groups the workers are generating.

The rule, with n the current worker count and D the last answer (the target asked for):

- scale up when s > `starvation_up` has held for `hold_s` seconds and f > 0: to
  max(D, n + step), step = ceil(n (s - s_up) / (1 + s_up)) at most `max_step_up` and f.
  With generation throughput proportional to n, n (1 + s) / (1 + s_up) workers bring s down
  to the threshold: the step is that difference;
- scale down when g > `throttle_down` has held for `hold_s` seconds: to min(D, n - step),
  step = ceil(n (g - g_down) / (1 - g_down)) at most `max_step_down`. The learner consumes
  what n (1 - g) unblocked workers make, so n (1 - g) / (1 - g_down) workers leave the
  threshold's slack; more generators only raise staleness, never throughput;
- keep D otherwise: both signals held at once (contradictory), or within `cooldown_s` of
  the last change (at least the model-load time: joiners must be serving before the
  signals say anything about them).

Every answer is clamped to [min_replicas, max_replicas]. Hysteresis: separate thresholds
per signal, a hold that resets as soon as the signal falls back, and the cooldown; so a
signal flipping faster than the hold never changes the answer, and constant inputs change
it at most once. Keeping D (not n) while workers are still joining keeps an autoscaler
that follows the gauge from undoing its own scale-up; taking the step from n (not D) keeps
a fleet that cannot grow (no capacity in the cluster) from asking for ever more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

from scalerl.config import FleetConfig

_ROUNDING = 1e-9  # products like 5 x 0.3 / 0.75 land a rounding error above an integer


@dataclass(frozen=True)
class FleetState:
    """What `desired_replicas` remembers between calls (times in the caller's clock,
    seconds). The initial state is `FleetState()`.

    desired: the last answer (None before the first call); starved_since_s /
    throttled_since_s: when the starvation / throttle went above its threshold and has
    stayed there (None: not above now); changed_at_s: when the answer last changed (None:
    never); observed_at_s: the time of the last call (None: no call yet).
    """

    desired: int | None = None
    starved_since_s: float | None = None
    throttled_since_s: float | None = None
    changed_at_s: float | None = None
    observed_at_s: float | None = None


def desired_replicas(
    current: int,
    starvation: float,
    throttle: float,
    free_slots: int,
    *,
    now_s: float,
    state: FleetState,
    policy: FleetConfig,
) -> tuple[int, FleetState]:
    """The number of rollout workers to run, and the state for the next call (the rule of
    the module docstring).

    current: workers registered now (>= 0); starvation: learner batch-wait seconds per
    step second over the window (finite, >= 0); throttle: fraction of worker time blocked
    on the full replay stream ([0, 1]); free_slots: free admission slots, groups (an
    integer; <= 0 when the stream and the workers' in-flight groups fill the capacity);
    now_s: the time of this observation, seconds, not before `state.observed_at_s`;
    state: from the previous call (`FleetState()` first); policy: thresholds, hold,
    cooldown and bounds.

    Returns (desired, new_state), desired in [policy.min_replicas, policy.max_replicas].
    Raises ValueError naming the field and its allowed range for an input outside it (the
    state is then unchanged: it is never modified in place).
    """
    _check_inputs(current, starvation, throttle, free_slots, now_s, state)
    starved_since = _since(starvation > policy.starvation_up, state.starved_since_s, now_s)
    throttled_since = _since(throttle > policy.throttle_down, state.throttled_since_s, now_s)
    previous = _clamp(current if state.desired is None else state.desired, policy)
    starved = _held(starved_since, now_s, policy.hold_s) and free_slots > 0
    throttled = _held(throttled_since, now_s, policy.hold_s)
    cooling = state.changed_at_s is not None and now_s - state.changed_at_s < policy.cooldown_s
    desired = previous
    if not cooling and starved and not throttled:
        desired = max(previous, current + _step_up(current, starvation, free_slots, policy))
    elif not cooling and throttled and not starved:
        desired = min(previous, current - _step_down(current, throttle, policy))
    desired = _clamp(desired, policy)
    changed_at = now_s if desired != previous else state.changed_at_s
    return desired, FleetState(desired, starved_since, throttled_since, changed_at, now_s)


def _step_up(current: int, starvation: float, free_slots: int, policy: FleetConfig) -> int:
    """Workers to add: ceil(n (s - s_up) / (1 + s_up)), in [1, min(max_step_up, f)]."""
    excess = (starvation - policy.starvation_up) / (1 + policy.starvation_up)
    return max(1, min(_ceil(current * excess), policy.max_step_up, free_slots))


def _step_down(current: int, throttle: float, policy: FleetConfig) -> int:
    """Workers to remove: ceil(n (g - g_down) / (1 - g_down)), in [1, max_step_down]."""
    excess = (throttle - policy.throttle_down) / (1 - policy.throttle_down)
    return max(1, min(_ceil(current * excess), policy.max_step_down))


def _ceil(value: float) -> int:
    """ceil, with a value a rounding error above an integer taken as that integer."""
    return math.ceil(value - _ROUNDING)


def _since(above: bool, since_s: float | None, now_s: float) -> float | None:
    """When the signal went above its threshold (kept while it stays there), else None."""
    if not above:
        return None
    return now_s if since_s is None else since_s


def _held(since_s: float | None, now_s: float, hold_s: float) -> bool:
    return since_s is not None and now_s - since_s >= hold_s


def _clamp(replicas: int, policy: FleetConfig) -> int:
    return min(max(replicas, policy.min_replicas), policy.max_replicas)


def _check_inputs(
    current: int,
    starvation: float,
    throttle: float,
    free_slots: int,
    now_s: float,
    state: FleetState,
) -> None:
    if not _is_int(current) or current < 0:
        raise ValueError(f"current must be an integer >= 0 (workers), got {current!r}")
    if not _is_real(starvation) or not math.isfinite(starvation) or starvation < 0:
        raise ValueError(f"starvation must be a finite number >= 0, got {starvation!r}")
    if not _is_real(throttle) or not 0 <= throttle <= 1:
        raise ValueError(f"throttle must be a fraction in [0, 1], got {throttle!r}")
    if not _is_int(free_slots):
        raise ValueError(f"free_slots must be an integer (groups), got {free_slots!r}")
    if not _is_real(now_s) or not math.isfinite(now_s):
        raise ValueError(f"now_s must be a finite number of seconds, got {now_s!r}")
    if not isinstance(state, FleetState):
        raise ValueError(f"state must be a FleetState, got {type(state).__name__}")
    if state.observed_at_s is not None and now_s < state.observed_at_s:
        raise ValueError(
            f"now_s must be >= the state's observed_at_s ({state.observed_at_s}), got {now_s}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)
