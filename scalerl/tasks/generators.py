"""The `reasoning_gym` source: a seeded procedural generator of the reasoning-gym package
(`ReasoningGymTaskConfig.dataset`, `dataset_config`, `size`, `seed`), scored by that
dataset's scorer.

Items are deterministic by index (most datasets draw item i from `Random(seed + i)`), so
row ids are item indices and `load` generates an item when asked. Generating all `size`
items to split them would take from a fraction of a second (basic_arithmetic: 10,000 in
about 1 s) to hours (knight_swap: 0.7 s an item), in every process, so the split generates
only what it needs: the held-out items (see `heldout_walk`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from scalerl.config import ReasoningGymTaskConfig
from scalerl.tasks.base import PROBLEM_CACHE, Problem, Task, task_verifier
from scalerl.tasks.files import render
from scalerl.tasks.ids import Complement, PromptIds
from scalerl.tasks.split import seeded_order, text_digest
from scalerl.verifiers import Verifier
from scalerl.verifiers.reasoning_gym import PREFIX, make_dataset

# Items the held-out walk may draw per held-out prompt (plus WALK_SLACK) before it gives
# up: a dataset repeating its questions that much is too narrow for the held-out size.
WALK_FACTOR, WALK_SLACK = 8, 1000
# Later items a training row whose question is held out may try for its stand-in.
STAND_IN_LIMIT = 1000


@dataclass(frozen=True)
class HeldOut:
    """The held-out items: `rows` (indices, increasing), `dropped` (indices the walk met
    whose question repeats a held-out one: in neither split) and the held-out questions'
    digests; `items` keeps the walk's held-out items when they fit the problem cache."""

    rows: np.ndarray
    dropped: np.ndarray
    digests: frozenset[bytes]
    items: dict[int, dict[str, Any]]


