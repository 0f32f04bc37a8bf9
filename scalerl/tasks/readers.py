"""Row readers of the `file` source: a JSONL file, a Parquet file, or a folder written by
`datasets`' `save_to_disk`. Each scans its rows once (the task's index pass, a few columns)
and then reads one row on demand; none writes anything or downloads anything.

Errors are ValueErrors naming the config field at fault (path, format, prompt_field, ...);
the task adds its name in front.
"""

from __future__ import annotations

import json
import os
import threading
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Rows per batch of the Parquet and saved-datasets index pass (bounds its memory).
SCAN_BATCH = 8192
# Parquet row groups kept decoded (a run of loads in one group reads it once).
CACHED_ROW_GROUPS = 2
FORMATS = ("jsonl", "parquet", "hf")
# The decoder without json.loads' per-call encoding detection (a third of a JSONL scan).
_decode = json.JSONDecoder().decode

# Columns are named by the config field they fill: {"prompt_field": "question", ...}.
Fields = Mapping[str, str]


def detect_format(path: str, format: str) -> str:
    """The reader `format` ("auto", "jsonl", "parquet", "hf") picks for `path`.

    Raises ValueError naming path (missing) or format (undetectable, or not what the path
    is: a file given format hf, a folder given jsonl).
    """
    where = Path(path)
    if not where.exists():
        raise ValueError(f"path {path!r} does not exist")
    if format == "auto":
        if where.is_dir():
            return "hf"
        suffix = where.suffix.lower()
        if suffix in (".jsonl", ".parquet"):
            return suffix[1:]
        raise ValueError(
            f"format 'auto' cannot tell the format of {path!r}: name it .jsonl or .parquet, "
            "give a save_to_disk folder, or set format to jsonl, parquet or hf"
        )
    if format not in FORMATS:
        raise ValueError(f"format must be auto, jsonl, parquet or hf, got {format!r}")
    if (format == "hf") != where.is_dir():
        kind = "a folder" if where.is_dir() else "a file"
        raise ValueError(f"format {format!r} does not fit {path!r}, which is {kind}")
    return format


def _missing_column(field: str, column: str, source: str, columns: list[str]) -> ValueError:
    present = ", ".join(columns) or "none"
    return ValueError(f"{field} {column!r} is not a column of {source} (columns: {present})")


class RowReader(ABC):
    """One source of rows, numbered 0..n-1 in file order.

    unit: how errors name a row ("line" counts file lines from 1, "row" rows from 0);
    kind: the format; given_split: for a saved DatasetDict, each row's split (0 train,
    1 held-out) as uint8 [n], else None; ignored_rows: rows of other splits.
    """

    unit = "row"
    kind = ""
    given_split: np.ndarray | None = None
    ignored_rows = 0

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = Path(path).name
        self.rows = 0

    @abstractmethod
    def scan(self, fields: Fields, required: Fields) -> Iterator[tuple[int, tuple[Any, ...]]]:
        """Every row's values of `fields` (in their order), with its number in `unit`;
        raises ValueError naming the field of a column in `fields` or `required` that is
        absent. Sets `rows` when done."""

    @abstractmethod
    def read(self, row: int, columns: tuple[str, ...]) -> dict[str, Any]:
        """The values of `columns` of row number `row` (already scanned)."""

    def row_id(self, row: int) -> str:
        """The row id of a row when the file has no id column: its number."""
        return str(row)

    def row_of(self, row_id: str) -> int:
        """The row number of a row id made by `row_id`; raises KeyError otherwise."""
        if not (row_id.isascii() and row_id.isdigit()) or str(int(row_id)) != row_id:
            raise KeyError(row_id)
        row = int(row_id)
        if row >= self.rows:
            raise KeyError(row_id)
        return row

    def close(self) -> None:
        """Release the open file, if any."""
        return None


