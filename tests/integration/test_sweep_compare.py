"""`scalerl sweep`'s comparison of finished runs (`scalerl_cli.sweep.compare`), on run
folders written here and a curve service it starts: seeds fitted together, the verdict at
every evaluation, and its check against the final scores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from curve_stub import eval_record

from curve_service.sigmoid import SigmoidParams, predict
from scalerl.run_folder import append_record
from scalerl_cli import sweep
from scalerl_cli.sweep_verdict import Score

pytestmark = pytest.mark.integration
COMPUTE = np.linspace(0.0, 0.5, 11)  # accelerator-hours, step 0 first


def write_run(run_dir: Path, params: SigmoidParams, seed: int) -> None:
    run_dir.mkdir(parents=True)
    noise = np.random.default_rng(seed).normal(0, 0.01, COMPUTE.size)
    rewards = predict(params, np.maximum(COMPUTE, 1e-9)) + noise
    for step, (compute, reward) in enumerate(zip(COMPUTE, rewards, strict=True)):
        record = eval_record(step, float(compute), float(np.clip(reward, 0, 1)))
        append_record(run_dir, record)


def test_seeds_are_fitted_together_and_the_verdict_is_checked(tmp_path, monkeypatch) -> None:
    variants = sweep.build_variants(
        "tiny", sweep.parse_vary(["learner.lr=1e-5,3e-5"]), None, [], [], seeds=2
    )
    truths = {
        "lr=1e-5": SigmoidParams(a=0.5, b=2.0, c_mid=0.15, r0=0.1),
        "lr=3e-5": SigmoidParams(a=0.8, b=2.0, c_mid=0.15, r0=0.1),
    }
    for i, variant in enumerate(variants):
        for j, run_dir in enumerate(variant.run_dirs(tmp_path)):
            write_run(run_dir, truths[variant.label], seed=10 * i + j)
    finals = {"lr=1e-5": Score(0.49, 0.01, 2), "lr=3e-5": Score(0.79, 0.01, 2)}
    monkeypatch.setattr(sweep, "_final_score", lambda v, _: finals[v.label])
    summary = sweep.compare(variants, tmp_path)
    rows = {row["variant"]: row for row in summary["variants"]}
    assert rows["lr=3e-5"]["seeds"] == 2 and rows["lr=3e-5"]["rank"] == 1
    assert rows["lr=3e-5"]["A"] == pytest.approx(0.8, abs=0.03)
    assert rows["lr=1e-5"]["A"] == pytest.approx(0.5, abs=0.03)
    assert rows["lr=3e-5"]["final_eval"] == {"mean": 0.79, "stderr": 0.01, "seeds": 2}
    verdict = summary["comparison"]
    assert verdict["best"] == "lr=3e-5" and verdict["p_best"] >= 0.9
    # One verdict per evaluation compute from the 4th on (0.15, both seeds pooled).
    assert [h["share"] for h in verdict["history"]] == pytest.approx(list(COMPUTE[3:] / 0.5))
    final = verdict["final"]
    assert final["best"] == "lr=3e-5" and final["right"] is True
    assert final["gap"] == pytest.approx(0.30)
    assert 0 < final["settled_share"] < 1
    lines = sweep.verdict_lines(verdict)
    assert lines[0].startswith("best: lr=3e-5 (decided by A, P(best) ")
    assert "the curves' verdict was right" in lines


def test_a_close_finish_is_too_close_to_call(tmp_path, monkeypatch) -> None:
    variants = sweep.build_variants("tiny", sweep.parse_vary(["loss=cispo,dapo"]), None, [], [])
    same = SigmoidParams(a=0.4, b=2.0, c_mid=0.15, r0=0.1)
    for i, variant in enumerate(variants):
        write_run(variant.run_dirs(tmp_path)[0], same, seed=i)
    finals = {"loss=cispo": Score(0.394, 0.045, 1), "loss=dapo": Score(0.385, 0.045, 1)}
    monkeypatch.setattr(sweep, "_final_score", lambda v, _: finals[v.label])
    verdict = sweep.compare(variants, tmp_path)["comparison"]
    assert verdict["final"]["best"] is None and verdict["final"]["right"] is None
    assert verdict["final"]["seeds_needed"] == 100
    lines = sweep.verdict_lines(verdict)
    # The same curve twice: at the compute spent too, neither is named.
    assert lines[3].startswith("at the compute spent (0.5 h): too close to call (P(best) 0.")
    assert verdict["at_compute"]["best"] is None and verdict["final"]["right_at_compute"] is None
    assert "final eval: too close to call: the best two ended 0.009 apart" in lines[4]


def test_an_evaluation_that_prints_no_json_is_one_line_and_no_score(
    tmp_path, monkeypatch, capsys
) -> None:
    """`scalerl eval --json` output that is not a result (a library's log on stdout) leaves
    the variant without a final score and says so in one line, never a traceback."""
    import subprocess

    (variant,) = sweep.build_variants("tiny", sweep.parse_vary(["learner.lr=1e-5"]), None, [], [])
    done = subprocess.CompletedProcess([], 0, stdout="INFO engine ready\n{", stderr="")
    monkeypatch.setattr(sweep.subprocess, "run", lambda *a, **k: done)
    assert sweep._final_score(variant, tmp_path) is None
    err = capsys.readouterr().err
    assert "printed no result" in err and "INFO engine ready" in err
