"""The run folder's typed records: metrics.jsonl and eval.jsonl written and read back by
`scalerl.run_folder`, and the launcher's training-health summary over them."""

from __future__ import annotations

import json
import math

import pytest

from scalerl.run_folder import (
    EvalRecord,
    StepRecord,
    append_record,
    evals_by_task,
    keep_records_until,
    read_records,
    run_evals,
)
from scalerl_cli.report import fleet_summary, training_health

STEP = {
    "step": 3,
    "policy_version": 2,
    "time": 1767225600.25,
    "compute": 0.0125,
    "step_seconds": 4.5,
    "batch_wait_seconds": 0.75,
    "publish_seconds": 0.5,
    "publish_block_seconds": 0.125,
    "eval_wait_seconds": 0.0,
    "busy_seconds_by_role": {"learner": 30.0, "rollout": 15.0},
    "queue_depth": 5,
    "staleness_mean": 0.75,
    "staleness_max": 2,
    "staleness_hist": [3, 4, 1],
    "zero_variance_frac": 0.25,
    "groups_stale_total": 1,
    "groups_zero_variance_total": 4,
    "prompts_retired_total": 2,
    "truncation_warnings_total": 1,
    "prompts_eligible": 498,
    "groups_zero_variance": 2,
    "mean_reward": 0.375,
    "truncation_rate": 0.125,
    "interrupted_rate": 0.0625,
    "parse_failure_rate": 0.03125,
    "loss": -0.5,
    "grad_norm": 1.25,
    "tokens": 300,
    "samples": 48,
    "groups_used": 6,
    "ratio_mean": 1.0078125,
    "ratio_max": 1.5,
    "ratio_clipped_frac": 0.01,
    "stepped": True,
    "groups_in_batch": 8,
    "samples_by_finish_reason": {"FINISH_REASON_LENGTH": 8, "FINISH_REASON_STOP": 56},
    "tokens_ratio_clipped": 3,
}
EVAL = {
    "step": 5,
    "policy_version": 5,
    "compute": 0.02,
    "task": "math",
    "stderr": 0.021,
    "pass_rate": 0.4375,
    "parse_failure_rate": 0.0625,
    "completions": 480,
    "mean_tokens": 11.5,
    "truncation_rate": 0.125,
    "seconds": 12.25,
    "learner_steps_meanwhile": 1,
    "time": 1767225700.5,
}


def test_step_and_eval_records_round_trip_exactly(tmp_path) -> None:
    step, later = StepRecord(**STEP), StepRecord(**(STEP | {"step": 4, "grad_norm": math.inf}))
    append_record(tmp_path, step)
    append_record(tmp_path, later)
    append_record(tmp_path, EvalRecord(**EVAL))
    steps = read_records(tmp_path, StepRecord)
    assert steps == [step, later]
    assert steps[0].samples_by_finish_reason == {
        "FINISH_REASON_LENGTH": 8,
        "FINISH_REASON_STOP": 56,
    }
    assert steps[0].tokens == 300 and steps[0].stepped is True
    assert steps[1].grad_norm == math.inf  # a skipped step's non-finite gradient survives
    assert read_records(tmp_path, EvalRecord) == [EvalRecord(**EVAL)]
    # The JSON keys are the field names, so older readers keep working.
    line = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[0])
    assert line == EVAL


def test_reader_keeps_todays_keys_readable_and_ignores_unknown_ones(tmp_path) -> None:
    """A line as the learner wrote it before the typed records (counts as floats, no
    count fields, `stepped` as 1.0) plus a key this version does not know."""
    old = dict(STEP)
    for key in ("groups_in_batch", "samples_by_finish_reason", "tokens_ratio_clipped"):
        del old[key]
    old |= {"tokens": 300.0, "samples": 48.0, "stepped": 1.0, "from_the_future": 7}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(old) + "\n")
    (record,) = read_records(tmp_path, StepRecord)
    assert record.tokens == 300 and record.stepped is True and record.groups_in_batch is None
    assert record.samples_by_finish_reason is None


