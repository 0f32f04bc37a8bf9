"""Fixtures of the integration tests: a curve service in the test process (`address`,
`stub`: module scope, an in-memory store) for the curve RPC tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from curve_service.metrics import CurveMetrics
from curve_service.server import CurveServicer, serve
from scalerl.rpc import channel as grpc_channel
from scalerl.v1 import curve_pb2_grpc


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    server, port, _ = serve(port=0, servicer=CurveServicer(metrics=CurveMetrics()))
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def stub(address: str) -> Iterator[curve_pb2_grpc.CurveServiceStub]:
    with grpc_channel.channel(address) as ch:
        yield curve_pb2_grpc.CurveServiceStub(ch)
