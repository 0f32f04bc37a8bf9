"""One metrics setup for every process: a registry per service that carries
`scalerl_build_info`, and one way to serve it at /metrics (torch-free).

Naming (checked by tests/unit/test_metric_names.py): prefix `scalerl_`, base units in the
name (`_seconds`, `_bytes`), `_total` on counters, histograms for latencies, and no gauge
of a ratio that can be derived from counters (rates are computed by the dashboard).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

import scalerl


def register_build_info(
    service: str, device: str, dtype: str, registry: CollectorRegistry
) -> Gauge:
    """Export `scalerl_build_info{service, version, device, dtype} 1` on `registry`.
    device: "cpu", "cuda:0", ...; dtype: what the service computes in ("bfloat16" or
    "float32" for the engine and the learner's body, as resolved by `scalerl.policy.hardware`;
    "float64" for the curve fit)."""
    gauge = Gauge(
        "scalerl_build_info",
        "Build of this process and the device and dtype it computes on; always 1.",
        ["service", "version", "device", "dtype"],
        registry=registry,
    )
    gauge.labels(service=service, version=scalerl.__version__, device=device, dtype=dtype).set(1)
    return gauge


def service_registry(
    service: str, device: str = "cpu", dtype: str = "float32"
) -> CollectorRegistry:
    """A fresh registry for one service's metrics, with its `scalerl_build_info` already
    on it. Each service (and each test) owns its registry, so none collide in one process."""
    registry = CollectorRegistry()
    register_build_info(service, device, dtype, registry)
    return registry


def serve_metrics(
    registry: CollectorRegistry, port: int, host: str = "127.0.0.1"
) -> tuple[Any, Any]:
    """Serve `registry` over HTTP at /metrics on host:port (0 = a free port).

    Returns (server, bound_port); the caller shuts it down with `server.shutdown()`.
    Raises OSError when the port cannot be bound.
    """
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, int(server.server_port)
