"""`reward_model`: a sequence-classification checkpoint scores each (prompt, completion),
served by the reward service (`scalerl-reward`, `reward_service`) at
`verifier.reward_model.service`; its raw score is mapped onto [0, 1] (`normalized`).

The service batches the calls that arrive together (every worker's and the evaluator's);
scores are cached by (prompt, completion) here (`scalerl.verifiers.cache`), so a group's
repeated completions cost one call.
A service that is down, busy or past `timeout_s` is retried with back-off for `retry_s`
(`scalerl.verifiers.retries`), then the sample is unscored and its group dead-lettered:
never a reward. The completion reaches the model as its assistant turn and nothing else,
so it cannot change how it is scored but by what it says.
"""

from __future__ import annotations

import math
from typing import Any

from scalerl.config.task import RewardModelVerifierConfig
from scalerl.rpc.clients.base import RpcClient
from scalerl.rpc.errors import ServiceError
from scalerl.rpc.security import Security
from scalerl.rpc.services import REWARD
from scalerl.v1 import reward_pb2
from scalerl.verifiers.base import END_OF_THINKING, Verdict, Verifier
from scalerl.verifiers.cache import VerdictCache, cache_key
from scalerl.verifiers.retries import service_failure, with_retries


def normalized(score: float, settings: RewardModelVerifierConfig) -> float:
    """The reward in [0, 1] of a raw `score`: "sigmoid" 1 / (1 + exp(-(score - center) /
    scale)), "linear" (score - low) / (high - low) clipped to [0, 1]. Raises ValueError
    for a score that is not finite (a broken checkpoint)."""
    if not math.isfinite(score):
        raise ValueError(f"the reward model's score is not finite: {score}")
    if settings.normalize == "linear":
        return min(1.0, max(0.0, (score - settings.low) / (settings.high - settings.low)))
    z = (score - settings.center) / settings.scale
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


class RewardClient(RpcClient):
    """Score on the reward service at `address` (host:port). Plaintext without a token by
    default, as the sandbox: the service holds no secret and changes nothing (only the
    learner and the workers reach it: deploy/, NetworkPolicy reward)."""

    service = REWARD

    def score(self, items: list[tuple[str, str]]) -> list[float]:
        """Raw scores of (prompt, completion) pairs, in order. Raises ServiceError
        (InvalidArgument for too many items, ResourceExhausted when its queue is full,
        Unavailable when it is not up, ...), or RuntimeError for an answer of another
        length."""
        request = reward_pb2.ScoreRequest(
            items=[reward_pb2.ScoreItem(prompt=p, completion=c) for p, c in items]
        )
        reply = self._call("Score", request)
        if len(reply.scores) != len(items):
            raise RuntimeError(f"{len(items)} items scored as {len(reply.scores)}")
        return list(reply.scores)


class RewardModelVerifier(Verifier):
    """The `reward_model` verifier (module doc). settings: `verifier.reward_model`;
    timeout_s: the task's `verifier_timeout_s`, replacing `settings.timeout_s` when given;
    end_of_thinking: the marker after which the answer starts ("" = the whole completion).

    Raises ValueError at construction when no service is set."""

    def __init__(
        self,
        settings: RewardModelVerifierConfig,
        timeout_s: float | None = None,
        end_of_thinking: str = END_OF_THINKING,
    ) -> None:
        super().__init__("reward_model")
        if not settings.service:
            raise ValueError(
                "verifier.reward_model.service (host:port of scalerl-reward) is required by "
                "the reward_model verifier"
            )
        self.settings = settings
        self.end_of_thinking = end_of_thinking
        self._client = RewardClient(
            settings.service, timeout_s or settings.timeout_s, security=Security()
        )
        self._cache = VerdictCache(settings.cache_size)

    def validate_answer(self, answer: Any) -> None:
        """Any reference answer, or none: the model scores the completion alone."""

    def check(self, completion: str, answer: Any) -> Verdict:
        return self.check_prompted(completion, answer, "")

    def check_prompted(self, completion: str, answer: Any, prompt: str) -> Verdict:
        from scalerl.verifiers.base import answer_part

        text = answer_part(completion, self.end_of_thinking)
        if text is None or not text.strip():
            return Verdict(0.0, True, detail="no answer to score")
        key = cache_key(prompt, text, self.end_of_thinking)
        verdict, _ = self._cache.get_or_compute(key, lambda: self._scored(prompt, text))
        return verdict

    def _scored(self, prompt: str, text: str) -> Verdict:
        what = f"the reward service at {self.settings.service} did not score it"
        [score] = with_retries(lambda: self._score_once(prompt, text), self.settings.retry_s, what)
        reward = normalized(score, self.settings)
        return Verdict(reward, False, extracted=text[:300], detail=f"score {score:.6g}")

    def _score_once(self, prompt: str, text: str) -> list[float]:
        try:
            return self._client.score([(prompt, text)])
        except ServiceError as exc:
            raise service_failure(exc, "reward service") from exc

    def close(self) -> None:
        self._client.close()
