"""A fuzz of bad `scalerl run` invocations: YAML syntax errors, a top-level list or scalar,
an empty file, unreadable files, wrong types, out-of-range values, unknown keys, bad
overrides, bad flags. Every one exits 2 with one line that names the field (or the file
and line), and none starts anything."""

from __future__ import annotations

import pytest

from scalerl_cli import launcher
from scalerl_cli import main as cli

# (the config file's text or None for no file, extra arguments, what the line must hold)
CASES = [
    ("a: [1, 2\n", [], "not valid YAML (line 2, column 1"),
    ("learner:\n  lr: 1\n   beta: 2\n", [], "not valid YAML (line 3, column"),
    ("learner:\n\tlr: 1\n", [], "not valid YAML (line 2"),
    ("run_id: 'unclosed\n", [], "not valid YAML"),
    ("- learner\n- rollout\n", [], "must be a mapping of sections (run_id:, model:"),
    ("42\n", [], "must be a mapping of sections (run_id:, model:, learner:, ...), got an int"),
    ("just a sentence\n", [], "must be a mapping of sections"),
    ("", [], "empty; give the sections to change"),
    ("# only a comment\n", [], "empty; give the sections to change"),
    (b"run_id: \xff\xfe\n", [], "not UTF-8 text"),
    ("bogus: 1\n", [], "bogus: Extra inputs are not permitted"),
    ("learner:\n  bogus: 1\n", [], "learner.bogus: Extra inputs are not permitted"),
    ("learner:\n  lr: abc\n", [], "learner.lr: Input should be a valid number"),
    ("learner:\n  lr: -1\n", [], "learner.lr: Input should be greater than 0"),
    ("learner: 5\n", [], "learner: Input should be a valid dictionary"),
    ("learner:\n  max_steps: 1.5\n", [], "learner.max_steps: Input should be a valid integer"),
    ("rollout:\n  group_size: 0\n", [], "rollout.group_size: Input should be"),
    ("rollout:\n  temperature: hot\n", [], "rollout.temperature: Input should be a valid"),
    ("model:\n  kind: nope\n", [], "model: kind must be one of 'smollm2', 'tiny', 'path'"),
    ("verifier:\n  code:\n    retry_s: -1\n", [], "verifier.code.retry_s: Input should be"),
    ("eval:\n  every: -3\n", [], "eval.every: Input should be"),
    ("task: 7\n", [], "task: Input should be a valid list"),
    ("task:\n  name: x\n  source: nope\n", [], "task.0: source must be one of 'additions', 'file'"),
    ("task:\n  name: x\n  source: file\n", [], "task 'x': path is required for source file"),
    (None, ["--set", "learner.lr"], "override 'learner.lr' must look like section.field=value"),
    (None, ["--set", "=5"], "override '=5' must look like section.field=value"),
    (None, ["--set", "learner.lr=[1, 2"], "learner.lr: the value is not YAML (line 1"),
    (None, ["--set", "learner=5", "--set", "learner.lr=1"], "learner: a section, not a value"),
    (None, ["--set", "no_such_field=1"], "no_such_field: not a config field"),
    (None, ["--set", "lr=abc"], "learner.lr: Input should be a valid number"),
    (None, ["--set", "task.5.weight=1"], "task.5.weight: name a task by index"),
    (None, ["--set", "learner.lend_idle=threads"], "learner.lend_idle: Input should be 'off'"),
    (
        None,
        ["--set", "learner.lend_idle=workers", "--set", "rollout.engine=vllm"],
        "learner.lend_idle: workers needs rollout.engine torch",
    ),
    (None, ["--rollout-workers", "abc"], "scalerl run: --rollout-workers: invalid int value"),
    (None, ["--rollout-workers", "-1"], "rollout.workers: Input should be greater than"),
    (None, ["--recipe", "nosuch"], "recipe"),
    (None, ["--leave-out", "nosuch"], "nosuch"),
    (None, ["--bogus-flag"], "scalerl: unrecognized arguments: --bogus-flag"),
    (None, ["--config", "no-such-config"], "config 'no-such-config': not a YAML file nor"),
    (None, ["--resume", "/nonexistent/run"], "/nonexistent/run"),
]


@pytest.fixture(autouse=True)
def _nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args, **kwargs):
        raise AssertionError("a bad invocation got past its checks: the run would start")

    monkeypatch.setattr(launcher, "secure_run", started)


def _run(argv: list[str]) -> int:
    try:
        return cli.main(["run", *argv])
    except SystemExit as exc:  # argparse's own refusals
        return int(exc.code or 0)


@pytest.mark.parametrize(("content", "args", "expected"), CASES)
def test_a_bad_invocation_is_one_line_and_exit_2(
    content, args: list[str], expected: str, tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.delenv("SCALERL_LEARNER__LR", raising=False)
    argv = [*args] if "--resume" in args else ["--run-dir", str(tmp_path / "run"), *args]
    if content is not None:
        path = tmp_path / "config.yaml"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        argv = ["--config", str(path), *argv]
    assert _run(argv) == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # nothing was written


def test_an_unreadable_config_is_one_line(tmp_path, capsys) -> None:
    folder = tmp_path / "a-folder.yaml"  # exists, but cannot be read as a file
    folder.mkdir()
    assert _run(["--config", str(folder), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"scalerl: config {folder}: cannot be read") and err.count("\n") == 1


def test_a_bad_environment_variable_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SCALERL_LEARNER__LR", "abc")
    assert _run(["--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "learner.lr: Input should be a valid number" in err and err.count("\n") == 1


def test_the_fuzz_holds_at_least_30_invocations() -> None:
    assert len(CASES) + 2 >= 30
