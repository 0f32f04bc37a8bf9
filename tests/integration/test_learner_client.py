"""The learner's LearnerService through its typed client: the reported values, and errors
through the one interceptor of `scalerl.rpc.server`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from learner_service import server as learner_server
from learner_service.server import LearnerStatus, serve
from scalerl.ports import free_port
from scalerl.rpc.clients.base import RpcFailed
from scalerl.rpc.clients.learner import LearnerClient, LearnerProgress
from scalerl.rpc.errors import Unavailable

pytestmark = pytest.mark.integration


@pytest.fixture
def status() -> LearnerStatus:
    return LearnerStatus(
        step=7,
        policy_version=6,
        compute_hours=0.5,
        queue_depth=3,
        last_metrics={"truncation_rate": 0.125, "loss": -0.25},
    )


@pytest.fixture
def address(status: LearnerStatus) -> Iterator[str]:
    server, port = serve(status, port=0)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_status_reports_the_learners_values(status: LearnerStatus, address: str) -> None:
    with LearnerClient(address, timeout_s=5) as client:
        before = client.status(wait_for_ready=True)
        status.update(heldout_pass_rate=0.375, step=8)
        after = client.status()
    assert before == LearnerProgress(
        step=7,
        policy_version=6,
        compute_hours=0.5,
        queue_depth=3,
        heldout_pass_rate=None,  # no evaluation yet
        last_metrics={"truncation_rate": 0.125, "loss": -0.25},
    )
    assert (after.step, after.heldout_pass_rate) == (8, 0.375)


def test_an_error_in_get_status_reaches_the_client_as_internal(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(_status: LearnerStatus):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(learner_server, "status_reply", broken)
    with LearnerClient(address, timeout_s=5) as client, pytest.raises(RpcFailed) as err:
        client.status(wait_for_ready=True)
    assert err.value.status == "INTERNAL"  # a status without a domain error
    assert str(err.value) == "GetStatus failed: RuntimeError; see server log"


def test_no_learner_is_unavailable() -> None:
    with LearnerClient(f"127.0.0.1:{free_port()}", timeout_s=5) as client:
        with pytest.raises(Unavailable):  # a domain error, never grpc.RpcError
            client.status()
