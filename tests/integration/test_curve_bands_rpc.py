"""The Fit RPC's bands: FitMethod.band and seed_sd, the power law's bands, and latency of
a full uncertainty fit."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
from curve_stub import fit_request

from curve_service.fit import fit_sigmoid
from curve_service.power_law import fit_power_law
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.uncertainty import (
    band_spec,
    bootstrap_params,
    bootstrap_power_law,
    power_law_band,
    prediction_band,
)
from scalerl.v1 import curve_pb2
from scalerl_cli import main as cli

TRUTH = SigmoidParams(a=0.7, b=1.5, c_mid=10.0, r0=0.2)
COMPUTE = np.geomspace(1.0, 60.0, 14)
STDERR = np.full(COMPUTE.size, 0.01)
TARGETS = [30.0, 120.0, 1000.0]


def _reward(seed: int = 0) -> np.ndarray:
    return predict(TRUTH, COMPUTE) + np.random.default_rng(seed).normal(0, 0.01, COMPUTE.size)


def _request(**method) -> curve_pb2.FitRequest:
    return fit_request(
        COMPUTE,
        _reward(),
        stderr=STDERR,
        r0=0.2,
        method=curve_pb2.FitMethod(bootstrap_resamples=200, seed=3, **method),
        predict_compute=TARGETS,
    )


def _bands(reply: curve_pb2.FitResponse) -> np.ndarray:
    return np.array([[p.reward, p.lower, p.upper] for p in reply.predictions])


def test_fit_band_equals_the_core_band(stub) -> None:
    reply = stub.Fit(_request(band="curve", seed_sd=0.015))
    fit = fit_sigmoid(COMPUTE, _reward(), r0=0.2, stderr=STDERR)
    draws = bootstrap_params(fit, 200, seed=3)
    want = prediction_band(fit, draws, TARGETS, spec=band_spec("curve", 0.015))
    np.testing.assert_allclose(_bands(reply), np.stack(want, axis=1), rtol=1e-9)


def test_default_band_is_the_prediction_band_with_the_paper_seed_term(stub) -> None:
    default = _bands(stub.Fit(_request()))
    explicit = _bands(stub.Fit(_request(band="prediction", seed_sd=0.02 / 1.645)))
    np.testing.assert_allclose(default, explicit)
    parameter = _bands(stub.Fit(_request(band="parameter")))
    width = lambda b: b[:, 2] - b[:, 1]  # noqa: E731
    assert np.all(width(default) > width(parameter))
    # seed_sd = 0 is sent (optional field) and differs from unset beyond the data.
    no_seed = _bands(stub.Fit(_request(seed_sd=0.0)))
    assert width(no_seed)[-1] < width(default)[-1]


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ({"band": "wide"}, "method.band: must be one of prediction, curve, parameter; got 'wide'"),
        ({"seed_sd": -0.1}, "method.seed_sd: must be finite in [0, 0.5], got -0.1"),
        ({"seed_sd": float("nan")}, "method.seed_sd: must be finite in [0, 0.5], got nan"),
    ],
)
def test_bad_band_options_are_invalid_argument(stub, method: dict, message: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Fit(_request(**method))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == message


def test_power_law_predictions_carry_their_own_bands(stub) -> None:
    reply = stub.Fit(_request(power_law=True))
    got = np.array([[p.reward, p.lower, p.upper] for p in reply.power_law_predictions])
    fit = fit_sigmoid(COMPUTE, _reward(), r0=0.2, stderr=STDERR)
    law = fit_power_law(fit.compute, fit.reward, fit.weights)
    want = power_law_band(fit, law, bootstrap_power_law(fit, law, 200, 3), TARGETS, band_spec())
    np.testing.assert_allclose(got, np.stack(want, axis=1), rtol=1e-9)
    assert np.all(got[:, 1] < got[:, 0]) and np.all(got[:, 0] < got[:, 2])
    # Without a bootstrap the power law's predictions carry no band.
    plain = stub.Fit(
        fit_request(
            COMPUTE,
            _reward(),
            r0=0.2,
            predict_compute=TARGETS,
            method=curve_pb2.FitMethod(power_law=True),
        )
    )
    assert all(p.lower == p.reward == p.upper for p in plain.power_law_predictions)


def test_stability_is_measured_against_the_requested_band(stub) -> None:
    wide = stub.Fit(_request()).stability
    narrow = stub.Fit(_request(band="parameter")).stability
    assert wide.band_half_width > narrow.band_half_width
    assert wide.moved == pytest.approx(narrow.moved)  # the refits do not depend on the band


def test_cli_band_options_reach_the_fit(tmp_path, capsys) -> None:
    rows = "".join(f"{c},{r},0.01\n" for c, r in zip(COMPUTE, _reward(), strict=True))
    points = tmp_path / "p.csv"
    points.write_text("compute,reward,stderr\n" + rows)
    argv = ["curve", "fit", str(points), "--r0", "0.2", "--predict", "1000", "--json"]
    widths = {}
    for band in ("prediction", "parameter"):
        assert cli.main([*argv, "--band", band, "--seed-sd", "0.02"]) == 0
        q = json.loads(capsys.readouterr().out)["predictions"][0]
        widths[band] = q["upper"] - q["lower"]
    fit = fit_sigmoid(COMPUTE, _reward(), r0=0.2, stderr=STDERR)
    _, lo, hi = prediction_band(
        fit, bootstrap_params(fit, 200, 0), [1000.0], spec=band_spec("parameter", 0.02)
    )
    assert widths["parameter"] == pytest.approx(hi[0] - lo[0], rel=1e-6)
    assert widths["prediction"] > widths["parameter"]
