"""Weight delivery's two switches and the worker's follower, on fakes: which sender and
follower each `learner.weights.transport` builds, the READY rule at the boundary of k,
and when a missed version is loaded (push transports: on the second check; pull ones:
at once)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_sink import FakeSink

from scalerl.config import load_config
from scalerl.weights.board import WeightsRef
from scalerl.weights.broadcast_send import epoch_backend
from scalerl.weights.follower import WeightFollower, make_follower
from scalerl.weights.senders import (
    BroadcastSender,
    PullSender,
    StreamSender,
    UriSender,
    make_sender,
)
from scalerl.weights.store import WeightStore

SHA = "0" * 64


class _Board:
    """What the follower reads of Redis: the announced version and the latest weights."""

    def __init__(self, version: int = 0, latest: WeightsRef | None = None) -> None:
        self.version, self.latest = version, latest

    def announced(self) -> int:
        return self.version

    def published(self) -> WeightsRef | None:
        return self.latest

    def base(self) -> WeightsRef | None:
        return None  # no LoRA base (tests/integration/test_lora.py has one)


def _follower(board: _Board, engine: FakeSink, pulls: bool = False) -> WeightFollower:
    follower = WeightFollower(engine, board, None, pulls=pulls, k=2, period_s=1.0)
    loads: list[int] = []

    def load() -> bool:  # the transfer itself is the transports' tests' business
        ref = follower.newer()
        if ref is None:
            return False
        loads.append(ref.version)
        engine.policy_version = ref.version
        follower._loaded = True
        return True

    follower.load_if_behind = load  # type: ignore[method-assign]
    follower.loads = loads  # type: ignore[attr-defined]
    return follower


def test_the_ready_rule_holds_within_k_of_the_learner_and_never_on_start_up_weights() -> None:
    board, engine = _Board(version=0), FakeSink(version=0)
    follower = _follower(board, engine)
    assert not follower.may_serve()  # version 0 of the start-up weights is no run version
    board.latest = WeightsRef(7, "/w/policy-v7.safetensors", SHA, 10)
    board.version = 9
    assert follower.load_if_behind() and follower.serves_run_weights
    assert follower.may_serve()  # 9 - 7 = 2 = k
    board.version = 10
    assert not follower.may_serve()  # 3 behind
    pushed = _follower(_Board(version=3), FakeSink(version=0))
    pushed.engine.policy_version = 3  # a push swapped the weights: the version moved
    assert pushed.may_serve()


def test_a_missed_push_is_loaded_on_the_second_check_a_pull_at_once() -> None:
    ref = WeightsRef(4, "/w/policy-v4.safetensors", SHA, 10)
    push = _follower(_Board(4, ref), FakeSink(version=3))
    push._loaded = True
    assert push.check(behind_before=False)  # behind: the push may still be on its way
    assert push.loads == []
    assert not push.check(behind_before=True)  # still behind: load it
    assert push.loads == [4] and push.engine.policy_version == 4
    assert not push.check(behind_before=False)  # up to date: nothing more

    pulled = WeightsRef(4, "", SHA, 10, source="grpc://learner:1")
    pull = _follower(_Board(4, pulled), FakeSink(version=3), pulls=True)
    pull._loaded = True
    assert not pull.check(behind_before=False)
    assert pull.loads == [4]


def test_a_version_without_a_file_or_source_is_never_loaded() -> None:
    """A streamed version has neither: the learner's catch-up pushes it."""
    follower = _follower(_Board(4, WeightsRef(4, "", SHA, 10)), FakeSink(version=0))
    assert follower.newer() is None and not follower.load_if_behind()


def _config(transport: str, *more: str):
    return load_config("tiny", [f"learner.weights.transport={transport}", *more])


@pytest.mark.parametrize(
    ("transport", "sender", "pulls"),
    [
        ("uri", UriSender, False),
        ("stream", StreamSender, False),
        ("pull", PullSender, True),
        ("broadcast", BroadcastSender, True),
    ],
)
def test_each_transport_builds_its_sender_and_follower(
    tmp_path: Path, transport: str, sender: type, pulls: bool
) -> None:
    config = _config(transport)
    built = make_sender(
        config, None, tmp_path / "w", WeightStore(), "grpc://127.0.0.1:1", ("h", "h")
    )
    assert type(built) is sender
    follower = make_follower(config, FakeSink(), _Board())
    assert follower.pulls is pulls
    assert (follower.broadcast is not None) is (transport == "broadcast")
    heartbeat = config.rollout.heartbeat_s
    assert follower.period_s == (min(0.5, heartbeat) if pulls else heartbeat)  # POLL_S: 0.5


def test_the_uri_sender_names_a_file_for_every_version_stream_only_when_forced(
    tmp_path: Path,
) -> None:
    uri, stream = UriSender(None, tmp_path, 1.0), StreamSender(None, tmp_path, 1.0)
    assert uri.payload_file(3, force_file=False) == tmp_path.resolve() / "policy-v3.safetensors"
    assert stream.payload_file(3, force_file=False) is None
    assert stream.payload_file(0, force_file=True) == tmp_path.resolve() / "policy-v0.safetensors"
    assert PullSender(WeightStore(), "grpc://l:1").payload_file(0, force_file=True) is None


def test_the_broadcast_variant_carries_its_own_fields_and_others_refuse_them() -> None:
    weights = _config("broadcast", "learner.weights.port=29501").learner.weights
    assert (weights.port, weights.backend, weights.timeout_s) == (29501, "auto", 60.0)
    with pytest.raises(ValueError, match=r"learner\.weights\.pull\.port"):
        _config("pull", "learner.weights.port=29501")
    with pytest.raises(ValueError, match="'uri', 'stream', 'pull', 'broadcast'"):
        _config("carrier")
    with pytest.raises(ValueError, match="needs a FetchWeights source"):
        PullSender(WeightStore(), "")


@pytest.mark.parametrize(
    ("setting", "learner", "members", "backend"),
    [
        ("auto", "GPU-0", ["GPU-1", "GPU-2"], "nccl"),  # a GPU each: NCCL
        ("auto", "GPU-0", ["GPU-0", "GPU-1"], "gloo"),  # learner and a worker on one GPU
        ("auto", "GPU-0", ["GPU-1", "GPU-1"], "gloo"),  # two workers on one GPU
        ("auto", "GPU-0", ["GPU-1", ""], "gloo"),  # a worker on the CPU
        ("auto", "", ["GPU-1"], "gloo"),  # the learner on the CPU
        ("auto", "GPU-0", [], "nccl"),  # nobody else yet
        ("gloo", "GPU-0", ["GPU-1"], "gloo"),  # explicit settings win
        ("nccl", "GPU-0", ["GPU-0"], "nccl"),
    ],
)
def test_epoch_backend_wants_a_gpu_of_its_own_for_every_member(setting, learner, members, backend):
    assert epoch_backend(setting, learner, members) == backend


def test_epoch_backend_names_the_bad_setting():
    with pytest.raises(ValueError, match="backend must be one of"):
        epoch_backend("mpi", "", [])