def test_truncated_last_line_is_skipped_and_cut_before_the_next_append(tmp_path) -> None:
    append_record(tmp_path, EvalRecord(**EVAL))
    with open(tmp_path / "eval.jsonl", "a") as handle:
        handle.write(json.dumps(EVAL | {"step": 10})[:40])  # the crash, mid-line
    assert [r.step for r in read_records(tmp_path, EvalRecord)] == [5]
    append_record(tmp_path, EvalRecord(**(EVAL | {"step": 15})))  # a resumed run
    assert [r.step for r in read_records(tmp_path, EvalRecord)] == [5, 15]
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 2


def test_a_bad_line_before_the_last_one_is_an_error(tmp_path) -> None:
    good = json.dumps(EVAL)
    (tmp_path / "eval.jsonl").write_text(good + "\n{not json\n" + good + "\n")
    with pytest.raises(ValueError, match="eval.jsonl:2"):
        read_records(tmp_path, EvalRecord)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="pass_rate"):
        read_records(tmp_path, EvalRecord)


def test_missing_file_reads_as_no_records(tmp_path) -> None:
    assert read_records(tmp_path, StepRecord) == []


def test_writing_an_unknown_field_is_an_error() -> None:
    with pytest.raises(ValueError, match="loss_typo"):
        StepRecord(**STEP, loss_typo=1.0)


def test_training_health_sums_up_the_step_records() -> None:
    first = StepRecord(**STEP)
    skipped = StepRecord(
        **(
            STEP
            | {
                "step": 4,
                "stepped": False,
                "grad_norm": 0.0,
                "ratio_mean": 0.0,
                "ratio_max": 0.0,
                "ratio_clipped_frac": 0.0,
                "truncation_rate": 0.25,
                "zero_variance_frac": 0.75,
                "parse_failure_rate": 0.0,
                "staleness_hist": [1, 0],
                "groups_stale_total": 3,
                "truncation_warnings_total": 2,
            }
        )
    )
    health = training_health([first, skipped])
    assert health == {
        "steps": 2,
        "truncation_rate_max": 0.25,
        "steps_truncation_above_10pct": 2,
        "staleness_hist": [4, 4, 1],
        "zero_variance_frac_mean": 0.5,
        "groups_stale_total": 3,
        "prompts_retired_total": 2,
        "parse_failure_rate_mean": 0.015625,
        # Ratio and gradient statistics over the steps that updated the weights only.
        "ratio_mean": 1.0078125,
        "ratio_max": 1.5,
        "ratio_clipped_frac_mean": 0.01,
        "grad_norm_mean": 1.25,
        "grad_norm_max": 1.25,
        # Written before the mismatch was recorded: none of it.
        "mismatch_logp_abs_mean": None,
        "mismatch_logp_abs_p99_max": None,
        "mismatch_kl_k3_mean": None,
        "mismatch_masked_frac_mean": None,
        "ratio_histogram": None,
    }
    assert training_health([]) == {}


def test_training_health_sums_up_the_mismatch_of_the_steps_that_recorded_it() -> None:
    def step(n: int, mean: float, p99: float, k3: float, masked: float, hist: list[int]):
        figures = {
            "mismatch_logp_abs_mean": mean,
            "mismatch_logp_abs_p99": p99,
            "mismatch_kl_k3": k3,
            "mismatch_masked_frac": masked,
            "ratio_histogram": hist,
        }
        return StepRecord(**(STEP | {"step": n} | figures))

    older = StepRecord(**(STEP | {"step": 2}))  # recorded before: left out
    health = training_health(
        [
            older,
            step(3, 0.02, 0.10, 0.001, 0.0, [0, 1, 5, 2]),
            step(4, 0.04, 0.30, 0.003, 0.5, [1, 0, 3, 4]),
        ]
    )
    assert health["mismatch_logp_abs_mean"] == pytest.approx(0.03)
    assert health["mismatch_logp_abs_p99_max"] == 0.30
    assert health["mismatch_kl_k3_mean"] == pytest.approx(0.002)
    assert health["mismatch_masked_frac_mean"] == 0.25
    assert health["ratio_histogram"] == [1, 1, 8, 6]


