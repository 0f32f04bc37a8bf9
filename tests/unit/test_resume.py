"""Resume rules: versions only go up, lost versions are recognised, and the `scalerl run`
command refuses to start a new run on top of an old one."""

from __future__ import annotations

import pytest
from test_run_folder import STEP  # a complete StepRecord's fields

from learner_service.checkpoint.resume import one_timeline, record_label, resumed_version
from scalerl.run_folder import ResumeRecord, StepRecord, append_record, read_records
from scalerl.staleness import from_lost_versions
from scalerl_cli.main import main


def test_a_fresh_run_keeps_its_version() -> None:
    assert resumed_version(0, [None, None]) == 0


def test_the_resumed_version_is_above_every_label_in_redis() -> None:
    """Checkpoint at v10; the crashed learner announced v12, its workers left groups of
    v13 in the stream: the resumed learner continues at v14 (before, it reused v11..v13
    for different weights and admitted the v13 groups with negative staleness)."""
    assert resumed_version(10, [12, 13]) == 14
    assert resumed_version(10, [10, None]) == 11  # a finished run: a new number anyway
    assert resumed_version(10, [3, None]) == 10  # labels below: nothing to skip


def test_a_step_recorded_before_its_version_was_announced_counts_as_a_label(tmp_path) -> None:
    """A kill between a step's record (v8) and its announcement (Redis says v7): the
    resumed learner still takes a new number, v9, found by the run folder's records
    (the LoRA resume system test met this)."""
    assert record_label(tmp_path) is None
    for step in (7, 8):
        append_record(tmp_path, StepRecord(**(STEP | {"step": step, "policy_version": step})))
    assert record_label(tmp_path) == 8
    assert resumed_version(4, [7, None, record_label(tmp_path)]) == 9


def test_the_discarded_steps_time_still_counts_against_the_budget(tmp_path) -> None:
    """Checkpoint at step 5 saved at t=1000 s; the crashed learner recorded steps 6 and 7
    at 1030 s and 1042.5 s: the resume discards them and their 42.5 s, not the downtime
    until the restart, join the run's learner time (max_minutes)."""
    for step, at in ((5, 999.0), (6, 1030.0), (7, 1042.5)):
        append_record(tmp_path, StepRecord(**(STEP | {"step": step, "time": at})))
    record = one_timeline(tmp_path, 5, 5, 8, 0, 0, False, saved_at=1000.0)
    assert record.steps_discarded == 2 and record.seconds_discarded == 42.5
    assert read_records(tmp_path, ResumeRecord)[0].seconds_discarded == 42.5
    again = one_timeline(tmp_path, 5, 5, 9, 0, 0, False, saved_at=1000.0)
    assert again.seconds_discarded == 0.0  # nothing after the checkpoint any more
    unknown = one_timeline(tmp_path, -1, 0, 10, 0, 0, False)  # no checkpoint: no time known
    assert unknown.steps_discarded == 1 and unknown.seconds_discarded == 0.0


def test_groups_of_the_lost_versions_are_recognised() -> None:
    lost = (10, 14)  # v11..v13 were published after the checkpoint at v10
    assert from_lost_versions(11, 11, lost)
    assert from_lost_versions(9, 12, lost)
    assert from_lost_versions(13, 14, lost)
    assert not from_lost_versions(9, 10, lost)  # the checkpoint's own lineage
    assert not from_lost_versions(14, 15, lost)  # the resumed learner's
    assert not from_lost_versions(3, 5, (0, 0))  # a fresh run loses nothing


def test_run_on_a_non_empty_folder_names_resume(tmp_path, capsys) -> None:
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert main(["run", "--config", "tiny", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--resume {tmp_path}" in err[0]


@pytest.mark.parametrize(
    "extra, message",
    [([], "no config.yaml"), (["--config", "tiny"], "change fields with --set")],
)
def test_resume_needs_a_run_folder_and_its_own_config(tmp_path, capsys, extra, message) -> None:
    if extra:
        (tmp_path / "config.yaml").write_text("run_id: tiny\n")
    assert main(["run", "--resume", str(tmp_path), *extra]) == 2
    assert message in capsys.readouterr().err
