"""The sandbox service (`scalerl-sandbox`): the `code` verifier scores every case the same
through it as in its own process (forgeries included), a bad request is INVALID_ARGUMENT
naming the field and runs nothing, a request beyond its slots waits in a bounded queue
(beyond the queue: RESOURCE_EXHAUSTED, which the verifier retries and, past its deadline,
leaves unscored, never 0), and it refuses to start where it cannot contain programs."""

from __future__ import annotations

import threading

import pytest
from verifier_cases import CODE, FORGERIES

from sandbox_service import main as sandbox_main
from sandbox_service.server import SandboxServicer, serve
from scalerl.rpc.errors import InvalidArgument, ResourceExhausted
from scalerl.rpc.security import Security
from scalerl.sandbox.client import SandboxClient
from scalerl.sandbox.runner import Containment, SandboxLimits
from scalerl.verifiers.code import CodeVerifier

LIMITS = SandboxLimits(cpu_s=1, wall_s=1.5)


@pytest.fixture(scope="module")
def service():
    servicer = SandboxServicer(SandboxLimits(cpu_s=2, wall_s=3.0), concurrency=2)
    server, port = serve(servicer, security=Security())
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_the_verifier_scores_alike_through_the_service(service) -> None:
    servicer, address = service
    remote, local = CodeVerifier(LIMITS, service=address), CodeVerifier(LIMITS)
    before = servicer.executed
    cases = [c for c in CODE if c.id != "reads-a-secret"] + FORGERIES
    for case in cases:
        got = remote.score(case.completion, case.answer)
        assert got.reward == pytest.approx(case.reward), (case.id, got)
        assert got == local.score(case.completion, case.answer) or case.failure, case.id
    ran = [c for c in cases if c.id != "no-program"]
    assert servicer.executed - before == len(ran)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kind": "values", "wall_s": 4.0}, "wall_s"),
        ({"kind": "values", "cases": ["f()"] * 1025}, "cases"),
        ({"kind": "values", "code": "x" * ((1 << 20) + 1)}, "code"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field(service, change: dict, field: str) -> None:
    servicer, address = service
    before = servicer.executed
    request = {"code": "pass", "kind": "values", "cases": ["1"], "wall_s": 1.0, **change}
    with SandboxClient(address) as client, pytest.raises(InvalidArgument) as err:
        client.execute(**request)
    assert err.value.field == field
    assert servicer.executed == before


def _at_once(count: int, work) -> list:
    """`work(i)` on `count` threads started together; their results in order."""
    results: list = [None] * count

    def run(i: int) -> None:
        results[i] = work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


SLOW_ADD = "```python\nimport time\ntime.sleep(0.6)\ndef add(a, b):\n    return a + b\n```"


def test_six_correct_programs_on_two_slots_all_score_one() -> None:
    """The review's demonstration: 6 correct programs against 2 slots gave four 0.0
    rewards. Now the 4 beyond the slots wait in the queue and run: 6 rewards of 1.0."""
    servicer = SandboxServicer(SandboxLimits(cpu_s=2, wall_s=3.0), concurrency=2)
    server, port = serve(servicer, security=Security())
    try:
        verifier = CodeVerifier(LIMITS, service=f"127.0.0.1:{port}")
        verdicts = _at_once(6, lambda i: verifier.score(SLOW_ADD, ["assert add(2, 3) == 5"]))
    finally:
        server.stop(None)
    assert [v.reward for v in verdicts] == [1.0] * 6, verdicts
    assert servicer.executed == 6 and servicer.refused_busy == 0


def test_a_sandbox_busy_past_the_retry_deadline_leaves_samples_unscored() -> None:
    """No queue and a 1 s retry deadline against programs that hold both slots for 2 s:
    the programs that found no slot are unscored (reward NaN), never 0.0; the rest pass."""
    servicer = SandboxServicer(SandboxLimits(cpu_s=3, wall_s=3.0), concurrency=2, queue=0)
    server, port = serve(servicer, security=Security())
    slow = SLOW_ADD.replace("0.6", "2")
    try:
        verifier = CodeVerifier(LIMITS.model_copy(update={"wall_s": 3.0}), retry_s=1.0,
                                service=f"127.0.0.1:{port}")  # fmt: skip
        verdicts = _at_once(6, lambda i: verifier.score(slow, ["assert add(2, 3) == 5"]))
    finally:
        server.stop(None)
    unscored = [v for v in verdicts if v.unscored]
    assert sorted(v.reward for v in verdicts if not v.unscored) == [1.0, 1.0]
    assert len(unscored) == 4 and servicer.refused_busy >= 4
    assert all("did not run the program within 1 s" in v.detail for v in unscored)
    assert verifier.stats.snapshot()["unavailable"] == 4


def test_beyond_its_queue_it_answers_resource_exhausted() -> None:
    """2 slots and 1 place in the queue: of 6 requests at once, 3 run (2, then the one
    that waited) and 3 are refused at once, running nothing."""
    servicer = SandboxServicer(SandboxLimits(cpu_s=2, wall_s=3.0), concurrency=2, queue=1)
    server, port = serve(servicer, security=Security())
    sleeper = "import time\ntime.sleep(1)\n"

    def run(i: int) -> str:
        with SandboxClient(f"127.0.0.1:{port}") as client:
            try:
                client.execute(sleeper, "stdio", [""], 2.5)
                return "ran"
            except ResourceExhausted:
                return "refused"

    try:
        outcomes = _at_once(6, run)
    finally:
        server.stop(None)
    assert sorted(outcomes) == ["ran"] * 3 + ["refused"] * 3
    assert servicer.executed == 3 and servicer.refused_busy == 3


def test_it_refuses_to_start_uncontained(monkeypatch, capsys) -> None:
    import scalerl.sandbox.runner as sandbox

    refused = Containment(("namespaces: unshare refused (Operation not permitted)",))
    monkeypatch.setattr(sandbox, "containment", lambda limits: refused)
    assert sandbox_main.main(["--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "scalerl-sandbox: this machine cannot contain programs (namespaces: unshare refused "
        "(Operation not permitted)); --allow-uncontained runs them uncontained"
    )
