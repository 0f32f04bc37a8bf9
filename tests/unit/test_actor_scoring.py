"""The actor scores finished groups on the verifiers' threads: a slow check does not hold
up the loop, and a group is pushed only once every sample has its verdict."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from rollout_service.actor import ActorLoop, _GroupInFlight
from scalerl.config import AdditionsTaskConfig
from scalerl.tasks import TaskSet, build_task
from scalerl.verifiers import Verdict, VerifierPool


class _Done:
    def __init__(self, text: str) -> None:
        self.token_ids, self.forced = [ord(c) for c in text], []
        self.logprobs, self.versions, self.finish_reason = [0.0] * len(text), [0] * len(text), 1
        self.routed_experts = None  # a dense model's


class _Stream:
    def __init__(self, text: str) -> None:
        self.finished = threading.Event()
        self.finished.set()
        self._done, self.request_id = _Done(text), text

    def result(self):
        return self._done


def test_a_slow_verifier_does_not_block_the_loop() -> None:
    tasks = TaskSet([build_task(AdditionsTaskConfig(name="add", large_max=9, heldout_size=5))])
    task = tasks["add"]
    release = threading.Event()
    checks = []

    def slow_check(completion, answer):
        checks.append(completion)
        release.wait(10)
        return Verdict(1.0 if completion.strip() == str(answer) else 0.0, False)

    task.verifier.check = slow_check
    actor = object.__new__(ActorLoop)
    actor.tasks, actor.tokenizer = tasks, SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)))
    actor.scorers = {"add": VerifierPool(task.verifier, threads=4)}
    problem = task.problem(task.train_ids[0])
    group = _GroupInFlight(problem.prompt_id, [1], [_Stream(str(problem.answer)), _Stream("x")], 0)
    started = time.monotonic()
    assert actor._scored([group]) == []  # scoring submitted, not waited for
    assert time.monotonic() - started < 0.5 and group.verdicts is not None
    release.set()
    deadline = time.monotonic() + 10
    while not actor._scored([group]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [f.result().reward for f in group.verdicts] == [1.0, 0.0]
    assert sorted(checks) == sorted([str(problem.answer), "x"])  # each sample checked once
    actor.scorers["add"].close()
