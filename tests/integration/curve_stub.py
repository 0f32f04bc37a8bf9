"""`fit_request`: a FitRequest of points, for the curve RPC tests."""

from __future__ import annotations

from scalerl.v1 import curve_pb2


def fit_request(compute, reward, stderr=(), **kw) -> curve_pb2.FitRequest:
    """FitRequest of points (compute [N], reward [N], optional stderr [N]: each reward's
    standard error, empty = unknown) and any other FitRequest field."""
    stderr = list(stderr) or [0.0] * len(compute)
    points = [
        curve_pb2.CurvePoint(compute=c, reward=r, stderr=s)
        for c, r, s in zip(compute, reward, stderr, strict=True)
    ]
    return curve_pb2.FitRequest(points=points, **kw)
