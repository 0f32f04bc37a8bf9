"""The sandbox service (`scalerl-sandbox`): the `code` verifier scores every case the same
through it as in its own process (forgeries included), a bad request is INVALID_ARGUMENT
naming the field and runs nothing, a request beyond its concurrency is RESOURCE_EXHAUSTED,
and it refuses to start where it cannot contain programs."""

from __future__ import annotations

import threading

import pytest
from verifier_cases import CODE, FORGERIES

from sandbox_service import main as sandbox_main
from sandbox_service.server import SandboxServicer, serve
from scalerl.rpc.clients.sandbox import SandboxClient
from scalerl.rpc.errors import InvalidArgument, ResourceExhausted
from scalerl.rpc.security import Security
from scalerl.verifiers.code import CodeVerifier
from scalerl.verifiers.sandbox import Containment, SandboxLimits

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


def test_beyond_its_concurrency_it_answers_resource_exhausted(service) -> None:
    _, address = service
    sleeper = "import time\ntime.sleep(2)\n"
    outcomes: list[str] = []

    def run() -> None:
        with SandboxClient(address) as client:
            try:
                client.execute(sleeper, "stdio", [""], 2.5)
                outcomes.append("ran")
            except ResourceExhausted:
                outcomes.append("refused")

    threads = [threading.Thread(target=run) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["ran"] * 2 + ["refused"] * 4


def test_it_refuses_to_start_uncontained(monkeypatch, capsys) -> None:
    import scalerl.verifiers.sandbox as sandbox

    refused = Containment(("namespaces: unshare refused (Operation not permitted)",))
    monkeypatch.setattr(sandbox, "containment", lambda limits: refused)
    assert sandbox_main.main(["--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "scalerl-sandbox: this machine cannot contain programs (namespaces: unshare refused "
        "(Operation not permitted)); --allow-uncontained runs them uncontained"
    )
