"""The `file` task source: JSONL, Parquet and saved `datasets` folders give the same
problems, chat prompts and templates, the file's own split and the seeded one (disjoint in
ids and texts, deterministic across processes), one-line errors naming the field, and
loading that reads one row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scalerl.config import task_config
from scalerl.tasks import Problem, build_task, readers
from scalerl.tasks.files import FileTask
from scalerl.tasks.ids import Complement, RowIds
from scalerl.tasks.split import (
    given_split,
    seeded_order,
    seeded_split,
    split_texts,
    text_digests,
)

ROOT = Path(__file__).resolve().parents[2]
ROWS = [
    {"id": f"q{i}", "prompt": f"What is {i}+{i % 7}?", "answer": str(i + i % 7)} for i in range(40)
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict], row_group_size: int = 16) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def _saved(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _task(path: Path, **fields) -> FileTask:
    config = {"name": "t", "source": "file", "path": str(path), "verifier": "last_integer"}
    return build_task(task_config({**config, **fields}))


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> dict[str, Path]:
    """One list of rows written as JSONL, Parquet and a saved Dataset."""
    where = tmp_path_factory.mktemp("three")
    return {
        "jsonl": _jsonl(where / "rows.jsonl", ROWS),
        "parquet": _parquet(where / "rows.parquet", ROWS),
        "hf": _saved(where / "rows", ROWS),
    }


def _problems(task: FileTask) -> dict[str, tuple]:
    return {
        pid: (p.question, p.answer, p.messages)
        for pid in [*task.train_ids, *task.heldout_ids]
        for p in [task.problem(pid)]
    }


@pytest.mark.parametrize("id_field", ["", "id"])
def test_the_three_formats_give_the_same_problems(three, id_field: str) -> None:
    tasks = {kind: _task(path, id_field=id_field, heldout_size=8) for kind, path in three.items()}
    assert [t._reader.kind for t in tasks.values()] == ["jsonl", "parquet", "hf"]
    reference = _problems(tasks["jsonl"])
    first = "t/q3" if id_field else "t/3"
    assert reference[first] == ("What is 3+3?", "6", None)
    for task in tasks.values():
        assert _problems(task) == reference
        # The seeded split depends on the texts alone: one split whatever the format.
        assert list(task.heldout_ids) == list(tasks["jsonl"].heldout_ids)
        assert (len(task.train_ids), len(task.heldout_ids)) == (32, 8)
        task.close()


def test_a_saved_dataset_dict_gives_the_split_by_its_names(tmp_path: Path) -> None:
    data = datasets.Dataset.from_list(ROWS)
    splits = {"train": data.select(range(30)), "test": data.select(range(30, 36))}
    splits["validation"] = data.select(range(36, 40))
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    task = _task(tmp_path / "dd")
    assert (len(task.train_ids), len(task.heldout_ids)) == (30, 6)
    assert task.heldout_ids[0] == "t/test-0" and task.train_ids[29] == "t/train-29"
    assert task.problem("t/test-0").question == "What is 30+2?"
    assert task.describe()["ignored_rows"] == 4  # the validation split
    with pytest.raises(KeyError):
        task.problem("t/validation-0")
    by_id = _task(tmp_path / "dd", id_field="id")
    assert by_id.problem("t/q30") == Problem("t/q30", "What is 30+2?", "32")


def test_chat_message_prompts(tmp_path: Path) -> None:
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Add {i} and 1."},
                {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": f"Now {i}+1?"},
            ],
            "answer": i + 1,
        }
        for i in range(12)
    ]
    for path in (_jsonl(tmp_path / "c.jsonl", rows), _parquet(tmp_path / "c.parquet", rows)):
        task = _task(path, prompt_field="messages", heldout_size=2)
        problem = task.problem("t/5")
        assert problem.question == "Now 5+1?" and problem.answer == 6
        assert problem.messages == (
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 5 and 1."},
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": "Now 5+1?"},
        )


def test_the_template_keeps_braces(tmp_path: Path) -> None:
    rows = [{"prompt": f"Solve {{x}} + {i} = {i + 2}.", "answer": "2"} for i in range(5)]
    template = "{prompt}\nPut the final answer in \\boxed{}."
    task = _task(_jsonl(tmp_path / "b.jsonl", rows), prompt_template=template, heldout_size=1)
    assert task.problem("t/3").question == "Solve {x} + 3 = 5.\nPut the final answer in \\boxed{}."


def test_any_json_answer_and_integer_ids(tmp_path: Path) -> None:
    rows = [
        {"key": 7, "prompt": "f(1)?", "answer": {"inputs": ["1"], "outputs": ["2"]}},
        {"key": 9, "prompt": "g(1)?", "answer": ["assert g(1) == 3"]},
        {"key": 11, "prompt": "h?", "answer": 4.5},
    ]
    task = _task(_jsonl(tmp_path / "a.jsonl", rows), id_field="key", heldout_size=1)
    assert sorted([*task.train_ids, *task.heldout_ids]) == ["t/11", "t/7", "t/9"]
    assert task.problem("t/7").answer == {"inputs": ["1"], "outputs": ["2"]}
    assert task.problem("t/9").answer == ["assert g(1) == 3"]
    for unknown in ("t/8", "t/0", "t/07", "u/7"):
        with pytest.raises(KeyError):
            task.problem(unknown)
    assert "t/7" in [*task.train_ids, *task.heldout_ids] and "t/8" not in task.train_ids


def test_the_files_split_drops_a_training_row_repeating_a_heldout_text(tmp_path: Path) -> None:
    rows = [dict(r, split="train") for r in ROWS[:30]]
    rows += [dict(r, split="test") for r in ROWS[30:36]]
    rows += [dict(r, split="validation") for r in ROWS[36:]]
    rows.append({"id": "leak", "prompt": ROWS[31]["prompt"], "answer": "0", "split": "train"})
    rows.append({"id": "again", "prompt": ROWS[2]["prompt"], "answer": "0", "split": "train"})
    task = _task(_jsonl(tmp_path / "s.jsonl", rows), id_field="id", split_field="split")
    assert (len(task.train_ids), len(task.heldout_ids)) == (30, 6)
    assert "t/leak" not in task.train_ids and "t/again" not in task.train_ids
    assert task.heldout_ids[:2] == ["t/q30", "t/q31"]
    described = task.describe()
    assert described["dropped_overlapping_heldout"] == 1
    assert described["dropped_duplicates"] == 1 and described["ignored_rows"] == 4
    with pytest.raises(KeyError):
        task.problem("t/leak")


def _heldout_texts(path: Path, seed: int) -> tuple[list[str], list[str]]:
    task = _task(path, heldout_size=10, seed=seed)
    train = [task.problem(p).question for p in task.train_ids]
    return list(task.heldout_ids), train


def test_the_seeded_split_is_disjoint_in_ids_and_texts(tmp_path: Path) -> None:
    rows = ROWS + [dict(r, answer="0") for r in ROWS[::4]]  # ten repeated texts
    path = _jsonl(tmp_path / "d.jsonl", rows)
    task = _task(path, heldout_size=10, seed=3)
    train, held = set(task.train_ids), set(task.heldout_ids)
    assert (len(train), len(held)) == (30, 10) and not train & held
    texts = {pid: task.problem(pid).question for pid in train | held}
    assert len(set(texts.values())) == 40  # one row per distinct text
    assert not {texts[p] for p in train} & {texts[p] for p in held}
    assert task.describe()["dropped_duplicates"] == 10
    # Of a repeated text the first row is kept: row 40 repeats row 0.
    assert "t/40" not in train | held and ("t/0" in train or "t/0" in held)


def test_the_seeded_split_is_deterministic_across_processes(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    held, _ = _heldout_texts(path, seed=5)
    assert _heldout_texts(path, seed=5)[0] == held
    assert _heldout_texts(path, seed=6)[0] != held
    code = (
        "import json, sys; from scalerl.config import FileTaskConfig; "
        "from scalerl.tasks import build_task; "
        f"t = build_task(FileTaskConfig(name='t', path={str(path)!r}, "
        "verifier='last_integer', heldout_size=10, seed=5)); "
        "print(json.dumps(list(t.heldout_ids)))"
    )
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout) == held


def _error(tmp_path: Path, rows_or_text, name: str = "e.jsonl", **fields) -> str:
    path = tmp_path / name
    if isinstance(rows_or_text, str):
        path.write_text(rows_or_text)
    else:
        _jsonl(path, rows_or_text)
    with pytest.raises(ValueError) as caught:
        _task(path, **fields)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("task 't': ")
    return message[len("task 't': ") :]


GOOD = '{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n{"prompt": "c", "answer": 3}\n'


def test_bad_files_are_one_line_errors_naming_the_field(tmp_path: Path) -> None:
    assert _error(tmp_path, GOOD, "e.txt") == (
        f"format 'auto' cannot tell the format of {str(tmp_path / 'e.txt')!r}: name it .jsonl "
        "or .parquet, give a save_to_disk folder, or set format to jsonl, parquet or hf"
    )
    assert _error(tmp_path, GOOD, format="hf").startswith("format 'hf' does not fit ")
    assert (
        _error(tmp_path, GOOD + "[1, 2]\n")
        == "path: line 4 of e.jsonl is not a JSON object (a list)"
    )
    assert _error(tmp_path, GOOD + "{oops\n").startswith(
        "path: line 4 of e.jsonl is not a JSON object (Expecting property name"
    )
    assert _error(tmp_path, GOOD, prompt_field="question") == (
        "prompt_field 'question' is not a column of line 1 of e.jsonl (columns: prompt, answer)"
    )
    assert _error(tmp_path, GOOD + '{"prompt": "d"}\n') == (
        "answer_field 'answer' is not a column of line 4 of e.jsonl (columns: prompt)"
    )
    assert _error(tmp_path, GOOD, id_field="id").startswith("id_field 'id' is not a column")
    assert _error(tmp_path, GOOD, split_field="split").startswith("split_field 'split' is not")
    assert _error(tmp_path, GOOD + '{"prompt": 5, "answer": 1}\n') == (
        "prompt_field 'prompt' of line 4 of e.jsonl must be a text or a list of chat messages "
        "({role, content} texts, one from the user), got 5"
    )
    bad_chat = GOOD + '{"prompt": [{"role": "assistant", "content": "hi"}], "answer": 1}\n'
    assert _error(tmp_path, bad_chat).startswith("prompt_field 'prompt' of line 4 of e.jsonl")
    assert _error(tmp_path, GOOD, heldout_size=3) == (
        "heldout_size must be in [1, 2] for the 3 distinct prompts, got 3"
    )


def test_missing_paths_and_columns_of_every_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^task 't': path '.*nowhere.jsonl' does not exist$"):
        _task(tmp_path / "nowhere.jsonl")
    rows = [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]
    for path in (_parquet(tmp_path / "p.parquet", rows), _saved(tmp_path / "saved", rows)):
        with pytest.raises(ValueError) as caught:
            _task(path, answer_field="solution")
        assert str(caught.value) == (
            f"task 't': answer_field 'solution' is not a column of {path.name} "
            "(columns: prompt, answer)"
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="^task 't': path .* is not a folder written by datasets"):
        _task(tmp_path / "empty")


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (["a", "b", "a"], "id_field 'id' repeats the id 'a' (rows 0 and 2, counting from 0)"),
        (["a", "", "c"], "id_field 'id' of line 2 of e.jsonl must be a non-empty text"),
        (["a", "b c", "d"], "id_field 'id' of line 2 of e.jsonl must be a non-empty text"),
        (["a", None, "d"], "id_field 'id' of line 2 of e.jsonl must be a non-empty text"),
    ],
)
def test_bad_ids_are_refused(tmp_path: Path, ids: list, message: str) -> None:
    rows = [{"id": i, "prompt": f"p{n}", "answer": n} for n, i in enumerate(ids)]
    assert _error(tmp_path, rows, id_field="id").startswith(message)


def test_a_split_with_no_rows_is_refused(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{n}", "answer": n, "s": "train"} for n in range(3)]
    assert _error(tmp_path, rows, split_field="s") == (
        "heldout_split 'test' names no row of split_field 's'"
    )
    rows = [{"prompt": f"p{n}", "answer": n, "s": "dev" if n else "test"} for n in range(3)]
    assert _error(tmp_path, rows, split_field="s") == (
        "train_split 'train' names no row of split_field 's' (other values: dev)"
    )
    rows = [{"prompt": "same", "answer": n, "s": "test" if n else "train"} for n in range(2)]
    assert _error(tmp_path, rows, split_field="s") == (
        "no training rows left: all 1 distinct training prompts repeat held-out prompts"
    )


def test_a_dataset_dict_refuses_a_split_field_and_a_missing_split(tmp_path: Path) -> None:
    data = datasets.Dataset.from_list(ROWS[:6])
    datasets.DatasetDict({"train": data, "dev": data}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError) as caught:
        _task(tmp_path / "dd")
    assert (
        str(caught.value)
        == "task 't': heldout_split 'test' is not a split of dd (splits: train, dev)"
    )
    with pytest.raises(ValueError, match="^task 't': split_field must be empty for a saved"):
        _task(tmp_path / "dd", heldout_split="dev", split_field="id")


def test_a_jsonl_load_reads_one_line(tmp_path: Path, monkeypatch) -> None:
    path = _jsonl(tmp_path / "r.jsonl", ROWS)
    task = _task(path, heldout_size=4)
    reads: list[tuple[int, int]] = []
    real = os.pread

    def counted(fd: int, length: int, offset: int) -> bytes:
        reads.append((length, offset))
        return real(fd, length, offset)

    monkeypatch.setattr(readers.os, "pread", counted)
    assert task.problem("t/17").question == "What is 17+3?"
    lines = path.read_bytes().splitlines(keepends=True)
    assert reads == [(len(lines[17]), sum(len(line) for line in lines[:17]))]
    task.problem("t/17")  # a problem read again is served from memory
    assert len(reads) == 1


def test_a_parquet_load_reads_the_row_group_of_the_row(tmp_path: Path, monkeypatch) -> None:
    task = _task(_parquet(tmp_path / "r.parquet", ROWS, row_group_size=10), heldout_size=4)
    groups: list[tuple[int, list[str]]] = []
    real = pq.ParquetFile.read_row_group

    def counted(self, group, columns=None, **kwargs):
        groups.append((group, columns))
        return real(self, group, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    for row in (12, 13, 35, 14):
        assert task.problem(f"t/{row}").answer == str(row + row % 7)
    # Rows 12-14 share the second group (kept), 35 is in the fourth; only two columns.
    assert groups == [(1, ["prompt", "answer"]), (3, ["prompt", "answer"])]


def _kept(root: object) -> tuple[int, int]:
    """(the longest str, the bytes of arrays) reachable from `root` through containers
    and attributes."""
    seen, stack, longest, array_bytes = set(), [root], 0, 0
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, type):
            continue
        seen.add(id(item))
        if isinstance(item, str):
            longest = max(longest, len(item))
        elif isinstance(item, np.ndarray | array):
            array_bytes += item.itemsize * len(item)
        elif isinstance(item, dict):
            stack.extend([*item.keys(), *item.values()])
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not callable(item):
            stack.extend(vars(item).values())
    return longest, array_bytes


def test_the_index_keeps_no_text_and_writes_nothing(tmp_path: Path, three) -> None:
    before = sorted(Path(three["hf"]).parent.rglob("*"))
    rows = [{"prompt": f"{i} " + "x" * 5000, "answer": i} for i in range(300)]
    task = _task(_jsonl(tmp_path / "long.jsonl", rows), heldout_size=10)
    longest, array_bytes = _kept(task)
    # 1.5 MB of prompts, none kept: offsets, lengths, membership and the split's rows.
    assert longest < 200 and array_bytes == 300 * (8 + 4 + 1 + 8)
    assert len(task.problem("t/7").question) == 5002
    for path in three.values():
        _task(path, heldout_size=3).problem("t/1")
    assert sorted(Path(three["hf"]).parent.rglob("*")) == before


def test_seeded_split_and_given_split_on_digests() -> None:
    texts = ["a", "b", "c", "a", "d", "e", "b"]
    split = seeded_split(text_digests(texts), heldout_size=2, seed=0)
    assert split.duplicates == 2 and len(split.train) + len(split.heldout) == 5
    assert set(split.train.tolist()) | set(split.heldout.tolist()) == {0, 1, 2, 4, 5}
    # A golden value: the seeded order must not move between versions or machines.
    assert split_texts(["a", "b", "c", "d", "e"], 2, 0) == ([0, 2, 4], [1, 3])
    assert split_texts(["a", "b", "c", "d", "e"], 2, 0) == split_texts(list("abcde"), 2, 0)
    assert split_texts(list("abcdefghij"), 3, 1) != split_texts(list("abcdefghij"), 3, 2)
    train = np.array([True, True, True, False, False, True, True])
    given = given_split(text_digests(texts), train, ~train)
    # Held out: rows 3 ("a") and 4 ("d"); training "a" (row 0) leaks, row 6 repeats row 1.
    assert given.heldout.tolist() == [3, 4] and given.train.tolist() == [1, 2, 5]
    assert (given.overlap, given.duplicates) == (1, 1)
    with pytest.raises(ValueError, match=r"heldout_size must be in \[1, 4\] for the 5 distinct"):
        seeded_split(text_digests(texts), heldout_size=5, seed=0)


def test_seeded_order_is_a_prefix_of_the_shuffle() -> None:
    full = seeded_order(1000, 7, 1000)
    assert sorted(full.tolist()) == list(range(1000))
    assert seeded_order(1000, 7, 37).tolist() == full[:37].tolist()
    assert seeded_order(1000, 8, 37).tolist() != full[:37].tolist()


def test_complement_and_row_ids() -> None:
    excluded = np.array([0, 5, 6, 9])
    rows = Complement(10, excluded)
    assert list(rows) == [1, 2, 3, 4, 7, 8] and len(rows) == 6 and rows[-1] == 8
    assert 7 in rows and 6 not in rows and 10 not in rows
    ids = RowIds()
    for row_id in ("x1", "y2", "zz3"):
        ids.add(row_id)
    assert ids.freeze() is None
    assert [ids.row_id(r) for r in range(3)] == ["x1", "y2", "zz3"] and ids.row_of("zz3") == 2
    with pytest.raises(KeyError):
        ids.row_of("x")
