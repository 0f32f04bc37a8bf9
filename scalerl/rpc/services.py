"""scalerl's gRPC services, each once: its full name, its client stub and how a
servicer is added to a server; and the one `serve` that starts any of them.

A process serves one service (`serve`); a client reaches one through
`scalerl.rpc.clients` or, for a call no client method covers yet, `Service.stub`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health

from scalerl.rpc.security import Security
from scalerl.rpc.server import make_server
from scalerl.v1 import (
    curve_pb2,
    curve_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    sandbox_pb2,
    sandbox_pb2_grpc,
)


@dataclass(frozen=True)
class Service:
    """One service of the `scalerl.v1` package: `name` is its full name (the health and
    reflection name, "scalerl.v1.CurveService"), `stub` makes a client stub of a channel
    and `add_to_server` registers a servicer on a server."""

    name: str
    stub: Callable[[grpc.Channel], Any]
    add_to_server: Callable[[Any, grpc.Server], None]


def _service(module: Any, grpc_module: Any, short: str) -> Service:
    return Service(
        name=module.DESCRIPTOR.services_by_name[short].full_name,
        stub=getattr(grpc_module, f"{short}Stub"),
        add_to_server=getattr(grpc_module, f"add_{short}Servicer_to_server"),
    )


CURVE = _service(curve_pb2, curve_pb2_grpc, "CurveService")
LEARNER = _service(learner_pb2, learner_pb2_grpc, "LearnerService")
ROLLOUT = _service(rollout_pb2, rollout_pb2_grpc, "RolloutService")
SANDBOX = _service(sandbox_pb2, sandbox_pb2_grpc, "SandboxService")
REWARD = _service(reward_pb2, reward_pb2_grpc, "RewardService")
TEACHER = _service(rollout_pb2, rollout_pb2_grpc, "TeacherService")


def serve(
    service: Service,
    servicer: Any,
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int = 16,
    security: Security | None = None,
    advertise_host: str | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Start a server of `service` backed by `servicer` on host:port (0 = a free port),
    with health (the service and "" SERVING) and reflection, behind the one error
    interceptor, the token check of the privileged methods and the RPC cap
    (`scalerl.rpc.server.make_server`). max_workers: the server's thread pool (an open
    stream holds a thread). security: token and TLS (default: the process's).
    advertise_host: the host clients dial (default: `host`), which a rollout worker proves.

    Returns (server, bound port, health servicer). Raises RuntimeError when the port
    cannot be bound."""
    registration = (service.add_to_server, servicer, service.name)
    return make_server(
        [registration],
        port=port,
        host=host,
        max_workers=max_workers,
        security=security,
        advertise_host=advertise_host,
    )
