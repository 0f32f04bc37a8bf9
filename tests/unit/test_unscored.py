"""An infrastructure failure is never a reward: a sandbox that cannot run a program is
retried with back-off within `retry_s`, then the verdict is unscored (reward NaN, failure
"unavailable", counted apart), which the evaluation refuses to average and `scalerl task
score` reports with exit 1. Only a program the service refuses for itself (too large)
scores 0."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from scalerl.config import AdditionsTaskConfig
from scalerl.obs.verifier_metrics import register_verifier_metrics
from scalerl.rpc.clients.base import RpcFailed
from scalerl.rpc.errors import InvalidArgument, ResourceExhausted, Unavailable
from scalerl.sandbox.client import SandboxClient
from scalerl.sandbox.runner import CaseOutcome, SandboxRun
from scalerl.tasks import TaskSet, build_task
from scalerl.verifiers import Verdict, VerifierUnavailable, programs, retries
from scalerl.verifiers.code import CodeVerifier

PROGRAM = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = ["assert add(1, 2) == 3"]


class Clock:
    """time.monotonic and sleep of a runner: sleeping advances the clock."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(retries.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(retries.random, "uniform", lambda low, high: high)  # no jitter
    return clock


@pytest.fixture
def service(clock: Clock, monkeypatch: pytest.MonkeyPatch):
    """make(answers): a `code` verifier on a service whose Execute answers `answers` in
    turn (an exception is raised, a SandboxRun returned; the last one repeats), and the
    programs it was sent."""

    def make(answers: list) -> tuple[CodeVerifier, list[str]]:
        verifier = CodeVerifier(service="sandbox:50054", retry_s=1.0)
        verifier.runner.sleep = clock.sleep
        calls: list[str] = []

        def execute(self, code, kind, cases, wall_s):
            answer = answers[min(len(calls), len(answers) - 1)]
            calls.append(code)
            if isinstance(answer, Exception):
                raise answer
            return answer

        monkeypatch.setattr(SandboxClient, "execute", execute)
        return verifier, calls

    return make


PASSED = SandboxRun(outcomes={0: CaseOutcome(0, "3", "", "")})


def test_a_busy_sandbox_is_retried_with_back_off_until_it_runs(clock: Clock, service) -> None:
    busy = ResourceExhausted("2 programs running and 8 waiting: try again")
    verifier, calls = service([busy, Unavailable("restarting"), busy, PASSED])
    verdict = verifier.score(PROGRAM, TESTS)
    assert (verdict.reward, verdict.failure) == (1.0, "")
    assert clock.slept == pytest.approx([0.1, 0.2, 0.4])
    assert len(calls) == 4


def test_past_its_retry_deadline_the_verdict_is_unscored_never_zero(clock: Clock, service) -> None:
    """Back-offs 0.1 + 0.2 + 0.4 = 0.7 s fit in 1 s; the next (0.8 s) would not: 4 tries."""
    verifier, _ = service([RpcFailed("DEADLINE_EXCEEDED", "Deadline Exceeded")])
    verdict = verifier.score(PROGRAM, TESTS)
    assert math.isnan(verdict.reward) and verdict.unscored
    assert (verdict.failure, verdict.parse_failed) == ("unavailable", False)
    assert "did not run the program within 1 s (4 tries): DEADLINE_EXCEEDED" in verdict.detail
    assert clock.slept == pytest.approx([0.1, 0.2, 0.4])
    assert verifier.stats.snapshot() == {
        "calls": 1,
        "errors": 0,
        "timeouts": 0,
        "unavailable": 1,
        "parse_failures": 0,
    }
    assert verdict.as_dict()["reward"] is None
    with pytest.raises(VerifierUnavailable, match="4 tries"):
        verdict.scored()


@pytest.mark.parametrize(
    "answer",
    [InvalidArgument("wall_s", "must be in (0, 10] seconds"), RpcFailed("INTERNAL", "bug")],
)
def test_a_refusal_that_no_retry_fixes_is_unscored_at_once(
    clock: Clock, service, answer: Exception
) -> None:
    """A wall time above the service's limit (a config mismatch) or an INTERNAL answer is
    not the program's doing: unscored after one try, not a 0 for every sample."""
    verifier, calls = service([answer])
    verdict = verifier.score(PROGRAM, TESTS)
    assert verdict.unscored and len(calls) == 1
    assert clock.slept == []


def test_a_program_refused_for_itself_scores_zero(service) -> None:
    verifier, _ = service([InvalidArgument("code", "at most 1048576 bytes")])
    verdict = verifier.score(PROGRAM, TESTS)
    assert (verdict.reward, verdict.failure) == (0.0, "error") and not verdict.unscored


def test_a_sandbox_that_fails_to_start_here_is_retried(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process's own sandbox: a start failure (RuntimeError, OSError such as
    EAGAIN) is never the program's; retried, then unscored."""
    tries = []

    def run_program(code, kind, cases, limits):
        tries.append(code)
        if len(tries) == 1:
            raise OSError(11, "Resource temporarily unavailable")
        raise RuntimeError("the sandbox did not start (killed by signal 9)")

    runner = programs.ProgramRunner(service="sandbox:1", retry_s=0.5)
    runner.service, runner.sleep = "", clock.sleep
    monkeypatch.setattr(programs, "run_program", run_program)
    with pytest.raises(VerifierUnavailable, match=r"within 0.5 s \(3 tries\): the sandbox did"):
        runner.run("pass", "stdio", [""])
    assert len(tries) == 3
    monkeypatch.setattr(programs, "run_program", lambda *args: PASSED)
    assert runner.run("pass", "stdio", [""]) is PASSED


def test_retry_s_is_bounded() -> None:
    with pytest.raises(ValueError, match=r"retry_s must be in \[0, 3600\] seconds, got -1"):
        programs.ProgramRunner(service="sandbox:1", retry_s=-1)


def test_unscored_checks_have_their_own_metric_outcome() -> None:
    tasks = TaskSet([build_task(AdditionsTaskConfig(name="a", large_max=9, heldout_size=5))])
    task = tasks["a"]

    def down(completion, answer):
        raise VerifierUnavailable("the sandbox service at sandbox:50054 did not answer")

    task.verifier.check = down
    verdict = task.score(task.train_ids[0], "3")
    assert verdict.unscored and verdict != Verdict(0.0, False)
    registry = CollectorRegistry()
    register_verifier_metrics(registry, tasks)
    text = generate_latest(registry).decode()
    labels = 'outcome="unavailable",task="a",verifier="last_integer"'
    assert f"scalerl_verifier_failures_total{{{labels}}} 1.0" in text
    assert 'outcome="error",task="a",verifier="last_integer"} 0.0' in text
