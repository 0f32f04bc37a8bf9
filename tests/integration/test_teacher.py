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
