"""On-policy distillation's teacher (`rollout_service.teacher`): its scores are the learner's
log-probs of the same tokens on the teacher's weights (fp32 head, the rollout's
temperature), a batch scores each sequence as alone, a bad request names the sequence,
and `TeacherService.ScoreTokens` is privileged: the run's token, as Generate."""

from __future__ import annotations

import pytest
import torch

from rollout_service.teacher import TeacherScorer, TeacherServicer
from scalerl.config import TinyModel
from scalerl.policy.logprobs import token_logprobs
from scalerl.policy.models import load_policy
from scalerl.rpc.clients.teacher import TeacherClient
from scalerl.rpc.errors import InvalidArgument, Unauthenticated
from scalerl.rpc.security import Security
from scalerl.rpc.services import TEACHER, serve

pytestmark = pytest.mark.integration
TOKEN = "teacher-test-token"
SEQUENCES = [([5, 6, 7], [8, 9]), ([5, 6], [7, 8, 9, 10, 11]), ([12], [13])]


@pytest.fixture(scope="module")
def model():
    model, _ = load_policy(TinyModel(tiny_hidden=64, tiny_layers=2), seed=3)
    return model.eval()


def _alone(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = token_logprobs(model, ids, torch.ones_like(ids), temperature)[0]
    return logp[len(prompt) - 1 :].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_scores_are_the_learners_log_probs_of_the_same_tokens(model, temperature) -> None:
    scorer = TeacherScorer(model, vocab_size=21, max_seq_len=32, temperature=temperature)
    scores = scorer.score([(list(p), list(c)) for p, c in SEQUENCES])
    for (prompt, completion), got in zip(SEQUENCES, scores, strict=True):
        assert len(got) == len(completion)
        assert got == pytest.approx(_alone(model, prompt, completion, temperature), abs=1e-5)


def test_a_small_batch_budget_scores_the_same(model) -> None:
    big = TeacherScorer(model, vocab_size=21, max_seq_len=32)
    small = TeacherScorer(model, vocab_size=21, max_seq_len=32, batch_tokens=4)
    sequences = [(list(p), list(c)) for p, c in SEQUENCES]
    for a, b in zip(big.score(sequences), small.score(sequences), strict=True):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        ([], "sequences: at least one sequence"),
        ([([1], [])], "sequences[0]: prompt_ids and completion_ids must not be empty"),
        ([([1], [2]), ([1], [21])], "sequences[1]: token id 21 outside 0..20"),
        ([([1] * 30, [2] * 3)], "sequences[0]: 33 tokens > max_seq_len 32"),
        ([([1], [2])] * 257, "sequences: at most 256, got 257"),
    ],
)
def test_a_bad_request_names_the_sequence(model, sequences, message) -> None:
    scorer = TeacherScorer(model, vocab_size=21, max_seq_len=32)
    with pytest.raises(InvalidArgument) as caught:
        scorer.score(sequences)
    assert str(caught.value) == message or str(caught.value).startswith(message)


def test_score_tokens_over_grpc_needs_the_runs_token(model) -> None:
    servicer = TeacherServicer(TeacherScorer(model, vocab_size=21, max_seq_len=32))
    server, port, _ = serve(TEACHER, servicer, security=Security(token=TOKEN))
    address = f"127.0.0.1:{port}"
    try:
        with TeacherClient(address, security=Security(token=TOKEN)) as client:
            scores, tokens = client.score([(list(p), list(c)) for p, c in SEQUENCES])
        assert tokens == sum(len(p) + len(c) for p, c in SEQUENCES) == 14
        assert scores[1] == pytest.approx(_alone(model, *SEQUENCES[1], 1.0), abs=1e-5)
        assert (servicer.sequences, servicer.tokens) == (3, 14)
        with TeacherClient(address, security=Security()) as client:
            with pytest.raises(Unauthenticated):
                client.score([([5], [6])])
    finally:
        server.stop(0).wait()


# --- the teachers' registry and a worker's scores of its groups -------------------------


def test_teachers_register_apart_from_the_workers(redis_client, run_id) -> None:
    """A teacher is never among the workers the learner pushes weights to, nor a worker
    among the teachers, and a worker's signed entry does not pass as a teacher's."""
    from scalerl.state.registry import TEACHER, WorkerRegistry
    from scalerl.state.signing import EntrySigner

    signer = EntrySigner(TOKEN)
    workers = WorkerRegistry(redis_client, run_id, signer=signer)
    teachers = WorkerRegistry(redis_client, run_id, signer=signer, role=TEACHER)
    workers.heartbeat("rollout-0", "127.0.0.1:1", 30)
    teachers.heartbeat("teacher-0", "127.0.0.1:2", 30)
    assert workers.workers() == {"rollout-0": "127.0.0.1:1"}
    assert teachers.workers() == {"teacher-0": "127.0.0.1:2"}
    # The worker's entry copied under the teachers' key: its signature does not check.
    value = redis_client.get(workers._key("rollout-0"))
    redis_client.set(teachers._key("rollout-0"), value)
    redis_client.sadd(teachers._index, "rollout-0")
    assert set(teachers.workers()) == {"teacher-0"}


