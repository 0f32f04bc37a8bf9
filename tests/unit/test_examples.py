"""The example configs load and build their tasks from the committed data files, and
those files are what examples/make_data.py writes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from scalerl.config import load_config
from scalerl.tasks import build_tasks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _make_data_module():
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLES / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_data_files_are_what_make_data_writes(tmp_path, monkeypatch) -> None:
    make_data = _make_data_module()
    monkeypatch.setattr(make_data, "OUT", tmp_path)
    make_data.main()
    for name in ("math.jsonl", "code.jsonl", "products.jsonl"):
        assert (tmp_path / name).read_text() == (EXAMPLES / "data" / name).read_text(), name


@pytest.mark.parametrize(
    ("config", "splits"),
    [
        ("math", {"math": (340, 60)}),
        ("reasoning_gym", {"arithmetic": (None, 100)}),
        ("math_code", {"math": (360, 40), "code": (32, 8)}),
        ("tools", {"products": (900, 100)}),
    ],
)
def test_each_example_config_builds_its_tasks(
    config: str, splits: dict, tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # data paths are relative to the config file, not here
    run = load_config(str(EXAMPLES / config / "config.yaml"))
    tasks = build_tasks(run)
    try:
        for name, (train, heldout) in splits.items():
            task = tasks[name]
            assert len(task.heldout_ids) == heldout
            if train is not None:
                assert len(task.train_ids) == train
            assert not set(task.train_ids) & set(task.heldout_ids)
            problem = task.problem(task.train_ids[0])
            assert problem.question and problem.answer is not None
    finally:
        tasks.close()