FLEET = {
    "learner_starvation": 0.75,
    "generator_throttle": 0.125,
    "free_admission_slots": 6,
    "desired_replicas": 3,
}


def test_fleet_fields_round_trip_and_read_as_none_from_older_files(tmp_path) -> None:
    append_record(tmp_path, StepRecord(**STEP))  # as written before the fleet fields
    append_record(tmp_path, StepRecord(**(STEP | FLEET | {"step": 4})))
    old, new = read_records(tmp_path, StepRecord)
    assert (old.desired_replicas, old.learner_starvation, old.free_admission_slots) == (
        None,
        None,
        None,
    )
    assert {key: getattr(new, key) for key in FLEET} == FLEET


def test_fleet_summary_takes_the_records_that_carry_an_answer() -> None:
    steps = [
        StepRecord(**STEP),
        StepRecord(**(STEP | FLEET | {"step": 4, "desired_replicas": 5})),
        StepRecord(**(STEP | FLEET | {"step": 5, "learner_starvation": 0.25})),
    ]
    assert fleet_summary(steps) == {
        "desired_replicas_last": 3,
        "desired_replicas_max": 5,
        "learner_starvation_mean": 0.5,
        "generator_throttle_mean": 0.125,
    }
    assert fleet_summary(steps[:1]) == {}
    assert fleet_summary([]) == {}


def test_keep_records_until_cuts_the_crashed_runs_tail(tmp_path) -> None:
    """A resume from the checkpoint at step 4: the records of steps 5 and 6 the crashed
    run wrote are dropped, so the resumed run's step 5 follows step 4 in one timeline."""
    for step in range(3, 7):
        append_record(tmp_path, StepRecord(**(STEP | {"step": step})))
    dropped = keep_records_until(tmp_path, StepRecord, 4)
    assert [r.step for r in dropped] == [5, 6]
    assert [r.step for r in read_records(tmp_path, StepRecord)] == [3, 4]
    append_record(tmp_path, StepRecord(**(STEP | {"step": 5})))
    assert [r.step for r in read_records(tmp_path, StepRecord)] == [3, 4, 5]
    assert keep_records_until(tmp_path, StepRecord, 9) == []
    assert keep_records_until(tmp_path, EvalRecord, 0) == []  # no file: nothing to cut


def test_an_evaluation_of_several_tasks_reads_back_as_the_run_and_each_task(tmp_path) -> None:
    """eval.jsonl holds a record per task and the run's (task ""); lines written before
    runs had several tasks have no task and are the run's."""
    for step, rates in ((0, (0.2, 0.4, 0.3)), (5, (0.5, 0.7, 0.6))):
        for task, rate in zip(("math", "code", ""), rates, strict=True):
            fields = EVAL | {"step": step, "task": task, "pass_rate": rate}
            append_record(tmp_path, EvalRecord(**fields))
    old = {k: v for k, v in EVAL.items() if k != "task"} | {"step": 10, "pass_rate": 0.65}
    with open(tmp_path / "eval.jsonl", "a") as handle:
        handle.write(json.dumps(old) + "\n")
    records = read_records(tmp_path, EvalRecord)
    assert [(r.step, r.pass_rate) for r in run_evals(records)] == [(0, 0.3), (5, 0.6), (10, 0.65)]
    by_task = evals_by_task(records)
    assert list(by_task) == ["math", "code"]
    assert [r.pass_rate for r in by_task["code"]] == [0.4, 0.7]