def _teacher_registry(redis_client, run_id, address: str | None):
    from scalerl.state.registry import TEACHER, WorkerRegistry
    from scalerl.state.signing import EntrySigner

    registry = WorkerRegistry(redis_client, run_id, signer=EntrySigner(""), role=TEACHER)
    if address is not None:
        registry.heartbeat("teacher-0", address, 30)
    return registry


def test_a_workers_groups_are_scored_by_a_registered_teacher(model, redis_client, run_id):
    from rollout_service.teacher_scores import TeacherScores

    servicer = TeacherServicer(TeacherScorer(model, vocab_size=21, max_seq_len=32))
    server, port, _ = serve(TEACHER, servicer, security=Security())
    try:
        registry = _teacher_registry(redis_client, run_id, f"127.0.0.1:{port}")
        scores = TeacherScores(registry, deadline_s=10)
        sequences = [([5, 6, 7], [8, 9]), ([5, 6, 7], [])]  # an empty reply: nothing asked
        got = scores.submit(sequences).result(timeout=30)
        assert got[0] == pytest.approx(_alone(model, [5, 6, 7], [8, 9], 1.0), abs=1e-5)
        assert got[1] == [] and scores.tokens == 5 and servicer.sequences == 1
        scores.close()
    finally:
        server.stop(0).wait()


@pytest.mark.parametrize("teacher", ["none registered", "down"])
def test_no_teacher_dead_letters_the_group_within_its_deadline(
    redis_client, run_id, teacher
) -> None:
    """A worker's group that no teacher scores in time is dead-lettered as
    teacher_unavailable, its ticket given back: never pushed without its scores."""
    import time
    from types import SimpleNamespace

    from rollout_service.actor import ActorLoop, _GroupInFlight
    from rollout_service.teacher_scores import TeacherScores
    from scalerl.config import AdditionsTaskConfig
    from scalerl.ports import free_port
    from scalerl.state.replay import TEACHER_UNAVAILABLE, ReplayStream
    from scalerl.tasks import TaskSet, build_task
    from scalerl.verifiers import VerifierPool

    address = None if teacher == "none registered" else f"127.0.0.1:{free_port()}"
    registry = _teacher_registry(redis_client, run_id, address)
    tasks = TaskSet([build_task(AdditionsTaskConfig(name="add", large_max=9, heldout_size=5))])
    actor = object.__new__(ActorLoop)
    actor.tasks, actor.worker_id = tasks, "w-1"
    actor.tokenizer = SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)))
    actor.scorers = {"add": VerifierPool(tasks["add"].verifier, threads=2)}
    actor.replay = ReplayStream(redis_client, run_id, capacity=4)
    given_back: list = []
    actor.producer = SimpleNamespace(give_back=given_back.extend)
    actor.groups_pushed = actor.groups_unscored = 0
    actor.teacher = TeacherScores(registry, deadline_s=1.0)

    class Done:
        token_ids, forced, logprobs, versions = [53], [], [-0.5], [3]
        finish_reason, routed_experts = 1, None

    class Stream:
        finished = SimpleNamespace(is_set=lambda: True)

        def result(self):
            return Done()

    problem = tasks["add"].problem(tasks["add"].train_ids[0])
    group = _GroupInFlight(problem.prompt_id, [1, 2], [Stream(), Stream()], 3)
    began = time.monotonic()
    actor._scored([group])
    while not group.scored():
        time.sleep(0.05)
    actor._finish_group(group, should_stop=lambda: False)
    assert time.monotonic() - began < 1.0 + 3.0
    assert (actor.groups_pushed, actor.groups_unscored, given_back) == (0, 1, [3])
    ledger = actor.replay.accounting()
    assert ledger[f"dead_letter:{TEACHER_UNAVAILABLE}"] == 1 and ledger["unaccounted"] == 0
    [letter] = actor.replay.dead_letters()
    assert letter["detail"].startswith("no teacher scored the group within 1 s")
    actor.scorers["add"].close()
    actor.teacher.close()
