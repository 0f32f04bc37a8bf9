"""`fit_request`: a FitRequest of points, for the curve RPC tests."""

from __future__ import annotations

from scalerl.v1 import curve_pb2


def fit_request(compute, reward, **kw) -> curve_pb2.FitRequest:
    """FitRequest of points (compute [N], reward [N]) and any other FitRequest field."""
    points = [
        curve_pb2.CurvePoint(compute=c, reward=r) for c, r in zip(compute, reward, strict=True)
    ]
    return curve_pb2.FitRequest(points=points, **kw)
