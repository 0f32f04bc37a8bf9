"""A group with a sample whose verifier could not run is never trained on with a made-up
reward: its worker hands it straight to the dead-letter stream (reason
verifier_unavailable), counted once in the replay ledger, and gives its generation ticket
back; the learner's step record and progress line show the run's count."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from rollout_service.actor import ActorLoop, _GroupInFlight
from scalerl.config import AdditionsTaskConfig
from scalerl.state import replay as replay_module
from scalerl.state.client import RedisClient
from scalerl.state.once import OpId
from scalerl.state.replay import VERIFIER_UNAVAILABLE, ReplayStream
from scalerl.state.worker_stats import WorkerStats
from scalerl.tasks import TaskSet, build_task
from scalerl.v1 import rollout_pb2
from scalerl.verifiers import Verdict, VerifierPool, VerifierUnavailable
from scalerl_cli.launcher import _progress_line


class _Done:
    def __init__(self, text: str) -> None:
        self.token_ids, self.forced = [ord(c) for c in text], []
        self.logprobs, self.versions, self.finish_reason = [0.0] * len(text), [3] * len(text), 1
        self.routed_experts = None


class _Stream:
    def __init__(self, text: str) -> None:
        self.finished = threading.Event()
        self.finished.set()
        self._done = _Done(text)

    def result(self):
        return self._done


def _actor(redis_client: RedisClient, run_id: str, task=None) -> tuple[ActorLoop, list]:
    """An actor of one task: `task`, or additions whose verifier is down for "down"."""
    if task is None:
        task = build_task(AdditionsTaskConfig(name="add", large_max=9, heldout_size=5))

        def check(completion, answer):
            if completion == "down":
                raise VerifierUnavailable("the sandbox service at sandbox:50054 did not run it")
            return Verdict(1.0 if completion == str(answer) else 0.0, False)

        task.verifier.check = check
    tasks = TaskSet([task])
    given_back: list = []
    actor = object.__new__(ActorLoop)
    actor.tasks, actor.worker_id = tasks, "w-1"
    actor.tokenizer = SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)))
    actor.scorers = {"add": VerifierPool(task.verifier, threads=2)}
    actor.replay = ReplayStream(redis_client, run_id, capacity=4)
    actor.producer = SimpleNamespace(give_back=given_back.extend)
    actor.groups_pushed = actor.groups_unscored = 0
    return actor, given_back


def test_a_group_with_an_unscored_sample_is_dead_lettered_not_pushed(
    redis_client: RedisClient, run_id: str
) -> None:
    actor, given_back = _actor(redis_client, run_id)
    task = actor.tasks["add"]
    problem = task.problem(task.train_ids[0])
    streams = [_Stream(str(problem.answer)), _Stream("down")]
    group = _GroupInFlight(problem.prompt_id, [1, 2], streams, 3)
    actor._scored([group])
    for future in group.verdicts:
        future.result(timeout=10)
    actor._finish_group(group, should_stop=lambda: False)
    assert (actor.groups_pushed, actor.groups_unscored, given_back) == (0, 1, [3])
    assert actor.replay.depth() == 0  # nothing the learner could read
    assert actor.replay.accounting() == {
        "pushed": 1,
        f"dead_letter:{VERIFIER_UNAVAILABLE}": 1,
        "queued": 0,
        "unaccounted": 0,
    }
    [letter] = actor.replay.dead_letters()
    assert letter["reason"] == VERIFIER_UNAVAILABLE
    assert letter["detail"].startswith("1/2 samples unscored: the sandbox service at")
    assert WorkerStats(redis_client, run_id).by_worker()["w-1"]["groups_pushed"] == 1
    actor.scorers["add"].close()


def test_a_retried_dead_letter_push_lands_once(
    redis_client: RedisClient, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py repeating the script after a lost reply: the same op id answers the first
    call's id and counts nothing again."""
    stream = ReplayStream(redis_client, run_id, capacity=4)
    monkeypatch.setattr(replay_module, "new_op_id", lambda: OpId("writer-1", 7))
    group = rollout_pb2.RolloutGroup(prompt_id="add/1", worker_id="w-1")
    first = stream.push_dead_letter(group, VERIFIER_UNAVAILABLE, "down")
    assert stream.push_dead_letter(group, VERIFIER_UNAVAILABLE, "down") == first
    ledger = stream.accounting()
    assert (ledger["pushed"], ledger[f"dead_letter:{VERIFIER_UNAVAILABLE}"]) == (1, 1)
    assert len(stream.dead_letters()) == 1
    with pytest.raises(ValueError, match="reason must be a non-empty label"):
        stream.push_dead_letter(group, "", "down")


def test_the_progress_line_shows_the_unscored_groups() -> None:
    status = SimpleNamespace(
        step=4, policy_version=4, heldout_pass_rate=0.5, queue_depth=2, compute_hours=0.01,
        last_metrics={"groups_unscored_total": 3.0},
    )  # fmt: skip
    client = SimpleNamespace(status=lambda wait_for_ready: status)
    assert "unscored groups 3" in _progress_line(client, 10.0)
    status.last_metrics = {"groups_unscored_total": 0.0}
    assert "unscored" not in _progress_line(client, 10.0)


@pytest.mark.parametrize("verifier", ["judge", "reward_model"])
def test_a_dead_judge_or_reward_service_dead_letters_each_group_within_its_deadline(
    redis_client: RedisClient, run_id: str, verifier: str
) -> None:
    """A `judge` or `reward_model` verifier with nothing listening at its address: every
    group ends as one dead letter naming the service, within retry_s, and none is lost or
    pushed."""
    import time

    from scalerl.config import JudgeVerifierConfig, RewardModelVerifierConfig, VerifierConfig
    from scalerl.ports import free_port

    port = free_port()
    if verifier == "judge":
        url = f"http://127.0.0.1:{port}/v1"
        settings = VerifierConfig(judge=JudgeVerifierConfig(url=url, model="m", retry_s=1.0))
        named = f"the judge at {url} did not answer"
    else:
        address = f"127.0.0.1:{port}"
        service = RewardModelVerifierConfig(service=address, retry_s=1.0, timeout_s=0.5)
        settings = VerifierConfig(reward_model=service)
        named = f"the reward service at {address} did not score it"
    config = AdditionsTaskConfig(name="add", large_max=9, heldout_size=5, verifier=verifier)
    actor, given_back = _actor(redis_client, run_id, build_task(config, settings=settings))
    task = actor.tasks["add"]
    began = time.monotonic()
    groups = []
    for i, prompt_id in enumerate(task.train_ids[:3]):
        streams = [_Stream("5"), _Stream("6"), _Stream("5")]
        groups.append(_GroupInFlight(prompt_id, [1, 2], streams, i))
    actor._scored(groups)
    for group in groups:
        actor._finish_group(group, should_stop=lambda: False)
    # At most 9 distinct checks on 2 threads, each given up after retry_s = 1 s.
    assert time.monotonic() - began < 5 * 1.0 + 5.0
    assert (actor.groups_pushed, actor.groups_unscored, given_back) == (0, 3, [0, 1, 2])
    assert actor.replay.accounting() == {
        "pushed": 3,
        f"dead_letter:{VERIFIER_UNAVAILABLE}": 3,
        "queued": 0,
        "unaccounted": 0,
    }
    details = [letter["detail"] for letter in actor.replay.dead_letters()]
    assert all(d.startswith(f"3/3 samples unscored: {named}") for d in details), details
    actor.scorers["add"].close()