class JsonlReader(RowReader):
    """A JSON Lines file: one JSON object a line (blank lines skipped). The scan keeps
    each row's byte offset and length (12 bytes a row); `read` is one `os.pread` and one
    `json.loads`, safe from several threads."""

    unit = "line"
    kind = "jsonl"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._starts = array("q")
        self._lengths = array("I")
        self._fd = os.open(path, os.O_RDONLY)

    def scan(self, fields: Fields, required: Fields) -> Iterator[tuple[int, tuple[Any, ...]]]:
        wanted = [*fields.items(), *required.items()]
        columns, count = [c for _, c in wanted], len(fields)
        offset = 0
        with open(self.path, "rb") as file:
            for number, line in enumerate(file, 1):
                start, offset = offset, offset + len(line)
                try:
                    record = _decode(line.decode("utf-8"))
                except ValueError as exc:  # also UnicodeDecodeError
                    if line.isspace():
                        continue
                    raise ValueError(
                        f"path: line {number} of {self.name} is not a JSON object ({exc})"
                    ) from None
                if type(record) is not dict:
                    kind = type(record).__name__
                    raise ValueError(
                        f"path: line {number} of {self.name} is not a JSON object (a {kind})"
                    )
                try:
                    values = [record[c] for c in columns]
                except KeyError:
                    field, column = next((f, c) for f, c in wanted if c not in record)
                    source = f"line {number} of {self.name}"
                    raise _missing_column(field, column, source, list(record)) from None
                self._starts.append(start)
                self._lengths.append(len(line))
                yield number, tuple(values[:count])
        self.rows = len(self._starts)

    def read(self, row: int, columns: tuple[str, ...]) -> dict[str, Any]:
        data = os.pread(self._fd, self._lengths[row], self._starts[row])
        record = _decode(data.decode("utf-8"))
        return {c: record[c] for c in columns}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ParquetReader(RowReader):
    """A Parquet file: the scan reads only the index columns, a batch at a time; `read`
    decodes the row group of the row (the load columns only), keeping the last
    `CACHED_ROW_GROUPS`, so a file written with small row groups loads lightly."""

    kind = "parquet"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            self._file = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise ValueError(f"path {path!r} is not a readable Parquet file ({exc})") from None
        self.columns = list(self._file.schema_arrow.names)
        meta = self._file.metadata
        self._ends = np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        self._groups: OrderedDict[tuple[int, tuple[str, ...]], Any] = OrderedDict()
        self._lock = threading.Lock()

    def scan(self, fields: Fields, required: Fields) -> Iterator[tuple[int, tuple[Any, ...]]]:
        for field, column in [*fields.items(), *required.items()]:
            if column not in self.columns:
                raise _missing_column(field, column, self.name, self.columns)
        columns = list(dict.fromkeys(fields.values()))
        row = 0
        for batch in self._file.iter_batches(batch_size=SCAN_BATCH, columns=columns):
            by_name = {c: batch.column(c).to_pylist() for c in columns}
            for values in zip(*(by_name[c] for c in fields.values()), strict=True):
                yield row, values
                row += 1
        self.rows = row

    def read(self, row: int, columns: tuple[str, ...]) -> dict[str, Any]:
        group = int(np.searchsorted(self._ends, row, side="right"))
        start = int(self._ends[group - 1]) if group else 0
        table = self._group(group, columns)
        return table.slice(row - start, 1).to_pylist()[0]

    def _group(self, group: int, columns: tuple[str, ...]):
        key = (group, columns)
        with self._lock:
            if key in self._groups:
                self._groups.move_to_end(key)
                return self._groups[key]
            table = self._file.read_row_group(group, columns=list(columns))
            self._groups[key] = table
            while len(self._groups) > CACHED_ROW_GROUPS:
                self._groups.popitem(last=False)
            return table

    def close(self) -> None:
        with self._lock:
            self._groups.clear()
        self._file.close()


