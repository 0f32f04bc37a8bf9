"""Stability of every fit and the early verdict of CompareRuns over a real in-process
CurveService; the client's, the CLI's, the sweep's and the run report's view of them."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from curve_stub import fit_request
from rich.console import Console

from curve_service.fit import fit_sigmoid
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.verdict import stable_from
from scalerl.rpc.clients.curve import CurveClient, FitSpec
from scalerl.run_folder import EvalRecord, append_record, read_records, run_evals
from scalerl.v1 import curve_pb2
from scalerl_cli import main as cli
from scalerl_cli import sweep
from scalerl_cli.launcher import _fit_verdict
from scalerl_cli.report import fit_first_half

pytestmark = pytest.mark.integration

TIMEOUT_S = 60.0
TRUTH = SigmoidParams(a=0.8, b=1.5, c_mid=100.0, r0=0.1)
COMPUTE = np.geomspace(1.0, 2000.0, 16)
# Run 1 levels off at 0.6 (below run 0's 0.7) up to compute 100, then climbs to 0.85.
FAST = predict(SigmoidParams(0.7, 2.0, 10.0, 0.1), COMPUTE)
SLOW = np.where(
    COMPUTE <= 100.0,
    predict(SigmoidParams(0.6, 2.0, 10.0, 0.1), COMPUTE),
    0.6 + 0.25 * (1.0 - 100.0 / COMPUTE),
)


# --- every fit carries its stability -----------------------------------------------------


def test_fit_reports_stability_at_the_target(stub) -> None:
    compute = np.geomspace(1.0, 2000.0, 12)
    reply = stub.Fit(fit_request(compute, predict(TRUTH, compute), r0=0.1), timeout=TIMEOUT_S)
    s = reply.stability
    assert (s.target_compute, s.verdict, len(s.history)) == (4000.0, "stable", 4)
    assert all(q.compute == 4000.0 for q in s.history)
    assert s.moved < 1e-4 and s.summary.startswith("stable: the prediction at C=4000")
    # With a bootstrap and a target, the check's band is the prediction's band there.
    noisy = predict(TRUTH, compute) + np.random.default_rng(0).normal(0.0, 0.01, 12)
    method = curve_pb2.FitMethod(bootstrap_resamples=50, seed=1)
    request = fit_request(
        compute, noisy, r0=0.1, method=method, predict_compute=[500.0], target_compute=500.0
    )
    reply = stub.Fit(request, timeout=TIMEOUT_S)
    band, first = reply.predictions[0], reply.stability.history[0]
    assert reply.stability.target_compute == 500.0
    assert (first.reward, first.lower, first.upper) == (band.reward, band.lower, band.upper)
    assert reply.stability.band_half_width == pytest.approx((band.upper - band.lower) / 2)


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf")])
def test_a_bad_target_compute_is_invalid_argument(stub, bad: float) -> None:
    good = fit_request(COMPUTE, FAST, r0=0.1)
    with pytest.raises(grpc.RpcError) as err:
        stub.Fit(fit_request(COMPUTE, FAST, r0=0.1, target_compute=bad), timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("target_compute: must be finite and > 0")
    request = curve_pb2.CompareRunsRequest(
        runs=[good, fit_request(COMPUTE, SLOW, r0=0.1, target_compute=bad)]
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.CompareRuns(request, timeout=TIMEOUT_S)
    assert err.value.details().startswith("runs[1].target_compute: must be finite")


def test_recorded_runs_carry_the_stability_of_their_fit(stub) -> None:
    run_id = f"stab-{time.monotonic_ns()}"
    compute = np.geomspace(1.0, 2000.0, 8)
    for c, r in zip(compute, predict(TRUTH, compute), strict=True):
        recorded = stub.RecordPoint(
            curve_pb2.RecordPointRequest(
                run_id=run_id, point=curve_pb2.CurvePoint(compute=c, reward=r), r0=0.1
            ),
            timeout=TIMEOUT_S,
        )
    assert recorded.fit.stability.verdict == "stable"
    assert recorded.fit.stability.target_compute == pytest.approx(4000.0)
    got = stub.GetRun(curve_pb2.GetRunRequest(run_id=run_id), timeout=TIMEOUT_S)
    assert got.fit.stability == recorded.fit.stability
    # Fit of the recorded series (no bootstrap, no target) reports the same check.
    fitted = stub.Fit(curve_pb2.FitRequest(run_id=run_id), timeout=TIMEOUT_S)
    assert fitted.stability == got.fit.stability
    trimmed = stub.TrimRun(
        curve_pb2.TrimRunRequest(run_id=run_id, max_compute=float(compute[4])), timeout=TIMEOUT_S
    )
    # 5 points left: one refit, at 2x the new largest compute.
    assert trimmed.fit.stability.target_compute == pytest.approx(2 * compute[4])
    assert len(trimmed.fit.stability.history) == 2


def test_the_progress_line_shows_the_verdict_of_the_latest_fit(address: str, stub) -> None:
    run_id = f"line-{time.monotonic_ns()}"
    with CurveClient(address, timeout_s=5) as client:
        assert _fit_verdict(client, run_id) == ""  # no such run yet
        for c, r in zip(COMPUTE[:3], FAST[:3], strict=True):
            client.record_point(run_id, float(c), float(r), r0=0.1)
        assert _fit_verdict(client, run_id) == ""  # 3 points: no fit yet
        for c, r in zip(COMPUTE[3:], FAST[3:], strict=True):
            client.record_point(run_id, float(c), float(r))
        assert _fit_verdict(client, run_id) == "fit: stable"


# --- CompareRuns: probabilities and the early verdict ------------------------------------


def test_compare_runs_gives_probabilities_and_when_the_verdict_settled(stub) -> None:
    request = curve_pb2.CompareRunsRequest(
        runs=[fit_request(COMPUTE, FAST, r0=0.1), fit_request(COMPUTE, SLOW, r0=0.1)]
    )
    reply = stub.CompareRuns(request, timeout=TIMEOUT_S)
    assert (reply.best, reply.decided_by) == (1, "A")
    assert reply.runs[1].p_best_a >= 0.99 and reply.runs[0].p_best_a <= 0.01
    assert not reply.runs[0].HasField("p_best_b") and not reply.runs[1].HasField("p_best_b")
    fits = [fit_sigmoid(COMPUTE, r, r0=0.1) for r in (FAST, SLOW)]
    since = stable_from(fits, 1, 0.02)
    assert since is not None and since > 100.0
    assert reply.verdict_stable_from_compute == since
    assert reply.early_verdict.startswith("run 1 has the best asymptote with probability 1.00")
    assert f"held since compute {since:.4g}" in reply.early_verdict
    assert all(r.fit.stability.verdict for r in reply.runs)


def test_compare_runs_within_the_margin_gives_b_probabilities(stub) -> None:
    slow = predict(TRUTH, COMPUTE)
    quick = predict(SigmoidParams(0.81, 2.5, 100.0, 0.1), COMPUTE)
    method = curve_pb2.FitMethod(bootstrap_resamples=40, seed=3)
    request = curve_pb2.CompareRunsRequest(
        runs=[
            fit_request(COMPUTE, slow, r0=0.1, method=method),
            fit_request(COMPUTE, quick, r0=0.1, method=method),
        ]
    )
    reply = stub.CompareRuns(request, timeout=TIMEOUT_S)
    assert (reply.best, reply.decided_by) == (1, "B")
    # Noiseless points: every resample is the fit, so B 2.5 beats 1.5 in every draw.
    assert reply.runs[1].p_best_b == 1.0 and reply.runs[0].p_best_b == 0.0
    assert "(40 joint bootstrap draws)" in reply.early_verdict
    assert reply.runs[1].fit.intervals.resamples == 40


def test_compare_runs_at_a_compute_ranks_the_predicted_rewards_there(stub) -> None:
    runs = [fit_request(COMPUTE, FAST, r0=0.1), fit_request(COMPUTE, SLOW, r0=0.1)]
    reply = stub.CompareRuns(curve_pb2.CompareRunsRequest(runs=runs, at_compute=50.0))
    # By asymptote run 1 (it climbs past 100); at compute 50 run 0 is ahead.
    assert (reply.best, reply.best_at_compute) == (1, 0)
    for run in reply.runs:
        p = run.fit.params
        at_50 = predict(SigmoidParams(p.a, p.b, p.c_mid, p.r0), [50.0])[0]
        assert run.reward_at_compute == pytest.approx(at_50, abs=1e-12)
    assert reply.runs[0].reward_at_compute == pytest.approx(0.6769, abs=1e-3)  # Eq. 1, exact
    assert [r.p_best_at_compute for r in reply.runs] == [1.0, 0.0]
    assert reply.at_compute_stable_from_compute == COMPUTE[3]
    assert reply.at_compute_verdict.startswith("at compute 50, run 0 is predicted the best")
    plain = stub.CompareRuns(curve_pb2.CompareRunsRequest(runs=runs), timeout=TIMEOUT_S)
    assert not plain.HasField("best_at_compute") and plain.at_compute_verdict == ""
    assert not plain.runs[0].HasField("reward_at_compute")


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_compare_runs_refuses_a_bad_compute_naming_at_compute(stub, bad: float) -> None:
    runs = [fit_request(COMPUTE, FAST, r0=0.1), fit_request(COMPUTE, SLOW, r0=0.1)]
    with pytest.raises(grpc.RpcError) as err:
        stub.CompareRuns(curve_pb2.CompareRunsRequest(runs=runs, at_compute=bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("at_compute: must be finite and > 0")


# --- the client, the CLI, the sweep, the run report ----------------------------------------


def test_client_reads_stability_and_the_early_verdict(address: str) -> None:
    with CurveClient(address, timeout_s=TIMEOUT_S) as client:
        fit = client.fit(FitSpec(compute=list(COMPUTE), reward=list(FAST), r0=0.1))
        assert fit.stability is not None and fit.stability.verdict == "stable"
        assert fit.stability.target_compute == 4000.0
        assert fit.to_dict()["stability"]["verdict"] == "stable"
        at = client.fit(
            FitSpec(compute=list(COMPUTE), reward=list(FAST), r0=0.1, target_compute=50.0)
        )
        assert at.stability.target_compute == 50.0
        result = client.compare_runs(
            [
                FitSpec(compute=list(COMPUTE), reward=list(FAST), r0=0.1),
                FitSpec(compute=list(COMPUTE), reward=list(SLOW), r0=0.1),
            ]
        )
    assert result.best == 1 and result.runs[1].p_best_a >= 0.99
    assert result.runs[0].p_best_b is None
    assert result.verdict_stable_from_compute is not None
    assert result.early_verdict.startswith("run 1 has the best asymptote")
    row = result.runs[1].to_dict()
    assert row["p_best_A"] == result.runs[1].p_best_a and row["p_best_B"] is None
    assert result.at_compute is None and row["reward_at_compute"] is None
    with CurveClient(address, timeout_s=TIMEOUT_S) as client:
        specs = [FitSpec(compute=list(COMPUTE), reward=list(r), r0=0.1) for r in (FAST, SLOW)]
        at = client.compare_runs(specs, at_compute=50.0)
    assert at.at_compute is not None
    assert (at.at_compute.compute, at.at_compute.best) == (50.0, 0)
    assert at.at_compute.stable_from_compute == COMPUTE[3]
    assert at.at_compute.line.startswith("at compute 50, run 0 is predicted the best")
    assert at.runs[0].to_dict()["p_best_at_compute"] == 1.0


def _csv(path: Path, compute, reward) -> Path:
    rows = "".join(f"{c},{r}\n" for c, r in zip(compute, reward, strict=True))
    path.write_text("compute,reward\n" + rows)
    return path


def test_cli_compare_prints_the_probabilities_and_the_early_verdict(
    address: str, tmp_path: Path, capsys
) -> None:
    a = _csv(tmp_path / "a.csv", COMPUTE, FAST)
    b = _csv(tmp_path / "b.csv", COMPUTE, SLOW)
    base = ["curve", "compare", str(a), str(b), "--r0", "0.1", "--bootstrap", "0"]
    assert cli.main([*base, "--server", address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"1. {b}: A=") and " P(best A)=1.00 fit " in lines[0]
    assert " P(best A)=0.00 " in lines[1]
    assert lines[-1].startswith("early verdict: run 1 has the best asymptote with probability")
    assert cli.main([*base, "--json", "--server", address]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["early_verdict"].startswith("run 1 has the best asymptote")
    assert out["verdict_stable_from_compute"] > 100.0
    assert out["runs"][1]["p_best_A"] >= 0.99
    assert out["at_compute"] is None
    assert cli.main([*base, "--at-compute", "50", "--server", address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert " R@C=0.6769 P(best@C)=1.00 " in lines[1]  # run 0, ranked 2nd by asymptote
    assert lines[-1].startswith("at the compute asked: at compute 50, run 0 is predicted")
    assert cli.main([*base, "--at-compute", "50", "--json", "--server", address]) == 0
    at = json.loads(capsys.readouterr().out)["at_compute"]
    assert (at["best"], at["compute"], at["stable_from_compute"]) == (str(a), 50.0, COMPUTE[3])
    assert cli.main([*base, "--at-compute", "0", "--server", address]) == 2
    assert capsys.readouterr().err.strip().endswith("--at-compute: must be finite and > 0, got 0.0")


def _write_evals(run_dir: Path, compute, reward) -> None:
    run_dir.mkdir(parents=True)
    for step, (c, r) in enumerate(zip(compute, reward, strict=True)):
        record = EvalRecord(
            step=step,
            policy_version=step,
            compute=float(c),
            pass_rate=float(r),
            parse_failure_rate=0.0,
            completions=400,
            mean_tokens=100.0,
            truncation_rate=0.0,
            seconds=1.0,
            learner_steps_meanwhile=0,
            time=1.0 + step,
        )
        append_record(run_dir, record)


def test_sweep_prints_the_probabilities_and_the_early_verdict(tmp_path: Path, capsys) -> None:
    # Two finished variants, hand-made: the sweep starts its own curve service for them.
    sweep_dir = tmp_path / "sweep"
    variants = [sweep.Variant("loss=cispo", None, [], []), sweep.Variant("loss=dapo", None, [], [])]
    _write_evals(sweep_dir / "loss-cispo", COMPUTE, SLOW)
    _write_evals(sweep_dir / "loss-dapo", COMPUTE, FAST)
    for v in variants:
        v.result["exit_code"] = 0
    summary = sweep.compare(variants, sweep_dir, final_eval=False)  # no checkpoints here
    out = capsys.readouterr().out
    verdict = summary["comparison"]
    assert verdict["best"] == "loss=cispo"
    assert verdict["early_verdict"].startswith("loss=cispo has the best asymptote with proba")
    assert verdict["verdict_stable_from_compute"] > 100.0
    line = next(x for x in out.splitlines() if x.startswith("early verdict: "))
    assert line == f"early verdict: {verdict['early_verdict']}"
    assert summary["variants"][0]["p_best_A"] >= 0.99
    assert "A 1.00" in out and "A 0.00" in out  # the table's P(best) column


def test_report_first_half_check_on_a_run_folder(address: str, tmp_path: Path) -> None:
    # The first half of the evaluations reaches past C_mid: with this noise (seed 1) its
    # band [0.576, 0.655] covers the final evaluation, 0.599. (Over seeds 0..7, 5 of 8 are
    # covered: the residual bootstrap's 90% band is narrow, the report says so per run.)
    compute = np.linspace(0.0, 0.5, 9)
    params = SigmoidParams(0.6, 2.0, 0.05, 0.1)
    rng = np.random.default_rng(1)
    reward = predict(params, np.maximum(compute, 1e-9)) + rng.normal(0.0, 0.01, 9)
    reward[0] = 0.1
    _write_evals(tmp_path / "steady", compute, reward)
    evals = run_evals(read_records(tmp_path / "steady", EvalRecord))
    quiet = Console(file=io.StringIO())
    half, check = fit_first_half(address, evals, quiet)
    assert half is not None and half.points_used == 5
    assert check["final"] == pytest.approx(reward[-1])
    assert check["lower"] <= check["predicted"] <= check["upper"]
    assert check["covered"] is True
    # The same run whose last evaluation jumps to 0.95: the first half could not know.
    jumped = reward.copy()
    jumped[-1] = 0.95
    _write_evals(tmp_path / "jumped", compute, jumped)
    evals = run_evals(read_records(tmp_path / "jumped", EvalRecord))
    _, missed = fit_first_half(address, evals, quiet)
    assert missed["final"] == 0.95 and missed["covered"] is False
    assert missed["upper"] < 0.95


def test_sweep_checks_its_verdict_at_the_compute_spent(tmp_path: Path, capsys) -> None:
    # loss=cispo (SLOW) levels off below loss=dapo (FAST) up to compute 100, then climbs
    # past it: the verdict at the compute spent (2000) names loss=dapo while only the
    # points before the climb are in, then loss=cispo, the variant that ended best.
    sweep_dir = tmp_path / "sweep"
    variants = [sweep.Variant("loss=cispo", None, [], []), sweep.Variant("loss=dapo", None, [], [])]
    _write_evals(sweep_dir / "loss-cispo", COMPUTE, SLOW)
    _write_evals(sweep_dir / "loss-dapo", COMPUTE, FAST)
    scores = {"loss=cispo": sweep.Score(0.84, 0.01, 1), "loss=dapo": sweep.Score(0.70, 0.01, 1)}
    summary = sweep.compare(variants, sweep_dir, final_eval=False, scores=scores)
    verdict = summary["comparison"]
    at = verdict["at_compute"]
    assert (at["compute"], at["best"], at["p_best"]) == (2000.0, "loss=cispo", 1.0)
    assert at["line"].startswith("at compute 2000, loss=cispo is predicted the best reward")
    history = verdict["history"]
    named = [h["best_at_compute"] for h in history]
    # The first two cuts (4 and 5 points) are too close to call; then loss=dapo, sure.
    assert named[:3] == [None, None, "loss=dapo"] and named[-1] == "loss=cispo"
    first = max(i for i, name in enumerate(named) if name != "loss=cispo") + 1
    final = verdict["final"]
    assert final["best"] == "loss=cispo" and final["right_at_compute"] is True
    assert final["settled_share_at_compute"] == history[first]["share"]
    assert 100.0 / 2000.0 < final["settled_share_at_compute"] < 1.0
    out = capsys.readouterr().out
    assert "best at the compute spent (2000 h): loss=cispo (P(best) 1.00)" in out
    share = final["settled_share_at_compute"]
    assert f"named loss=cispo at the compute spent from {share:.0%} of the compute on" in out
    assert "the curves' verdict at the compute spent was right" in out


def test_sweep_compare_only_reuses_the_final_scores(tmp_path: Path, capsys) -> None:
    sweep_dir = tmp_path / "sweep"
    variants = [sweep.Variant("loss=cispo", None, [], []), sweep.Variant("loss=dapo", None, [], [])]
    _write_evals(sweep_dir / "loss-cispo", COMPUTE, SLOW)
    _write_evals(sweep_dir / "loss-dapo", COMPUTE, FAST)
    rows = [
        {
            "variant": "loss=cispo",
            "exit_code": 0,
            "final_eval": {"mean": 0.84, "stderr": 0.01, "seeds": 1},
        },
        {
            "variant": "loss=dapo",
            "exit_code": 0,
            "final_eval": {"mean": 0.70, "stderr": 0.01, "seeds": 1},
        },
    ]
    (sweep_dir / "sweep.json").write_text(json.dumps({"variants": rows, "comparison": None}))
    # final_eval on: a score sweep.json holds is not taken again (there is no checkpoint).
    assert sweep.compare_again(variants, sweep_dir) == 0
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["final_eval"]["mean"] for r in summary["variants"]] == [0.84, 0.70]
    assert summary["comparison"]["final"]["right_at_compute"] is True
    assert summary["comparison"]["at_compute"]["best"] == "loss=cispo"
    gone = [*variants, sweep.Variant("loss=grpo", None, [], [])]
    assert sweep.compare_again(gone, sweep_dir) == 2
    assert "no run folder" in capsys.readouterr().err
