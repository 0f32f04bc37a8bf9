"""`scalerl_build_info`: one gauge per process saying what it is and what it computes in
(torch-free; every service registers it the same way)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Gauge

import scalerl


def register_build_info(
    service: str, device: str, dtype: str, registry: CollectorRegistry | None = None
) -> Gauge:
    """Export `scalerl_build_info{service, version, device, dtype} 1` on `registry` (the
    process-wide default when None). device: "cpu", "cuda:0", ...; dtype: what the
    service computes in ("bfloat16" or "float32" for the engine and the learner's body,
    as resolved by `scalerl.hardware`; "float64" for the curve fit)."""
    gauge = Gauge(
        "scalerl_build_info",
        "Build of this process and the device and dtype it computes on; always 1.",
        ["service", "version", "device", "dtype"],
        registry=REGISTRY if registry is None else registry,
    )
    gauge.labels(service=service, version=scalerl.__version__, device=device, dtype=dtype).set(1)
    return gauge
