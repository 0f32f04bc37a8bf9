"""The `file` source: prompts and reference answers from a local JSONL file, Parquet file
or saved `datasets` folder (`FileTaskConfig.path`, `format`, the `*_field` names).

One pass over the rows (`readers.RowReader.scan`) checks every prompt and id and keeps, per
row, its row id (when the file has an id column), its split and an 8-byte digest of its
prompt text, not the text; `load(row_id)` reads that one row again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from scalerl.config import FileTaskConfig
from scalerl.tasks.base import Problem, Task
from scalerl.tasks.ids import PromptIds, RowIds
from scalerl.tasks.readers import RowReader, open_reader
from scalerl.tasks.split import Split, given_split, seeded_split, text_digest
from scalerl.verifiers import Verifier

log = logging.getLogger(__name__)

# Per-row split membership (uint8).
DROPPED, TRAIN, HELDOUT = 0, 1, 2
# Values of a split column other than the two splits, shown in an error.
SHOWN_VALUES = 8


def render(template: str, prompt: str) -> str:
    """`template` with `{prompt}` replaced by `prompt` (str.replace, not str.format, so
    braces in either, e.g. `\\boxed{}`, are kept)."""
    return template.replace("{prompt}", prompt)


class BadValue(ValueError):
    """A cell a column cannot hold; the index pass adds the field, column and row."""


def chat_messages(value: Any) -> tuple[dict[str, str], ...]:
    """`value` as chat messages: a list of {role, content} texts, one from the user at
    least (other keys dropped). Raises BadValue otherwise."""
    if isinstance(value, list) and value:
        messages = [m for m in map(_message, value) if m is not None]
        if len(messages) == len(value) and any(m["role"] == "user" for m in messages):
            return tuple(messages)
    raise BadValue(
        "must be a text or a list of chat messages ({role, content} texts, one from the "
        f"user), got {_shown(value)}"
    )


def _message(value: Any) -> dict[str, str] | None:
    if not isinstance(value, Mapping):
        return None
    role, content = value.get("role"), value.get("content")
    if not isinstance(role, str) or not isinstance(content, str):
        return None
    return {"role": role, "content": content}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def prompt_text(value: Any) -> str:
    """The text a prompt is deduplicated by: the text itself, or the chat messages as
    canonical JSON. Raises BadValue for anything else."""
    if isinstance(value, str):
        return value
    return json.dumps(chat_messages(value), ensure_ascii=False, separators=(",", ":"))


def row_id_text(value: Any) -> str:
    """An id column's value as a row id: a non-empty text or integer without whitespace.

    Raises BadValue otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value and not any(c.isspace() for c in value):
        return value
    raise BadValue(f"must be a non-empty text or integer without whitespace, got {_shown(value)}")


@dataclass
class RowIndex:
    """What the index pass keeps: digests [n] uint64, the split column's value per row
    as uint8 [n] (TRAIN, HELDOUT or DROPPED for another value) or None, the rows' ids
    (None: row numbers) and up to SHOWN_VALUES other split values met."""

    digests: np.ndarray
    marks: np.ndarray | None
    ids: RowIds | None
    other_values: list[str]


def index_rows(reader: RowReader, config: FileTaskConfig) -> RowIndex:
    """One pass over the rows: check each prompt and id, keep its digest, id and split.

    Raises ValueError naming the field at fault (a missing column, a bad prompt or id, a
    repeated id)."""
    if reader.given_split is not None and config.split_field:
        raise ValueError(
            f"split_field must be empty for a saved DatasetDict ({reader.name}): its "
            "splits train_split and heldout_split give the split"
        )
    fields = {"prompt_field": config.prompt_field}
    if config.id_field:
        fields["id_field"] = config.id_field
    if config.split_field:
        fields["split_field"] = config.split_field
    digests = bytearray()
    ids = RowIds() if config.id_field else None
    marks = bytearray() if config.split_field else None
    splits = {config.train_split: TRAIN, config.heldout_split: HELDOUT}
    others: set[str] = set()
    for number, values in reader.scan(fields, {"answer_field": config.answer_field}):
        field = "prompt_field"
        try:
            digests += text_digest(prompt_text(values[0]))
            if ids is not None:
                field = "id_field"
                ids.add(row_id_text(values[1]))
        except BadValue as exc:
            where = f"{reader.unit} {number} of {reader.name}"
            raise ValueError(f"{field} {fields[field]!r} of {where} {exc}") from None
        if marks is not None:
            value = str(values[-1])
            marks.append(splits.get(value, DROPPED))
            if value not in splits and len(others) < SHOWN_VALUES:
                others.add(value)
    repeated = ids.freeze() if ids is not None else None
    if ids is not None and repeated is not None:
        first, second = repeated
        raise ValueError(
            f"id_field {config.id_field!r} repeats the id {ids.row_id(first)!r} "
            f"(rows {first} and {second}, counting from 0); ids must be unique"
        )
    return RowIndex(
        np.frombuffer(digests, dtype="<u8").astype(np.uint64),
        None if marks is None else np.frombuffer(marks, dtype=np.uint8).copy(),
        ids,
        sorted(others),
    )