def heldout_walk(
    item: Callable[[int], dict[str, Any]], size: int, heldout_size: int, seed: int
) -> HeldOut:
    """The held-out split of a generated task: the first `heldout_size` distinct questions
    of the items 0..size-1 in their seeded shuffle (`split.seeded_order`); items repeating
    one of them met on the way are dropped.

    Generates about heldout_size items, not size. Raises ValueError naming heldout_size
    when the items give too few distinct questions (all size of them drawn, or
    WALK_FACTOR * heldout_size + WALK_SLACK) or leave no training item.
    """
    found: dict[bytes, int] = {}
    dropped: list[int] = []
    kept: dict[int, dict[str, Any]] = {}
    limit = min(size, WALK_FACTOR * heldout_size + WALK_SLACK)
    count, done = min(limit, heldout_size + heldout_size // 4 + 16), 0
    while len(found) < heldout_size and done < limit:
        for index in seeded_order(size, seed, count)[done:].tolist():
            entry = item(index)
            digest = text_digest(entry["question"])
            if digest in found:
                dropped.append(index)
                continue
            found[digest] = index
            if heldout_size <= PROBLEM_CACHE:
                kept[index] = entry
            if len(found) == heldout_size:
                break
        done, count = count, min(limit, 2 * count)
    walked = len(found) + len(dropped)
    if len(found) < heldout_size or walked == size:
        top = len(found) - 1 if walked == size else len(found)
        raise ValueError(
            f"heldout_size must be in [1, {top}] for the {len(found)} distinct questions "
            f"among {walked} items drawn, got {heldout_size} (a wider dataset_config or a "
            "larger size gives more)"
        )
    return HeldOut(
        np.sort(np.fromiter(found.values(), dtype=np.int64)),
        np.sort(np.asarray(dropped, dtype=np.int64)),
        frozenset(found),
        kept,
    )


def task_scorer(config: ReasoningGymTaskConfig, end_of_thinking: str = "") -> Verifier:
    """The verifier of a generated task: its dataset's scorer (`reasoning_gym:<dataset>`
    with the dataset_config) unless the config names another, which then gets the item
    (question, answer, metadata) as the reference answer."""
    own = f"{PREFIX}{config.dataset}"
    options = {"dataset_config": config.dataset_config} if config.verifier in ("", own) else {}
    return task_verifier(config, end_of_thinking, default=own, options=options)


class ReasoningGymTask(Task):
    """A reasoning-gym dataset as a task (source `reasoning_gym`).

    Row i is item i of `reasoning_gym.create_dataset(dataset, seed=seed, size=size,
    **dataset_config)`: `question` is its question through `prompt_template`, `answer`
    the item (question, answer, metadata) its scorer reads. Held-out: `heldout_walk`.
    Training: every other item but the walk's dropped repeats; a training item whose
    question turns out to be a held-out one (met by no walk, found when loaded) stands in
    for the next training item whose question is not, so no training prompt shares a
    held-out text. Repeats within training are kept (draws of one generator).

    Building costs importing reasoning-gym (about 0.8 s) and generating about heldout_size
    items (basic_arithmetic, size 10,000, 200 held out: 0.02 s; size 10,000,000: 0.7 s,
    the seeded order of the indices); every process that builds the task pays it, since
    each needs the held-out questions to keep them out of training.

    Raises ValueError, one line starting `task '<name>':`, naming dataset (unknown),
    dataset_config (an option refused), heldout_size (too few distinct questions) or
    verifier.
    """

    def __init__(self, config: ReasoningGymTaskConfig, end_of_thinking: str = "") -> None:
        super().__init__(config.name, config.weight, config.effective_system_prompt)
        self.size, self._template = config.size, config.prompt_template
        try:
            self._dataset = make_dataset(
                config.dataset, config.dataset_config, seed=config.seed, size=config.size
            )
            held = heldout_walk(self._generate, config.size, config.heldout_size, config.seed)
        except ValueError as exc:
            raise ValueError(f"task {config.name!r}: {exc}") from None
        self.verifier = task_scorer(config, end_of_thinking)
        self._held = held
        self._heldout_rows = frozenset(held.rows.tolist())
        self._dropped_rows = frozenset(held.dropped.tolist())
        train = Complement(config.size, np.concatenate([held.rows, held.dropped]))
        self.train_ids = PromptIds(self.name, train, str, self._has_training)
        self.heldout_ids = PromptIds(self.name, held.rows, str, self._has_heldout)
        options = f", {json.dumps(config.dataset_config, sort_keys=True)}"
        self.source = (
            f"reasoning_gym {config.dataset} (seed {config.seed}, size {config.size}"
            f"{options if config.dataset_config else ''})"
        )

    def _generate(self, index: int) -> dict[str, Any]:
        try:
            return self._dataset[index]
        except Exception as exc:  # noqa: BLE001 - a generator bug, named with its item
            raise ValueError(f"dataset: item {index} does not generate: {exc!r}") from None

    def _index(self, row_id: str) -> int:
        if not (row_id.isascii() and row_id.isdigit()) or str(int(row_id)) != row_id:
            raise KeyError(row_id)
        index = int(row_id)
        if index >= self.size or index in self._dropped_rows:
            raise KeyError(row_id)
        return index

    def _has_training(self, row_id: str) -> bool:
        try:
            return self._index(row_id) not in self._heldout_rows
        except KeyError:
            return False

    def _has_heldout(self, row_id: str) -> bool:
        try:
            return self._index(row_id) in self._heldout_rows
        except KeyError:
            return False

    def load(self, row_id: str) -> Problem:
        index = self._index(row_id)
        if index in self._heldout_rows:
            item = self._held.items.get(index) or self._generate(index)
        else:
            item = self._training_item(index)
        return Problem(self.prompt_id(row_id), render(self._template, item["question"]), item)

    def _training_item(self, index: int) -> dict[str, Any]:
        """Item `index`, or the next training item whose question is not held out."""
        candidate = index
        for _ in range(STAND_IN_LIMIT):
            if candidate not in self._heldout_rows and candidate not in self._dropped_rows:
                item = self._generate(candidate)
                if text_digest(item["question"]) not in self._held.digests:
                    return item
            candidate = (candidate + 1) % self.size
        raise KeyError(f"{index}: no item after it has a question that is not held out")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "dropped_duplicates": len(self._held.dropped)}
