"""The one error interceptor of `scalerl.rpc.server.make_server`: every handler shape
(unary, server streaming, client streaming) maps domain errors to their status and anything
else to INTERNAL, and a handler's own `context.abort` keeps its status."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from scalerl.rpc import errors
from scalerl.rpc.channel import channel
from scalerl.rpc.server import make_server
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


class Raising(rollout_pb2_grpc.RolloutServiceServicer):
    """Raises the exception `self.exc` from every handler (after one chunk, for Generate)."""

    exc: BaseException | None = None

    def GetStatus(self, request, context):  # noqa: N802 (gRPC method names)
        if self.exc is None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler's own abort")
        raise self.exc

    def Generate(self, request, context) -> Iterator[rollout_pb2.GenerateResponse]:  # noqa: N802
        yield rollout_pb2.GenerateResponse(request_id="r1", token_ids=[7])
        raise self.exc

    def UpdateWeights(self, request_iterator, context):  # noqa: N802
        for _ in request_iterator:
            pass
        raise self.exc


@pytest.fixture(scope="module")
def served():
    servicer = Raising()
    server, port, _ = make_server(
        [(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, servicer, SERVICE)]
    )
    ch = channel(f"127.0.0.1:{port}")
    yield servicer, rollout_pb2_grpc.RolloutServiceStub(ch)
    ch.close()
    server.stop(None)


CASES = [
    (
        errors.InvalidArgument("sampling.top_p", "must be in (0, 1], got 2"),
        "INVALID_ARGUMENT",
        "sampling.top_p: must be in (0, 1], got 2",
    ),
    (errors.NotFound("run 'x' is not known"), "NOT_FOUND", "run 'x' is not known"),
    (errors.AlreadyExists("request id r1 is running"), "ALREADY_EXISTS", "request id r1"),
    (errors.FailedPrecondition("no fit yet"), "FAILED_PRECONDITION", "no fit yet"),
    (errors.ResourceExhausted("1000 runs"), "RESOURCE_EXHAUSTED", "1000 runs"),
    (errors.Unavailable("engine stopping"), "UNAVAILABLE", "engine stopping"),
    (errors.DataLoss("sha256 mismatch"), "DATA_LOSS", "sha256 mismatch"),
    (errors.Unauthenticated("token"), "UNAUTHENTICATED", "token"),
    # A bug is never retryable: builtin exceptions are INTERNAL, whatever their type.
    (RuntimeError("boom"), "INTERNAL", "GetStatus failed: RuntimeError"),
    (ValueError("bad"), "INTERNAL", "GetStatus failed: ValueError"),
    (KeyError("k"), "INTERNAL", "GetStatus failed: KeyError"),
]


@pytest.mark.parametrize(("exc", "code", "detail"), CASES)
def test_unary_handler(served, exc, code, detail) -> None:
    servicer, stub = served
    servicer.exc = exc
    with pytest.raises(grpc.RpcError) as info:
        stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode[code]
    assert info.value.details().startswith(detail)


def test_handlers_own_abort_keeps_its_status(served) -> None:
    servicer, stub = served
    servicer.exc = None
    with pytest.raises(grpc.RpcError) as info:
        stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == "handler's own abort"


@pytest.mark.parametrize(
    ("exc", "code"), [(RuntimeError("boom"), "INTERNAL"), (errors.Unavailable("x"), "UNAVAILABLE")]
)
def test_server_streaming_handler_fails_after_its_first_chunk(served, exc, code) -> None:
    servicer, stub = served
    servicer.exc = exc
    stream = stub.Generate(rollout_pb2.GenerateRequest(request_id="r1"), timeout=10)
    assert list(next(stream).token_ids) == [7]
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() == grpc.StatusCode[code]


@pytest.mark.parametrize(
    ("exc", "code"), [(errors.DataLoss("size"), "DATA_LOSS"), (RuntimeError("x"), "INTERNAL")]
)
def test_client_streaming_handler(served, exc, code) -> None:
    servicer, stub = served
    servicer.exc = exc
    with pytest.raises(grpc.RpcError) as info:
        stub.UpdateWeights(iter([rollout_pb2.UpdateWeightsRequest()]), timeout=10)
    assert info.value.code() == grpc.StatusCode[code]


def test_invalid_argument_is_a_value_error_naming_its_field() -> None:
    exc = errors.InvalidArgument("points[3].reward", "must be in [0, 1]")
    assert isinstance(exc, ValueError)
    assert (exc.field, exc.message) == ("points[3].reward", "must be in [0, 1]")
    assert str(errors.NotFound("run 'x'")) == "run 'x'"