def split_rows(reader: RowReader, config: FileTaskConfig, index: RowIndex) -> tuple[Split, int]:
    """The task's split and the rows of other split values (ignored); the file's own
    split (a split column or a DatasetDict's splits) when it has one, else seeded.

    Raises ValueError naming the field when a split has no row or heldout_size does not
    fit the distinct prompts."""
    marks, field = index.marks, f"split_field {config.split_field!r}"
    if reader.given_split is not None:
        marks = np.where(reader.given_split == 0, TRAIN, HELDOUT).astype(np.uint8)
        field = f"the splits of {reader.name}"
    if marks is None:
        return seeded_split(index.digests, config.heldout_size, config.seed), 0
    for name, mark, value in (
        ("train_split", TRAIN, config.train_split),
        ("heldout_split", HELDOUT, config.heldout_split),
    ):
        if not (marks == mark).any():
            seen = f" (other values: {', '.join(index.other_values)})" if index.other_values else ""
            raise ValueError(f"{name} {value!r} names no row of {field}{seen}")
    split = given_split(index.digests, marks == TRAIN, marks == HELDOUT)
    if not len(split.train):
        raise ValueError(
            f"no training rows left: all {split.overlap} distinct training prompts repeat "
            "held-out prompts"
        )
    return split, int((marks == DROPPED).sum()) + reader.ignored_rows


class FileTask(Task):
    """A task read from a file (source `file`), scored by the verifier the config names.

    The prompt column holds a text (the user message, through `prompt_template`) or chat
    messages (`Problem.messages`; the question is the last user message); the answer
    column any JSON value the verifier takes (a number, a text, code tests). Row ids: the
    id column's values, else row numbers (`{split}-{i}` for a saved DatasetDict).
    The split: the file's (a split column, its values compared as text with train_split
    and heldout_split, or a DatasetDict's splits; rows of other values ignored, duplicate
    texts and training rows repeating a held-out text dropped), else seeded
    (`split.seeded_split`: heldout_size distinct prompts, seed; heldout_size is unused
    when the file gives the split).

    Memory: about 21 bytes a row (a JSONL's offset and length 12, membership 1, the
    split's row numbers 8), plus 24 and the id's text with an id column; the texts stay
    in the file. A 1,000,000-row JSONL of short prompts (52 MB) indexes in about 2.9 s to
    86 MiB resident (37 MiB of it the interpreter and its imports; 118 MiB at the peak)
    on one core of an AMD EPYC (torch CPU capability AVX512); with an id column, 4.6 s
    and 125 MiB.

    Raises ValueError, one line starting `task '<name>':` and naming the field (path,
    format, prompt_field, answer_field, id_field, split_field, train_split, heldout_split,
    heldout_size), for a file or row it cannot use.
    """

    def __init__(self, config: FileTaskConfig, verifier: Verifier) -> None:
        super().__init__(config.name, config.weight, config.effective_system_prompt)
        self.verifier = verifier
        self._template = config.prompt_template
        self._columns = (config.prompt_field, config.answer_field)
        self._reader: RowReader | None = None
        try:
            self._reader = open_reader(
                config.path, config.format, config.train_split, config.heldout_split
            )
            index = index_rows(self._reader, config)
            split, self.ignored_rows = split_rows(self._reader, config, index)
        except ValueError as exc:
            self.close_file()
            raise ValueError(f"task {config.name!r}: {exc}") from None
        self._ids = index.ids
        self.rows = len(index.digests)
        self.dropped_duplicates, self.dropped_overlap = split.duplicates, split.overlap
        self._membership = np.zeros(self.rows, dtype=np.uint8)
        self._membership[split.train] = TRAIN
        self._membership[split.heldout] = HELDOUT
        self.train_ids = PromptIds(self.name, split.train, self._row_id, self._in(TRAIN))
        self.heldout_ids = PromptIds(self.name, split.heldout, self._row_id, self._in(HELDOUT))
        self.source = f"file {config.path} ({self._rows.kind}, {self.rows} rows)"
        log.info(
            "task %s: %d training and %d held-out prompts from %d rows (%d duplicates, %d "
            "training rows repeating held-out ones, %d of other splits left out)",
            self.name,
            len(split.train),
            len(split.heldout),
            self.rows,
            self.dropped_duplicates,
            self.dropped_overlap,
            self.ignored_rows,
        )

    @property
    def _rows(self) -> RowReader:
        """The open file; raises ValueError once `close_file` closed it."""
        if self._reader is None:
            raise ValueError(f"task {self.name!r}: its file is closed")
        return self._reader

    def _row_id(self, row: int) -> str:
        return self._ids.row_id(row) if self._ids is not None else self._rows.row_id(row)

    def _row_of(self, row_id: str) -> int:
        row = self._ids.row_of(row_id) if self._ids is not None else self._rows.row_of(row_id)
        if not self._membership[row]:
            raise KeyError(row_id)  # a dropped duplicate or a row of another split
        return row

    def _in(self, mark: int):
        def has(row_id: str) -> bool:
            try:
                return bool(self._membership[self._row_of(row_id)] == mark)
            except KeyError:
                return False

        return has

    def load(self, row_id: str) -> Problem:
        row = self._row_of(row_id)
        record = self._rows.read(row, self._columns)
        prompt, answer = record[self._columns[0]], record[self._columns[1]]
        if isinstance(prompt, str):
            return Problem(self.prompt_id(row_id), render(self._template, prompt), answer)
        messages = chat_messages(prompt)
        question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        return Problem(self.prompt_id(row_id), question, answer, messages)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "rows": self.rows,
            "dropped_duplicates": self.dropped_duplicates,
            "dropped_overlapping_heldout": self.dropped_overlap,
            "ignored_rows": self.ignored_rows,
        }

    def close_file(self) -> None:
        """Close the file (the task can no longer load problems)."""
        if self._reader is not None:
            self._reader.close()

    def close(self) -> None:
        self.close_file()
        super().close()
