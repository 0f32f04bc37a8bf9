"""The version labels a resumed learner must start above, read from a real Redis: the
announced version, the latest weights and the newest group in the replay stream."""

from __future__ import annotations

import redis

from learner_service.checkpoint.resume import redis_labels, resumed_version
from scalerl.state.replay import ReplayStream
from scalerl.state.run_state import RunState
from scalerl.v1 import rollout_pb2
from scalerl.weights.board import WeightsRef


def _group(version: int) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(
        group_id=f"g{version}", min_policy_version=version - 1, max_policy_version=version
    )


def test_labels_of_a_crashed_run(redis_client: redis.Redis, run_id: str) -> None:
    state = RunState(redis_client, run_id)
    replay = ReplayStream(redis_client, run_id, capacity=8)
    assert redis_labels(state, replay) == [None, None]  # a fresh run
    state.versions.announce(12)
    state.versions.publish(WeightsRef(11, "", "0" * 64, 10))
    for version in (9, 13, 10):
        replay.push(_group(version))
    assert redis_labels(state, replay) == [12, 13]
    assert resumed_version(10, redis_labels(state, replay)) == 14


def test_prepare_resume_clears_the_stop_flag_and_a_missing_payload(
    redis_url: str, tmp_path
) -> None:
    """A finished run left its stop flag and a publication whose file the launcher
    removed: a resume clears both (before, its workers stopped at once or failed loading
    the missing file), and keeps the announced version as a label."""
    from scalerl.state.client import connect
    from scalerl_cli.launcher import prepare_resume

    state = RunState(connect(redis_url), "resume-prep")
    state.versions.announce(10)
    state.versions.publish(WeightsRef(10, str(tmp_path / "gone.safetensors"), "0" * 64, 9))
    state.request_stop()
    prepare_resume(redis_url, "resume-prep")
    assert not state.stop_requested()
    assert state.versions.published() is None
    assert state.versions.highest_label() == 10
    kept = tmp_path / "there.safetensors"
    kept.write_bytes(b"x")
    state.versions.publish(WeightsRef(11, str(kept), "0" * 64, 1))
    prepare_resume(redis_url, "resume-prep")
    assert state.versions.published().version == 11
    # `pull`: the bytes were in the previous learner's memory, gone with it.
    state.versions.publish(WeightsRef(12, "", "0" * 64, 1, source="grpc://127.0.0.1:5"))
    prepare_resume(redis_url, "resume-prep")
    assert state.versions.published() is None
    assert state.versions.highest_label() == 10