class SavedDatasetReader(RowReader):
    """A folder written by `datasets`' `save_to_disk`, memory-mapped (`load_from_disk`):
    a Dataset, or a DatasetDict whose `train_split` and `heldout_split` give the split
    (other splits ignored and counted); `read` is `dataset[i]` of the needed columns.

    Without an id column, a DatasetDict's row ids are `{split}-{i}` (i counting from 0
    within the split).
    """

    kind = "hf"

    def __init__(self, path: str, train_split: str, heldout_split: str) -> None:
        super().__init__(path)
        import datasets  # lazily: a second of import time, only for this format

        try:
            loaded = datasets.load_from_disk(path)
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(
                f"path {path!r} is not a folder written by datasets' save_to_disk ({exc})"
            ) from None
        if isinstance(loaded, datasets.DatasetDict):
            self._parts = self._splits(loaded, train_split, heldout_split)
        else:
            self._parts = [("", loaded)]
        self.columns = list(self._parts[0][1].column_names)
        self._starts = np.cumsum([0] + [len(d) for _, d in self._parts])
        self._selected: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._lock = threading.Lock()

    def _splits(self, loaded, train_split: str, heldout_split: str) -> list[tuple[str, Any]]:
        names = list(loaded)
        for field, split in (("train_split", train_split), ("heldout_split", heldout_split)):
            if split not in loaded:
                raise ValueError(
                    f"{field} {split!r} is not a split of {self.name} (splits: {', '.join(names)})"
                )
        self.ignored_rows = sum(
            len(loaded[n]) for n in names if n not in (train_split, heldout_split)
        )
        codes = [np.full(len(loaded[train_split]), 0, np.uint8)]
        codes.append(np.full(len(loaded[heldout_split]), 1, np.uint8))
        self.given_split = np.concatenate(codes)
        return [(train_split, loaded[train_split]), (heldout_split, loaded[heldout_split])]

    def scan(self, fields: Fields, required: Fields) -> Iterator[tuple[int, tuple[Any, ...]]]:
        for split, dataset in self._parts:
            source = f"split {split!r} of {self.name}" if split else self.name
            for field, column in [*fields.items(), *required.items()]:
                if column not in dataset.column_names:
                    raise _missing_column(field, column, source, list(dataset.column_names))
        columns = list(dict.fromkeys(fields.values()))
        row = 0
        for _, dataset in self._parts:
            for batch in dataset.select_columns(columns).iter(batch_size=SCAN_BATCH):
                for values in zip(*(batch[c] for c in fields.values()), strict=True):
                    yield row, values
                    row += 1
        self.rows = row

    def read(self, row: int, columns: tuple[str, ...]) -> dict[str, Any]:
        part = int(np.searchsorted(self._starts, row, side="right")) - 1
        with self._lock:
            key = (part, columns)
            if key not in self._selected:
                self._selected[key] = self._parts[part][1].select_columns(list(columns))
            dataset = self._selected[key]
        return dataset[row - int(self._starts[part])]

    def row_id(self, row: int) -> str:
        if self.given_split is None:
            return str(row)
        part = int(np.searchsorted(self._starts, row, side="right")) - 1
        return f"{self._parts[part][0]}-{row - int(self._starts[part])}"

    def row_of(self, row_id: str) -> int:
        if self.given_split is None:
            return super().row_of(row_id)
        split, _, local = row_id.rpartition("-")
        for part, (name, dataset) in enumerate(self._parts):
            if name == split and local.isascii() and local.isdigit():
                if str(int(local)) == local and int(local) < len(dataset):
                    return int(self._starts[part]) + int(local)
        raise KeyError(row_id)


def open_reader(path: str, format: str, train_split: str, heldout_split: str) -> RowReader:
    """The reader of `path` in `format` (see `detect_format`); raises ValueError naming
    path or format."""
    kind = detect_format(path, format)
    if kind == "jsonl":
        return JsonlReader(path)
    if kind == "parquet":
        return ParquetReader(path)
    return SavedDatasetReader(path, train_split, heldout_split)
