"""Compact prompt-id bookkeeping for tasks of millions of rows: a task keeps row numbers in
numpy arrays and makes the prompt-id strings only when asked.

`PromptIds` is the `Task.train_ids` / `heldout_ids` sequence over row numbers;
`Complement` the rows 0..size-1 but a few (a generated task's training rows); `RowIds` a
file's own id column (one UTF-8 buffer, offsets and a sorted digest index: about 20 bytes
a row plus the ids' text, against some 100 for a dict of strings).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import overload

import numpy as np

from scalerl.tasks.base import ID_SEPARATOR
from scalerl.tasks.split import text_digest


class Complement(Sequence[int]):
    """The increasing rows of 0..size-1 not in `excluded` (any order, no repeats, all in
    range), without materialising them: row n is n plus the excluded rows before it."""

    def __init__(self, size: int, excluded: np.ndarray) -> None:
        self.size = size
        self.excluded = np.sort(np.asarray(excluded, dtype=np.int64))
        # g[k] = excluded[k] - k: how many kept rows lie below the k-th excluded row.
        self._gaps = self.excluded - np.arange(len(self.excluded), dtype=np.int64)

    def __len__(self) -> int:
        return self.size - len(self.excluded)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return int(index + np.searchsorted(self._gaps, index, side="right"))

    def __contains__(self, row: object) -> bool:
        if not isinstance(row, int | np.integer) or not 0 <= row < self.size:
            return False
        at = np.searchsorted(self.excluded, row)
        return not (at < len(self.excluded) and self.excluded[at] == row)


class PromptIds(Sequence[str]):
    """The prompt ids `{task}/{row id}` of some rows of a task, made on access.

    rows: the row numbers (an int array or a `Complement`); row_id: a row number's row id;
    has: whether a row id (the part after '/') belongs to these rows.
    """

    def __init__(
        self,
        task: str,
        rows: Sequence[int] | np.ndarray,
        row_id: Callable[[int], str],
        has: Callable[[str], bool],
    ) -> None:
        self.task, self.rows, self._row_id, self._has = task, rows, row_id, has
        self._prefix = f"{task}{ID_SEPARATOR}"

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._prefix + self._row_id(int(self.rows[index]))

    def __iter__(self) -> Iterator[str]:
        for row in self.rows:
            yield self._prefix + self._row_id(int(row))

    def __contains__(self, prompt_id: object) -> bool:
        if not isinstance(prompt_id, str) or not prompt_id.startswith(self._prefix):
            return False
        return self._has(prompt_id[len(self._prefix) :])


def _digest_key(text: str) -> np.uint64:
    return np.frombuffer(text_digest(text), dtype="<u8")[0]


class RowIds:
    """The ids of a file's id column, row by row: `add` each row's id, then `freeze`.

    `row_id(row)` gives a row's id, `row_of(id)` the row (KeyError when absent).
    """

    def __init__(self) -> None:
        self._text = bytearray()
        self._ends: array | np.ndarray = array("q")
        self._digests = bytearray()
        self._order = np.empty(0, dtype=np.int64)
        self._sorted = np.empty(0, dtype=np.uint64)

    def add(self, row_id: str) -> None:
        """Append the next row's id (already checked: non-empty, no whitespace)."""
        self._text += row_id.encode("utf-8")
        assert isinstance(self._ends, array), "RowIds.add after freeze"
        self._ends.append(len(self._text))
        self._digests += text_digest(row_id)

    def freeze(self) -> tuple[int, int] | None:
        """Build the lookup index; the first two rows sharing an id, or None."""
        self._ends = np.frombuffer(self._ends, dtype=np.int64).copy()
        digests = np.frombuffer(bytes(self._digests), dtype="<u8").astype(np.uint64)
        self._digests = bytearray()
        self._order = np.argsort(digests, kind="stable")
        self._sorted = digests[self._order]
        for k in np.flatnonzero(self._sorted[1:] == self._sorted[:-1]):
            first, second = int(self._order[k]), int(self._order[k + 1])
            if self.row_id(first) == self.row_id(second):
                return min(first, second), max(first, second)
        return None

    def __len__(self) -> int:
        return len(self._ends)

    def row_id(self, row: int) -> str:
        """The id of row number `row`."""
        start = int(self._ends[row - 1]) if row else 0
        return self._text[start : int(self._ends[row])].decode("utf-8")

    def row_of(self, row_id: str) -> int:
        """The row number of `row_id`; raises KeyError when no row has it."""
        key = _digest_key(row_id)
        low = np.searchsorted(self._sorted, key, side="left")
        high = np.searchsorted(self._sorted, key, side="right")
        for k in range(int(low), int(high)):
            row = int(self._order[k])
            if self.row_id(row) == row_id:
                return row
        raise KeyError(row_id)
