"""Lending the learner's idle cores (`scalerl.lending`, `learner.lend_idle: workers`): the
gate's protocol, a real torch engine behind it, the plan's busy threads and the refusals.
Tiny model (conftest.py), fp32, CPU."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch

from rollout_service.engines.api import ABORT, ABORTED, GenerationRequest
from rollout_service.engines.torch.engine import TorchEngine
from scalerl.config import RunConfig
from scalerl.cores import plan_cores, planned_config
from scalerl.lending import (
    GATE_ENV,
    IDLE,
    SLOT_ENV,
    Borrower,
    Lender,
    borrower_from_env,
    check_lendable,
    create_gate,
    lender_from_env,
)

torch.set_num_threads(1)
STEP_S = 0.05  # a simulated decode step


@pytest.fixture
def gate(tmp_path: Path) -> Path:
    return create_gate(tmp_path / "lend_gate", 2)


class FakeLender:
    """A lender's engine loop: steps of STEP_S through the gate, each logged as
    (entered, left) monotonic times."""

    def __init__(self, gate: Path, slot: int) -> None:
        self.borrower = Borrower(gate, slot)
        self.steps: list[tuple[float, float]] = []
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while self.borrower.enter(lambda: self.stopping):
            entered = time.monotonic()
            time.sleep(STEP_S)
            self.steps.append((entered, time.monotonic()))
            self.borrower.leave()

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(5)
        assert not self.thread.is_alive()


def test_a_reclaim_waits_out_the_step_under_way_and_no_step_starts_after_it(gate) -> None:
    lenders = [FakeLender(gate, 0), FakeLender(gate, 1)]
    learner = Lender(gate)
    time.sleep(0.1)
    assert all(not f.steps for f in lenders)  # the gate starts closed
    for _ in range(5):
        learner.lend()
        time.sleep(0.12)
        begun = time.monotonic()
        waited = learner.reclaim()
        returned = time.monotonic()
        time.sleep(0.1)  # nothing may step while the learner computes
        for fake in lenders:
            assert fake.steps, "a lender generated while lent"
            after = [s for s in fake.steps if s[0] >= begun]
            assert after == [], "a lender entered a step after the reclaim"
            assert all(left <= returned for _, left in fake.steps)
        assert waited <= STEP_S + 0.05  # the step under way, not more
    assert learner.stats.reclaims == 5 and learner.stats.overruns == 0
    assert learner.stats.lent_seconds == pytest.approx(5 * 0.12, abs=0.1)
    summary = learner.stats.summary()
    assert summary["lenders"] == 2 and summary["reclaim_max_s"] <= STEP_S + 0.05
    for fake in lenders:
        fake.stop()  # a lender blocked at the closed gate still stops


def test_a_lender_stuck_in_a_step_costs_the_deadline_not_more(gate) -> None:
    borrower = Borrower(gate, 0)
    learner = Lender(gate, deadline_s=0.2)
    learner.lend()
    assert borrower.enter(lambda: False)  # enters and never leaves
    waited = learner.reclaim()
    assert 0.2 <= waited < 0.5 and learner.stats.overruns == 1
    borrower.leave()


def test_a_new_learner_takes_back_a_gate_left_open(gate) -> None:
    Lender(gate).lend()  # a learner that crashed while waiting
    again = Lender(gate)
    assert not again.is_lent and not Borrower(gate, 1).lent


def test_the_environment_wires_both_sides(gate) -> None:
    assert lender_from_env({}) is None and borrower_from_env({}) is None
    assert lender_from_env({GATE_ENV: str(gate)}) is not None
    borrower = borrower_from_env({GATE_ENV: str(gate), SLOT_ENV: "1"})
    assert borrower is not None and not borrower.stepping
    with pytest.raises(ValueError, match="slot must be in"):
        borrower_from_env({GATE_ENV: str(gate), SLOT_ENV: "2"})
    with pytest.raises(ValueError, match="must be an integer"):
        borrower_from_env({GATE_ENV: str(gate), SLOT_ENV: "x"})
    with pytest.raises(ValueError, match="lenders must be >= 1"):
        create_gate(gate, 0)


def test_a_torch_engine_behind_the_gate_stops_within_one_decode_step(gate, model0) -> None:
    """The learner starts a step while its core is lent: after the reclaim returns, the
    engine emits no token until the next lend; the reclaim waited one step at most."""
    learner = Lender(gate)
    engine = TorchEngine(
        copy.deepcopy(model0), (), max_batch=4, max_seq_len=256, gate=Borrower(gate, 0)
    )
    try:
        stream = engine.submit(GenerationRequest("r", (3, 4, 5), max_new_tokens=200, seed=1))
        time.sleep(0.2)
        assert engine.tokens_generated == 0  # the gate starts closed: nothing stepped
        learner.lend()
        while engine.tokens_generated < 20:
            time.sleep(0.005)
        waited = learner.reclaim()
        frozen = engine.tokens_generated
        time.sleep(0.3)
        assert engine.tokens_generated == frozen  # the learner has its core
        # The step under way ended (a few ms for this model), far within the deadline.
        assert learner.stats.overruns == 0 and waited < 0.5
        learner.lend()
        assert stream.finished.wait(30) and len(stream.result().token_ids) == 200
    finally:
        learner.reclaim()
        engine.stop(timeout=5)  # stops though the gate is closed


def test_new_weights_and_aborts_reach_a_lender_whose_gate_is_closed(gate, model0) -> None:
    """The learner waits for its workers to serve a new version (an evaluation does): a
    lender paused at the closed gate applies the update at once, else the learner, not
    lending, would wait for it for nothing."""
    Lender(gate)  # closed
    engine = TorchEngine(
        copy.deepcopy(model0), (), max_batch=4, max_seq_len=64, gate=Borrower(gate, 0)
    )
    try:
        stream = engine.submit(GenerationRequest("r", (3, 4, 5), max_new_tokens=20, seed=1))
        future = engine.stage_weights(copy.deepcopy(model0).state_dict(), 1)
        assert future.result(timeout=10) == 1 and engine.policy_version == 1
        assert engine.tokens_generated == 0  # while nothing was generated
        assert engine.interrupt("r", ABORT)
        assert stream.finished.wait(10) and stream.result().finish_reason == ABORTED
    finally:
        engine.stop(timeout=5)


@pytest.mark.parametrize(("cores", "lenders", "lender_threads"), [(2, 1, 1), (4, 2, 1), (16, 4, 2)])
def test_lending_never_runs_more_busy_threads_than_cores(cores, lenders, lender_threads) -> None:
    plan = plan_cores(tuple(range(cores)), lend=True)
    assert (plan.lenders, plan.lender_threads) == (lenders, lender_threads)
    # Lent: the lenders fill the learner's cores and the learner computes nothing.
    assert plan.busy_threads(lent=True) == cores
    assert plan.lenders * plan.lender_threads == len(plan.learner_cpus)
    # Reclaimed: the learner's threads and the workers', no lender's.
    assert plan.busy_threads(lent=False) == plan_cores(tuple(range(cores))).threads <= cores
    assert not plan.oversubscribed
    assert plan_cores((0,), lend=True).lenders == 0  # one core: nothing to lend


def test_the_config_carries_the_lenders_and_refuses_what_cannot_lend() -> None:
    config, plan = planned_config(RunConfig(learner={"lend_idle": "workers"}), cpus=(0, 1))
    assert (plan.lenders, plan.learner_cpus) == (1, (0,))
    assert planned_config(config.model_copy(), cpus=(0, 1))[1].lenders == 1
    with pytest.raises(ValueError, match="learner.lend_idle: workers needs rollout.engine torch"):
        RunConfig(learner={"lend_idle": "workers"}, rollout={"engine": "vllm"})
    with pytest.raises(ValueError, match="learner.lend_idle: workers lends the cores of a"):
        RunConfig(learner={"lend_idle": "workers", "world_size": 2})
    with pytest.raises(ValueError, match="lend_idle"):
        RunConfig(learner={"lend_idle": "threads"})
    check_lendable("workers", "cpu")
    check_lendable("off", "cuda:0")
    with pytest.raises(ValueError, match="learner.lend_idle: workers lends CPU cores; the"):
        check_lendable("workers", "cuda:0")


def test_a_borrower_marks_idle_between_steps(gate) -> None:
    borrower = Borrower(gate, 0)
    learner = Lender(gate)
    learner.lend()
    assert borrower.enter(lambda: False) and borrower.stepping
    borrower.leave()
    assert not borrower.stepping and learner._gate.read(1) == IDLE
