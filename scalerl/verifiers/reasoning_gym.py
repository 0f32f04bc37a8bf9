"""`reasoning_gym:DATASET`: the scorer of a reasoning-gym dataset (Stojanovski et al.,
"REASONING GYM", arXiv 2505.24760).

The reward is `dataset.score_answer(answer, entry)`, in [0, 1] with the dataset's own
partial credit, where `answer` is the completion's answer part (after the end of thinking,
surrounding whitespace stripped) and `entry` the item (its question, answer and metadata,
which many scorers read). A completion that opened a thinking block and never closed it
has no answer: 0 and a parse failure, without calling the scorer. Scorers parse model text
with sympy and the like (`countdown` parses `9**9**9**9` as readily as `2+2`), so each
check runs in a worker process with a time limit (`workers.WorkerPool`).

reasoning-gym imports matplotlib, so it is imported here only when a verifier or a task
of this kind is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import numbers
from functools import lru_cache
from typing import Any

from scalerl.verifiers.base import END_OF_THINKING, Verdict, Verifier, answer_part
from scalerl.verifiers.workers import DEFAULT_MEMORY_BYTES, DEFAULT_WORKERS, WorkerPool

PREFIX = "reasoning_gym:"
DEFAULT_TIMEOUT_S = 10.0
# Dataset options a task sets itself (TaskConfig.seed and size).
TASK_OPTIONS = ("seed", "size")


def dataset_names() -> list[str]:
    """The datasets reasoning-gym registers, sorted. Raises ValueError when it is missing."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(
            "reasoning-gym is not installed: pip install 'scalerl[verifiers]'"
        ) from None
    return sorted(DATASETS)


def check_dataset(name: str) -> None:
    """Raise ValueError naming `dataset` (with near and sample valid names) when reasoning-gym
    has no dataset `name`."""
    names = dataset_names()
    if name in names:
        return
    near = difflib.get_close_matches(name, names, n=3)
    hint = f"did you mean {', '.join(near)}? " if near else ""
    raise ValueError(
        f"dataset {name!r} is not a reasoning-gym dataset ({hint}{len(names)} in all, e.g. "
        f"{', '.join(names[:6])})"
    )


def make_dataset(name: str, options: dict[str, Any] | None = None, **task_options: Any):
    """`reasoning_gym.create_dataset(name, **task_options, **options)`.

    options: the dataset's own (TaskConfig.dataset_config); task_options: seed and size.
    Raises ValueError naming dataset (unknown) or dataset_config (an option the dataset
    does not take, one its checks refuse, or seed/size, which the task sets).
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    check_dataset(name)
    options = dict(options or {})
    taken = [k for k in TASK_OPTIONS if k in options]
    if taken:
        raise ValueError(
            f"dataset_config must not set {', '.join(taken)}: the task's seed and size do"
        )
    allowed = [f.name for f in dataclasses.fields(DATASETS[name][1])]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        shown = ", ".join(a for a in allowed if a not in TASK_OPTIONS)
        raise ValueError(
            f"dataset_config: {name} takes no option {', '.join(unknown)} (options: {shown})"
        )
    try:
        return reasoning_gym.create_dataset(name, **task_options, **options)
    except (AssertionError, TypeError, ValueError) as exc:
        raise ValueError(f"dataset_config is not valid for {name}: {exc or 'refused'}") from None


def as_entry(answer: Any) -> dict[str, Any]:
    """The reasoning-gym item a reference answer stands for.

    A mapping with an "answer" key is the item (question and metadata default to empty);
    a text is parsed as JSON for such a mapping, else is the plain answer text (what
    `scalerl task score --answer` passes). Raises ValueError for anything else.
    """
    if isinstance(answer, str):
        try:
            parsed = json.loads(answer)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and "answer" in parsed:
            answer = parsed
        else:
            return {"question": "", "answer": answer, "metadata": {}}
    if isinstance(answer, dict) and "answer" in answer:
        return {"question": "", "metadata": {}, **answer}
    raise ValueError(
        "answer must be a reasoning-gym item (a mapping with an 'answer' key) or the answer "
        f"text, got {answer!r}"[:300]
    )


@lru_cache(maxsize=16)
def _scorer(name: str, options_json: str):
    # One dataset object per worker process and options: scorers are methods of it.
    return make_dataset(name, json.loads(options_json)).score_answer


def score_in_worker(name: str, options_json: str, text: str, entry: dict[str, Any]) -> float:
    """`score_answer(text, entry)` of the dataset (runs in a worker process); a numpy
    number comes back as a float."""
    reward = _scorer(name, options_json)(text, entry)
    is_number = isinstance(reward, numbers.Real) and not isinstance(reward, bool)
    return float(reward) if is_number else reward


class ReasoningGymVerifier(Verifier):
    """The scorer of reasoning-gym dataset `dataset` as a verifier named
    `reasoning_gym:<dataset>`.

    dataset_config: the dataset's options (some scorers read them); timeout_s: limit of one
    check, seconds (0.1..600); workers, memory_bytes: the worker pool's bounds;
    end_of_thinking: the marker after which the answer starts ("" = the whole completion).
    Raises ValueError for an unknown dataset, a bad option or bound.
    """

    def __init__(
        self,
        dataset: str,
        dataset_config: dict[str, Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = DEFAULT_WORKERS,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        end_of_thinking: str = END_OF_THINKING,
    ) -> None:
        super().__init__(f"{PREFIX}{dataset}")
        if not 0.1 <= timeout_s <= 600:
            raise ValueError(f"timeout_s must be in [0.1, 600] seconds, got {timeout_s}")
        make_dataset(dataset, dataset_config)  # refuses a bad name or option here, not per check
        self.dataset = dataset
        self._options = json.dumps(dataset_config or {}, sort_keys=True)
        self.timeout_s, self.end_of_thinking = timeout_s, end_of_thinking
        self._pool = WorkerPool.shared(workers, memory_bytes)

    def validate_answer(self, answer: Any) -> None:
        as_entry(answer)

    def check(self, completion: str, answer: Any) -> Verdict:
        entry = as_entry(answer)
        expected = str(entry["answer"])[:2000]
        text = answer_part(completion, self.end_of_thinking)
        if text is None:
            detail = f"no answer: the thinking never ended ({self.end_of_thinking!r})"
            return Verdict(0.0, True, expected=expected, detail=detail)
        text = text.strip()
        reward = self._pool.call(
            score_in_worker, self.dataset, self._options, text, entry, timeout_s=self.timeout_s
        )
        return Verdict(
            reward,
            False,
            extracted=text[:2000],
            expected=expected,
            detail=f"{self.dataset}.score_answer = {reward:g}",
        )

    def close(self) -> None:
        self._pool.close()
